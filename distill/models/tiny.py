"""Tiny byte-level tokenizer and tiny random Qwen2 models.

Used as test fixtures and by `experiment=tiny`: everything here builds in
milliseconds, offline, and is bit-for-bit deterministic for a given seed.

The tokenizer has no trained merges: token id ``b`` (0..255) is the byte ``b``
of the NFC-normalized UTF-8 text, followed by three special tokens, so any NFC
text round-trips exactly.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 256, 257, 258

# Qwen's ChatML layout without Qwen's default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Shapes of the two tiny models; the drafter keeps the target's width so the
# two can share embeddings in tests.
TINY_SHAPES = {
    "target": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128),
    "drafter": dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128),
}
# Wider than HF's 0.02 so random logits are peaked (near-uniform distributions
# would make acceptance and sampling tests weak).
INITIALIZER_RANGE = 0.2


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens + 3 specials (259 tokens), no merges.

    Returns a fresh ``PreTrainedTokenizerFast`` with a ChatML chat template,
    eos ``<|im_end|>`` (258) and pad ``<|endoftext|>`` (256); no BOS is added.
    """
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # NFC like Qwen's tokenizer: AutoTokenizer reloads any qwen2-type folder as
    # Qwen2Tokenizer (which adds NFC), so a saved tiny model must encode the same way.
    backend.normalizer = normalizers.NFC()
    # use_regex=False: there are no merges, so word splitting would only cost time.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def tiny_config(kind: str, vocab_size: int | None = None) -> Qwen2Config:
    """Qwen2Config for ``kind`` in {"target", "drafter"}.

    ``vocab_size`` defaults to the tiny tokenizer's 259; pass a larger value to
    mimic padded embedding matrices (as the real Qwen models have).
    Raises ``ValueError`` for an unknown kind or a vocab smaller than 259.
    """
    if kind not in TINY_SHAPES:
        raise ValueError(f"tiny model kind must be one of {sorted(TINY_SHAPES)}, got {kind!r}")
    n_tokens = 256 + len(SPECIAL_TOKENS)
    vocab_size = n_tokens if vocab_size is None else int(vocab_size)
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size must be >= {n_tokens} (the tiny tokenizer's size), got {vocab_size}")
    return Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        pad_token_id=256,
        bos_token_id=None,
        eos_token_id=[258, 256],
        **TINY_SHAPES[kind],
    )


def tiny_model(kind: str, vocab_size: int | None = None, seed: int = 0) -> Qwen2ForCausalLM:
    """A random tiny Qwen2ForCausalLM, fp32, in eval mode.

    target: 2 layers, hidden 64, 4 heads (2 KV heads), MLP 128.
    drafter: 1 layer, same width. The weights depend only on ``(kind,
    vocab_size, seed)``; the global torch RNG is left untouched.
    Raises ``ValueError`` as ``tiny_config`` does.
    """
    config = tiny_config(kind, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.to(torch.float32).eval()
    model.generation_config.eos_token_id = [258, 256]
    model.generation_config.pad_token_id = 256
    return model
