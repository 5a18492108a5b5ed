"""decode.progress: heartbeat, a bar redrawn inside long model calls with results unchanged, and ticking."""

from __future__ import annotations

import io

import torch
from peft import LoraConfig, get_peft_model
from tqdm import tqdm

from decode.progress import decoder_layers, heartbeat
from tests.tiny_models import tiny_qwen2

IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


def _bar() -> tuple[tqdm, io.StringIO]:
    out = io.StringIO()
    return tqdm(total=1, file=out, mininterval=0, desc="score"), out


def test_a_still_bar_shows_the_layer_and_the_forward_it_is_in():
    model = tiny_qwen2(3, vocab_size=32)
    bar, out = _bar()
    bar.set_postfix(tok_s="12.0")
    with heartbeat(bar, every_s=0.0, target=model):
        model.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
    text = out.getvalue()
    assert "target forward 1, layer 1/3" in text and "target forward 4, layer 3/3" in text
    assert "tok_s=12.0, target forward" in text  # the caller's own postfix stays in front
    assert not model.model.layers[0]._forward_hooks  # removed on leaving the block


def test_the_backward_pass_beats_too_and_nothing_changes():
    model = tiny_qwen2(2, vocab_size=32).train()
    plain = model(IDS, labels=IDS).loss
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    bar, out = _bar()
    with heartbeat(bar, every_s=0.0, drafter=model):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
    assert "drafter backward, layer 1/2" in out.getvalue()
    assert torch.equal(loss, plain)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_quiet_while_the_bar_moves_on_its_own_and_no_hooks_on_a_disabled_bar():
    model = tiny_qwen2(2, vocab_size=32)
    bar, out = _bar()
    with heartbeat(bar, every_s=3600.0, target=model):
        model(IDS)
    assert "layer" not in out.getvalue()
    off = tqdm(total=1, disable=True)
    with heartbeat(off, every_s=0.0, target=model):
        assert not model.model.layers[0]._forward_hooks


def test_decoder_layers_are_found_through_peft():
    model = tiny_qwen2(2, vocab_size=32)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_layers(wrapped) is model.model.layers
    assert decoder_layers(torch.nn.Linear(2, 2)) is None


def test_ticking_redraws_while_a_silent_call_runs_and_then_goes(capsys):
    import time

    from decode.progress import ticking

    with ticking("reading the tokenizer", every_s=0.1, disable=False):
        time.sleep(0.45)
    drawn = [line for line in capsys.readouterr().err.split("\r") if line.startswith("reading the tokenizer: ")]
    assert len(drawn) >= 4  # the first draw and a redraw every 0.1 s
    with ticking("quiet", disable=True):
        pass
    assert "quiet" not in capsys.readouterr().err
