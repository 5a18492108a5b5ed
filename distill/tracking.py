"""Metric loggers behind one small interface: none, console, JSONL, wandb.

A logger has ``log(metrics, step)``, ``summary(metrics)`` and ``finish()``.
wandb runs offline unless ``logger.mode=online``; its files go into the run folder.
"""

from __future__ import annotations

import json
import netrc
import os
import socket
import sys
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from distill.config import LoggerConfig
from distill.errors import ConfigError


class Logger(Protocol):
    def log(self, metrics: dict[str, Any], step: int | None = None) -> None: ...
    def summary(self, metrics: dict[str, Any]) -> None: ...
    def finish(self) -> None: ...


class NullLogger:
    """Logs nothing (tests, or logger=none)."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        pass

    def summary(self, metrics: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


class ConsoleLogger(NullLogger):
    """Prints the summary at the end (per-step figures are on the progress bar already)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def summary(self, metrics: dict[str, Any]) -> None:
        flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
        print(f"[{self.name}] " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in flat.items()))


class JsonlLogger(ConsoleLogger):
    """Appends one JSON object per ``log`` call to ``<run>/log.jsonl``."""

    def __init__(self, name: str, run_dir: Path) -> None:
        super().__init__(name)
        self.path = Path(run_dir) / "log.jsonl"

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}, default=str) + "\n")

    def summary(self, metrics: dict[str, Any]) -> None:
        self.log({"summary": metrics})
        super().summary(metrics)


class WandbLogger:
    """Weights & Biases run; offline by default (``wandb sync <run>/wandb/...`` uploads later)."""

    def __init__(self, cfg: LoggerConfig, name: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb, self._console = wandb, ConsoleLogger(name)
        try:
            self.run = wandb.init(project=cfg.project, name=name, mode=cfg.mode, dir=str(run_dir),
                                  config=config, reinit="finish_previous")
        except wandb.errors.UsageError as err:  # e.g. online without a key, if check_logger was bypassed
            raise ConfigError(f"wandb could not start ({err}): {_ONLINE_HELP}") from err

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, path: Path) -> None:
        self.run.log({key: self._wandb.Image(str(path))})

    def summary(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float, str, bool)):
                self.run.summary[k] = v
        self._console.summary(metrics)  # the same one-line summary as the other loggers print

    def finish(self) -> None:
        """End the wandb run. A failure here (online, the network gone: wandb times out and raises) is a
        warning: the stage's work is whole and its run folder must still be marked COMPLETE."""
        try:
            self.run.finish()
        except Exception as err:  # noqa: BLE001 (wandb's CommError and whatever its service raises)
            where = Path(getattr(self.run, "dir", "") or ".").parent  # run.dir is <run>/wandb/<wandb run>/files
            reason = (str(err).splitlines() or [""])[0][:200]
            print(f"warning: wandb could not finish ({type(err).__name__}: {reason}); the stage's outputs are "
                  f"whole. Its figures stay in {where}: `wandb sync {where}` uploads them", file=sys.stderr, flush=True)


def run_name(stage: str, run_dir: Path) -> str:
    """A readable run name: ``distill/2026-11-29_10-31-48`` (a pipeline's sub-folder is named after the stage)."""
    run_dir = Path(run_dir)
    stamp = run_dir.parent.name if run_dir.name == stage else run_dir.name
    return f"{stage}/{stamp}"


_ONLINE_HELP = ("run `wandb login` (or set WANDB_API_KEY), or keep logger.mode=offline (the default) and upload "
                "later with `wandb sync <run>/wandb/offline-run-*`")


def check_logger(cfg: LoggerConfig) -> None:
    """Refuse, before any work starts, ``logger.mode=online`` for wandb without credentials (no
    ``WANDB_API_KEY`` and no netrc entry for the wandb host, where ``wandb login`` writes the key) or without
    a way to the server.

    Raises:
        ConfigError: wandb online without an API key, or its server cannot be reached; the message says what
            to do.
    """
    if cfg.kind != "wandb" or cfg.mode != "online":
        return
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if not os.environ.get("WANDB_API_KEY"):
        _check_key(urlparse(base_url).hostname)
    _check_reachable(base_url)


def _check_key(host: str | None) -> None:
    """Refuse when netrc holds no W&B key for ``host`` (``wandb login`` writes it there)."""
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one wandb could not read either
        found = None
    if not found:
        raise ConfigError(f"logger.mode=online needs a W&B API key and none is configured for {host}: {_ONLINE_HELP}")


def _check_reachable(base_url: str, timeout_s: float = 10.0) -> None:
    """Refuse online logging when the W&B server (or the proxy in ``HTTPS_PROXY``) does not answer a TCP
    connect: without it wandb lets the stage do its work, then times out at the end (about 90 s).

    Raises:
        ConfigError: the host cannot be reached; the message names it and the offline alternative.
    """
    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(k)),
                 None)
    url = urlparse(proxy or base_url)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:  # a proxy written without a scheme: wandb's own client reads it; not worth guessing here
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"logger.mode=online: {'the proxy ' if proxy else ''}{host}:{port} cannot be reached "
                          f"({err}), so the run could not be uploaded: check the network, or keep "
                          f"logger.mode=offline (the default) and upload later with "
                          f"`wandb sync <run>/wandb/offline-run-*`") from err


def make_logger(cfg: LoggerConfig, name: str, run_dir: Path, config: dict[str, Any] | None = None) -> Logger:
    """Build the logger chosen by ``logger.kind`` for one stage run."""
    if cfg.kind == "none":
        return NullLogger()
    if cfg.kind == "console":
        return ConsoleLogger(name)
    if cfg.kind == "jsonl":
        return JsonlLogger(name, run_dir)
    return WandbLogger(cfg, name, run_dir, config or {})
