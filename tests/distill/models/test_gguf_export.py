"""GGUF export: read back with gguf's reader and loaded by transformers' GGUF loader."""

from __future__ import annotations

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from distill.models.gguf import export_gguf
from distill.models.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    model, tokenizer = tiny_model("target").eval(), tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    files = {dtype: export_gguf(model, tokenizer, folder, folder / f"drafter-{dtype}.gguf", dtype=dtype)
             for dtype in ("f32", "f16", "q8_0")}
    return model, tokenizer, folder, files


def _field(reader, key):
    field = reader.fields[key]
    return field.contents()


def test_metadata_tensors_and_tokenizer_read_back(exported):
    model, tokenizer, _, files = exported
    reader = gguf.GGUFReader(files["f16"])
    cfg = model.config
    assert _field(reader, "general.architecture") == "qwen2"
    assert _field(reader, "qwen2.block_count") == cfg.num_hidden_layers
    assert _field(reader, "qwen2.embedding_length") == cfg.hidden_size
    assert _field(reader, "qwen2.attention.head_count_kv") == cfg.num_key_value_heads
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg.vocab_size and tokens[256] == "<|endoftext|>"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{part}" for i in range(cfg.num_hidden_layers)
        for part in ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias",
                     "attn_output.weight", "attn_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                     "ffn_down.weight")}
    if not cfg.tie_word_embeddings:
        expected.add("output.weight")
    assert set(tensors) == expected
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(reversed(q.shape.tolist())) == list(model.model.layers[0].self_attn.q_proj.weight.shape)


@pytest.mark.parametrize("dtype, tolerance", [("f32", 1e-5), ("f16", 5e-2), ("q8_0", 5e-2)])
def test_transformers_loads_the_gguf_back(exported, dtype, tolerance):
    model, _, folder, files = exported
    reloaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=files[dtype].name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 100, 200, 7]])
    with torch.no_grad():
        expected, got = model(ids).logits, reloaded(ids).logits
    assert (got - expected).abs().max().item() < tolerance * max(1.0, expected.abs().max().item())


def test_other_architectures_are_refused(exported, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    _, tokenizer, folder, _ = exported
    with pytest.raises(ValueError, match="GGUF export supports"):
        export_gguf(llama, tokenizer, folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.extra
@pytest.mark.real
@pytest.mark.slow
def test_real_tokenizer_and_vocabulary_round_trip_through_gguf(qwen05, tmp_path):
    """The shipped 0.5B's tokenizer and architecture (its 151,936-token vocabulary and its head as loaded) at one narrow random
    layer, exported to GGUF: transformers' GGUF loader gives the same greedy tokens and the same tokenizer. The
    real weights would only add export and load time (the tiny model above checks the tensors); most of what is
    left is the 151,936-token vocabulary going through the GGUF tokenizer."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from decode.speculative import target_generate

    real, tokenizer = qwen05
    config = real.config.__class__.from_dict({**real.config.to_dict(), "num_hidden_layers": 1, "hidden_size": 64,
                                               "intermediate_size": 128, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "initializer_range": 0.2,
                                               "layer_types": ["full_attention"]})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.config.vocab_size == 151936
    tokenizer.save_pretrained(tmp_path)
    export_gguf(model, tokenizer, tmp_path, tmp_path / "drafter.gguf", dtype="f32")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="drafter.gguf", dtype=torch.float32).eval()
    ids = tokenizer("def fib(n):", return_tensors="pt").input_ids
    expected = target_generate(model, ids, max_new_tokens=16, eos_token_ids=[]).new_tokens
    assert torch.equal(target_generate(reloaded, ids, max_new_tokens=16, eos_token_ids=[]).new_tokens, expected)
    again = AutoTokenizer.from_pretrained(tmp_path, gguf_file="drafter.gguf")
    assert again("def fib(n):\n    return").input_ids == tokenizer("def fib(n):\n    return").input_ids


@pytest.mark.real
@pytest.mark.slow
def test_llama_cpp_runs_the_exported_gguf(qwen05, tmp_path):
    """Where llama-cpp-python is installed: llama.cpp loads the exported 0.5B, tokenizes like transformers
    and decodes the same greedy tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from decode.speculative import target_generate

    model, tokenizer = qwen05
    tokenizer.save_pretrained(tmp_path)
    export_gguf(model, tokenizer, tmp_path, tmp_path / "drafter.gguf", dtype="f16")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "drafter.gguf"), n_ctx=256, verbose=False, seed=0)
    prompt = "def fib(n):\n    "
    ids = tokenizer(prompt).input_ids
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
    expected = target_generate(model, torch.tensor([ids]), max_new_tokens=12, eos_token_ids=[]).new_tokens.tolist()
    got = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        got.append(token)
        if len(got) == len(expected):
            break
    assert got == expected
