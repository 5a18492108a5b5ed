"""GGUF export of a tuned drafter, for llama.cpp (``llama-speculative -md drafter.gguf``).

Written with the ``gguf`` package (llama.cpp's gguf-py): the architecture
metadata, the tokenizer (byte-level BPE "gpt2" model with the "qwen2"
pre-tokenizer, tokens padded with ``[PAD<id>]`` up to the embedding rows as
llama.cpp's converter does, merges and special ids through
``gguf.SpecialVocab``) and the tensors under llama.cpp's names
(``gguf.get_tensor_name_map``). Qwen2 keeps its q/k layout (llama.cpp runs
it with NeoX rope, no permutation). 2-D weights in f16/bf16/f32/q8_0, norms and
biases in f32, as llama.cpp's converter writes them.

Only the Qwen2 family (draftsmith's shipped pair and its depth-pruned cuts)
is supported; other architectures get a clear error.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

SUPPORTED = {"qwen2": "qwen2"}  # transformers model_type -> GGUF architecture
GGUF_DTYPES = ("f16", "bf16", "f32", "q8_0")


def _tokens(tokenizer, n_rows: int) -> tuple[list[str], list[int]]:
    """Token strings and llama.cpp token types for ids 0..n_rows-1 (padding rows named ``[PAD<id>]``)."""
    import gguf

    vocab = tokenizer.get_vocab()
    added = {token.content: token for token in tokenizer.added_tokens_decoder.values()}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_rows):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif text in added:
            tokens.append(text)
            types.append(gguf.TokenType.CONTROL if added[text].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def export_gguf(model, tokenizer, tokenizer_dir: Path, out_file: Path, dtype: str = "f16",
                name: str = "draftsmith drafter") -> Path:
    """Write ``model`` (a transformers Qwen2 causal LM) and its tokenizer to ``out_file`` atomically.

    Args:
        model: the merged drafter (no LoRA wrappers).
        tokenizer: its tokenizer (a fast tokenizer with ``tokenizer.json``).
        tokenizer_dir: a folder holding the saved tokenizer files (merges, special tokens, chat template).
        out_file: destination ``.gguf`` path.
        dtype: ``f16`` (default, what llama.cpp drafters usually are), ``bf16``, ``f32`` or ``q8_0`` (8-bit
            blocks of 32, as llama.cpp's converter writes with ``--outtype q8_0``; a matrix whose rows are not a
            multiple of 32 stays f32) for 2-D weights.
        name: ``general.name``.

    Returns:
        ``out_file``.

    Raises:
        ValueError: an architecture other than Qwen2, a tensor without a GGUF name, or a bad dtype.
    """
    import gguf

    config = model.config
    if config.model_type not in SUPPORTED:
        raise ValueError(f"GGUF export supports {sorted(SUPPORTED)} models, not {config.model_type!r}; "
                         f"export the Hugging Face folder only (export.gguf=false) and convert it with llama.cpp")
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype must be one of {GGUF_DTYPES}, got {dtype!r}")
    arch = SUPPORTED[config.model_type]
    n_layers = config.num_hidden_layers
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n_layers)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == embed.data_ptr() or bool(getattr(config, "tie_word_embeddings", False))
    n_rows = embed.shape[0]

    out_file = Path(out_file)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(n_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope_theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])

    tokens, types = _tokens(tokenizer, n_rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(Path(tokenizer_dir), load_merges=True, n_vocab=n_rows)
    special.add_to_gguf(writer)

    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and tied:
            continue  # llama.cpp reuses token_embd when there is no output tensor
        gguf_name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {key!r} of a {config.model_type} model")
        data = tensor.detach().to(torch.float32).cpu()
        if data.ndim == 2 and dtype == "f16":
            writer.add_tensor(gguf_name, data.numpy().astype(np.float16))
        elif data.ndim == 2 and dtype == "q8_0" and data.shape[-1] % 32 == 0:  # Q8_0 blocks of 32 along rows
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(data.numpy(), q8), raw_dtype=q8)
        elif data.ndim == 2 and dtype == "bf16":
            bits = data.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(gguf_name, bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gguf_name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out_file)
    return out_file
