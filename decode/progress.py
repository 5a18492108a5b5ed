"""A progress bar that moves inside long model calls, and a line that ticks through silent library calls.

A CPU takes 15-60 s over one scoring batch, one batch of ``generate``, one timed prompt or one training step;
a bar that moves only between them looks hung. :func:`heartbeat` hooks the models' decoder layers (forward
hooks, and gradient hooks on their outputs for the backward pass) and, when the bar has not been redrawn for
``every_s`` seconds, redraws it with where the call is: ``target forward 12, layer 14/28``. The hooks read no
tensor and change no result; the redraw costs one terminal write.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of decoder layers (the first ``nn.ModuleList`` named ``layers``, through peft and
    quantization wrappers), or None where it has none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module):
            return module
    return None


class _Beat:
    """Redraws ``bar`` with a status text once it has been still for ``every_s`` seconds."""

    def __init__(self, bar, every_s: float):
        self.bar, self.every_s = bar, every_s
        self.base = self.shown = None

    def __call__(self, status: str) -> None:
        if time.time() - self.bar.last_print_t < self.every_s:
            return
        postfix = self.bar.postfix or ""
        if postfix != self.shown:  # the caller set its own postfix since the last beat: keep it in front
            self.base = postfix
        self.shown = f"{self.base}, {status}" if self.base else status
        self.bar.set_postfix_str(self.shown, refresh=True)


@contextlib.contextmanager
def heartbeat(bar, every_s: float = 5.0, **models: nn.Module) -> Iterator[None]:
    """Within the block, ``bar`` (a tqdm bar) is redrawn at most every ``every_s`` seconds while any of
    ``models`` (by name: ``target=...``, ``drafter=...``) runs a decoder layer, its postfix followed by
    ``<name> forward <n>, layer <i>/<L>`` (``n`` counts the model's forwards in the block: a ``generate``
    call's decoding steps) or ``<name> backward, layer <i>/<L>``. A disabled bar, or a model without
    decoder layers, gets no hooks. The hooks are removed on leaving the block, also on an error."""
    if getattr(bar, "disable", True):
        yield
        return
    beat, handles = _Beat(bar, every_s), []
    for name, model in models.items():
        layers = decoder_layers(model) if model is not None else None
        if layers is not None:
            handles += _hook_layers(layers, name, beat)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hook_layers(layers: nn.ModuleList, name: str, beat: _Beat) -> list:
    forwards, total = [0], len(layers)

    def on_forward(index: int):
        def hook(_module, _inputs, output):
            if index == 0:
                forwards[0] += 1
            beat(f"{name} forward {forwards[0]}, layer {index + 1}/{total}")
            hidden = output[0] if isinstance(output, tuple) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad: beat(f"{name} backward, layer {index + 1}/{total}"))
        return hook

    return [layer.register_forward_hook(on_forward(i)) for i, layer in enumerate(layers)]


@contextlib.contextmanager
def ticking(desc: str, every_s: float = 5.0, disable: bool | None = None) -> Iterator[None]:
    """Within the block, a tqdm line ``<desc>: <elapsed>`` redrawn every ``every_s`` seconds from a daemon
    thread: for one long library call that reports nothing itself (reading a GGUF's tokenizer, a model's
    load), so the terminal shows it is alive. The line is removed on leaving the block, also on an error;
    ``disable`` None hides it where stderr is not a terminal, as tqdm does."""
    import threading

    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", leave=False, disable=disable)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            bar.refresh()

    thread = threading.Thread(target=tick, name="ticking", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()
