"""The target's answers from vLLM (``generate.engine=vllm``): the rows :func:`distill.stages.generate.answer_batch`
writes, from the engine SpecForge and vllm-project/speculators generate drafter data with.

vLLM batches continuously (a finished answer's slot goes to the next prompt) and keeps its KV cache in pages, so
one call takes a whole group of shards. It returns the top-k log-probabilities of the raw logits
(``logprobs_mode="raw_logprobs"``: temperature 1, before top-p), the distribution draftsmith stores, plus the
sampled token when it is outside the top k, which is dropped here. Sampled answers are seeded per prompt, so a
resumed shard draws what it would have drawn.

vLLM is optional and installed after draftsmith (:data:`VLLM_INSTALL`: its CPU build pins an older transformers,
which is put back); nothing here imports it at module level.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from decode.engines.vllm_engine import VLLM_INSTALL, cpu_engine_env, vllm_installed  # noqa: F401 (re-exported)
from distill.errors import ConfigError


def require_vllm() -> None:
    """Raises:
        ConfigError: vLLM is not installed, naming the extra that installs it and the engine that needs nothing.
    """
    if not vllm_installed():
        raise ConfigError(f"generate.engine=vllm: vLLM is not installed. Install it with {VLLM_INSTALL} (on a GPU "
                          f"node: pip install vllm) or use generate.engine=hf")


class VllmAnswerer:
    """One vLLM engine over the target, answering token-id prompts in generate's row format.

    Args:
        model_path: the target's HF folder (:class:`distill.models.loading.ResolvedModel` ``.path``).
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` (``auto`` resolved by the caller).
        max_model_len: prompt + answer tokens of the longest request.
        max_num_seqs: requests decoded together at most.
        store_top_k: log-probabilities kept per position (0 = none).
        seed: the engine's seed (sampled answers are also seeded per request).

    Raises:
        ConfigError: vLLM is not installed.
    """

    def __init__(self, model_path, *, dtype: str, max_model_len: int, max_num_seqs: int, store_top_k: int,
                 seed: int) -> None:
        require_vllm()
        if not _on_cuda():
            for key, value in cpu_engine_env().items():
                os.environ.setdefault(key, value)
        from vllm import LLM

        self.store_top_k = store_top_k
        self.llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       seed=seed, logprobs_mode="raw_logprobs", max_logprobs=max(store_top_k, 1),
                       enable_prefix_caching=False)

    def answer(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, eos_ids: Sequence[int],
               max_new_tokens: int, temperature: float, top_p: float) -> list[dict]:
        """Answer ``prompts`` (token ids, ragged) in one continuously batched call.

        Args:
            seeds: one per prompt; used when ``temperature > 0``.

        Returns:
            per prompt, as :func:`distill.stages.generate.answer_batch`: ``completion_ids`` (up to and including
            the first EOS), ``finish_reason`` (``"eos"`` / ``"length"``), and with ``store_top_k`` ``top_k_ids``
            and ``top_k_logprobs`` (completion length x k, nats, descending).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def params(seed: int) -> SamplingParams:
            sampling = dict(temperature=temperature, top_p=top_p, seed=seed) if temperature > 0 else \
                dict(temperature=0.0)
            return SamplingParams(max_tokens=max_new_tokens, stop_token_ids=list(eos_ids),
                                  logprobs=self.store_top_k or None, **sampling)

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    [params(s) for s in seeds], use_tqdm=False)
        return [answer_row(out.outputs[0].token_ids, out.outputs[0].logprobs, eos_ids, self.store_top_k)
                for out in outputs]

    def close(self) -> None:
        """Stop the engine's processes and free its memory."""
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del self.llm


def answer_row(token_ids: Sequence[int], logprobs, eos_ids: Sequence[int], store_top_k: int) -> dict:
    """One vLLM completion as a generate row.

    Args:
        token_ids: the completion's tokens (vLLM keeps a stop token id in them).
        logprobs: per position a ``{token_id: Logprob}`` dict (``.logprob``, ``.rank`` from 1), or None.

    Raises:
        RuntimeError: fewer log-probability rows than tokens, or a position with fewer than k ranked tokens.
    """
    tokens = list(token_ids)
    eos = set(eos_ids)
    end = next((i + 1 for i, tok in enumerate(tokens) if tok in eos), None)
    row = {"completion_ids": tokens[:end] if end else tokens, "finish_reason": "eos" if end else "length"}
    if store_top_k:
        n = len(row["completion_ids"])
        if logprobs is None or len(logprobs) < n:
            raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} log-probability rows for "
                               f"{n} answer tokens")
        ids, values = [], []
        for position in logprobs[:n]:
            ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in position.items()
                            if lp.rank is not None and lp.rank <= store_top_k)
            if len(ranked) < store_top_k:
                raise RuntimeError(f"vLLM returned {len(ranked)} ranked tokens where {store_top_k} were asked")
            ids.append([tok for _, tok, _ in ranked])
            values.append([float(value) for _, _, value in ranked])
        row["top_k_ids"], row["top_k_logprobs"] = ids, values
    return row


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
