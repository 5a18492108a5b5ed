"""llama.cpp with a drafter (``llama-speculative-simple --spec-type draft-simple -md``), measured on the timed
prompts with llama.cpp's own tools.

The binaries come from a llama.cpp build (``llama-completion``, ``llama-speculative-simple``, ``llama-bench``;
:data:`BUILD` builds them from llama-cpp-python's sdist), found in ``bin_dir``, ``$LLAMA_CPP_BIN`` or ``PATH``.
Prompts are passed as text (``-p``: the chat-templated prompt decoded with its special tokens, which llama.cpp
parses back), decoded greedily (``--temp 0``) one at a time on every core. Rates are decoding rates after the prompt,
as each tool prints them: ``eval time`` of ``llama-completion``, ``decoded ... t/s`` of
``llama-speculative-simple``. Costs come from ``llama-bench`` with the timed prompts' mean length as depth: the
decoding step (``-n``) and the forward over n new tokens (``-p n``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench")
BUILD = ("pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf "
         "llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build "
         "-DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build -j --target llama-completion "
         "llama-speculative-simple llama-bench (then evaluate.llama_cpp_bin=$PWD/build/bin)")


def find_tools(bin_dir: str | os.PathLike | None = None) -> dict[str, Path] | None:
    """Paths of :data:`TOOLS` in ``bin_dir``, else ``$LLAMA_CPP_BIN``, else ``PATH``; None when any is missing."""
    folder = bin_dir or os.environ.get("LLAMA_CPP_BIN")
    found = {}
    for tool in TOOLS:
        path = shutil.which(tool, path=str(folder)) if folder else shutil.which(tool)
        if path is None:
            return None
        found[tool] = Path(path)
    return found


def version(tools: dict[str, Path]) -> str:
    """llama.cpp's version line, e.g. ``llama.cpp 0.5.0-dev (build 1, commit 0c1e570)``."""
    proc = subprocess.run([str(tools["llama-completion"]), "--version"], capture_output=True, text=True, timeout=60)
    line = next((ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version:")), "version: ?")
    return "llama.cpp " + line.removeprefix("version:").strip()


def _threads() -> str:
    return str(len(os.sched_getaffinity(0)))


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise RuntimeError(f"{Path(command[0]).name} failed with exit code {proc.returncode}:\n{tail}")
    return proc


def _with_prompt(prompt: str, command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    # -p, not -f: llama.cpp drops a prompt file's last newline, the one after the chat template's assistant header
    return _run([*command, "-p", prompt], timeout_s)


def plain(tools: dict[str, Path], model: Path, prompt: str, max_new_tokens: int, timeout_s: float = 900
          ) -> dict[str, Any]:
    """The target alone: ``{"text", "tokens", "tokens_per_s"}`` (decoding rate, prompt excluded).

    Raises:
        RuntimeError: the tool failed or printed no timing.
    """
    proc = _with_prompt(prompt, [str(tools["llama-completion"]), "-m", str(model), "-n", str(max_new_tokens),
                                      "--temp", "0", "-no-cnv", "--no-display-prompt", "-t", _threads(),
                                      "-c", "4096"], timeout_s)
    match = re.search(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", proc.stderr)
    if match is None:
        raise RuntimeError(f"llama-completion printed no eval time:\n{proc.stderr[-1500:]}")
    ms, runs = float(match.group(1)), int(match.group(2))
    return {"text": proc.stdout.removesuffix(" [end of text]\n").rstrip("\n"), "tokens": runs + 1,
            "tokens_per_s": runs / (ms / 1000)}


def speculative(tools: dict[str, Path], model: Path, drafter: Path, prompt: str, max_new_tokens: int,
                draft_length: int, timeout_s: float = 900) -> dict[str, Any]:
    """The target with ``drafter`` drafting up to K = ``draft_length``: ``{"text", "tokens", "tokens_per_s",
    "drafted", "accepted"}``.

    Raises:
        RuntimeError: the tool failed or printed no timing.
    """
    proc = _with_prompt(prompt, [
        str(tools["llama-speculative-simple"]), "-m", str(model), "-md", str(drafter), "--spec-type",
        "draft-simple", "--spec-draft-n-max", str(draft_length), "--spec-draft-n-min", "0", "-n",
        str(max_new_tokens), "--temp", "0", "-t", _threads(), "-td", _threads(), "-c", "4096"], timeout_s)
    found = {key: re.search(pattern, proc.stderr) for key, pattern in (
        ("speed", r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"), ("drafted", r"n_drafted\s*=\s*(\d+)"),
        ("accepted", r"n_accept\s*=\s*(\d+)"))}
    if not all(found.values()):
        raise RuntimeError(f"llama-speculative-simple printed no timing or counters:\n{proc.stderr[-1500:]}")
    tokens, seconds = int(found["speed"].group(1)), float(found["speed"].group(2))
    text = proc.stdout.removeprefix("\n\n")
    return {"text": text.removeprefix(prompt).rstrip("\n"), "tokens": tokens, "tokens_per_s": tokens / seconds,
            "drafted": int(found["drafted"].group(1)), "accepted": int(found["accepted"].group(1))}


def bench(tools: dict[str, Path], model: Path, depth: int, new_tokens: list[int], timeout_s: float = 1800
          ) -> dict[str, Any]:
    """``llama-bench`` with ``depth`` tokens in the cache: ``{"step_s", "forward_s": {n: s}}``, the decoding step
    (s/token) and the forward over n new tokens (s) for each n in ``new_tokens``."""
    base = [str(tools["llama-bench"]), "-m", str(model), "-d", str(depth), "-r", "3", "-t", _threads(), "-o", "json"]
    step = json.loads(_run(base + ["-p", "0", "-n", "16"], timeout_s).stdout)
    out: dict[str, Any] = {"step_s": 1.0 / step[0]["avg_ts"], "forward_s": {}}
    if new_tokens:
        rows = json.loads(_run(base + ["-p", ",".join(map(str, new_tokens)), "-n", "0"], timeout_s).stdout)
        out["forward_s"] = {int(r["n_prompt"]): int(r["n_prompt"]) / r["avg_ts"] for r in rows}
    return out
