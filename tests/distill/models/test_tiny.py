import unicodedata

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.models.tiny import IM_END, IM_START, tiny_model, tiny_tokenizer

TEXTS = [
    "hello world",
    "  def f(x):\n\treturn x * 2\n",
    "héllo wörld — 日本語 ✓ 🙂",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_vocab_layout(tok):
    assert len(tok) == 259
    assert tok.convert_tokens_to_ids(["<|endoftext|>", IM_START, IM_END]) == [256, 257, 258]
    assert tok.eos_token == IM_END and tok.eos_token_id == 258
    assert tok.pad_token_id == 256
    assert tok.bos_token is None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, no BOS
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    ids = tok(f"{IM_START}user\nhi{IM_END}")["input_ids"]
    assert ids == [257, *b"user\nhi", 258]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(tok):
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<|im_start|>user\nhi<|im_end|>\n"


def test_tiny_models_shapes():
    target, drafter = tiny_model("target"), tiny_model("drafter")
    assert target.config.num_hidden_layers == 2 and drafter.config.num_hidden_layers == 1
    for model in (target, drafter):
        assert model.config.hidden_size == 64
        assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
        assert model.config.intermediate_size == 128
        assert model.dtype == torch.float32 and not model.training
    logits = target(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 259)
    assert tiny_model("target", vocab_size=320).lm_head.weight.shape == (320, 64)


def test_tiny_models_deterministic():
    torch.manual_seed(123)
    before = torch.rand(1)
    a, b = tiny_model("target", seed=7), tiny_model("target", seed=7)
    c = tiny_model("target", seed=8)
    for (name, wa), wb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(wa, wb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    # The global RNG is untouched: building a model does not shift other seeded code.
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)


def test_logits_are_not_flat():
    # Wider init than HF's default, so acceptance/sampling tests have something to detect.
    probs = torch.softmax(tiny_model("target")(torch.tensor([list(b"def f")])).logits[0, -1], -1)
    assert probs.max() > 5 / 259


def test_unknown_kind():
    with pytest.raises(ValueError, match="target"):
        tiny_model("giant")
    with pytest.raises(ValueError, match="259"):
        tiny_model("target", vocab_size=100)


def test_save_and_reload_identical(tmp_path, tok):
    """AutoTokenizer reloads a qwen2-type folder as Qwen2Tokenizer: ids must not change."""
    model = tiny_model("drafter")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    nfd = unicodedata.normalize("NFD", "café naïve")
    for text in [*TEXTS, nfd, "<|im_start|>user\nx<|im_end|>"]:
        assert tok2(text)["input_ids"] == tok(text)["input_ids"], text
    assert tok2.chat_template == tok.chat_template
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([[5, 6, 7, 258]])
    assert torch.equal(model2(x).logits, model(x).logits)
