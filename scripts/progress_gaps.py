"""The silent gaps in a command's output: how long a user watching the terminal sees nothing move.

    python scripts/progress_gaps.py -- draftsmith pipeline
    python scripts/progress_gaps.py --top 5 --json -- draftsmith pipeline experiment=tiny

The command runs under a pseudo-terminal (so progress bars draw as they do for a user), its output passes
through unchanged, and every write is timestamped. At the end the longest gaps between two writes are listed
with the last line shown before each gap (what the user was looking at) and the first line after it. A gap
over ``--limit`` seconds (default 15) makes the exit code 1; the command's own failure is passed on as its
exit code.

JSON (``--json``, after the command's output): ``{"returncode", "seconds", "writes", "limit_s",
"gaps": [{"seconds", "at_s", "before", "after"}], "over_limit"}``; ``at_s`` is when the gap began, in seconds
from the start.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
from fcntl import ioctl

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` as a terminal shows it (escape codes dropped, ``\\r`` redraws
    keeping their last state)."""
    lines = [ANSI.sub("", part.split("\r")[-1] if part.split("\r")[-1].strip() else part).strip()
             for part in text.replace("\r\n", "\n").split("\n")]
    lines = [line for line in lines if line]
    return lines[-1][:160] if lines else ""


def first_line(text: str) -> str:
    """The first non-empty line of ``text`` (escape codes dropped)."""
    for part in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if (line := ANSI.sub("", part).strip()):
            return line[:160]
    return ""


def record(command: list[str]) -> tuple[int, list[tuple[float, str]], float]:
    """Run ``command`` on a pseudo-terminal, echoing its output. Returns ``(returncode, [(seconds from start,
    text written)], total seconds)``."""
    master, slave = pty.openpty()
    # a new pseudo-terminal is 0 x 0, where progress bars draw nothing: give it this terminal's size
    columns, rows = shutil.get_terminal_size((120, 40))
    ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    writes: list[tuple[float, str]] = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the command and its children closed the terminal
            break
        if not chunk:
            break
        writes.append((time.perf_counter() - start, chunk.decode("utf-8", "replace")))
        sys.stdout.write(writes[-1][1])
        sys.stdout.flush()
    os.close(master)
    return proc.wait(), writes, time.perf_counter() - start


def gaps(writes: list[tuple[float, str]], total: float) -> list[dict]:
    """Every silence, longest first: from the start to the first write, between writes, and from
    the last write to the end."""
    times = [0.0, *(t for t, _ in writes), total]
    texts = ["", *(text for _, text in writes), ""]
    found = []
    shown = ""
    for i in range(1, len(times)):
        found.append({"seconds": round(times[i] - times[i - 1], 1), "at_s": round(times[i - 1], 1),
                      "before": last_line(shown), "after": first_line(texts[i])})
        shown = (shown + texts[i])[-4000:]
    return sorted(found, key=lambda g: -g["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=15.0, help="seconds of silence allowed (exit 1 above it)")
    parser.add_argument("--top", type=int, default=10, help="gaps listed")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the output")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    returncode, writes, total = record(command)
    every = gaps(writes, total)
    longest, over = every[:args.top], [g for g in every if g["seconds"] > args.limit]
    result = {"returncode": returncode, "seconds": round(total, 1), "writes": len(writes), "limit_s": args.limit,
              "gaps": longest, "over_limit": len(over)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"\n{len(writes)} writes in {total:.0f} s; the longest silences (limit {args.limit:g} s):")
        for g in longest:
            mark = "  OVER" if g["seconds"] > args.limit else ""
            print(f"{g['seconds']:7.1f} s at {g['at_s']:7.1f} s{mark}\n    before: {g['before']}\n    after:  {g['after']}")
    sys.exit(returncode if returncode else (1 if over else 0))


if __name__ == "__main__":
    main()
