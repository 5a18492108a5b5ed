"""``distill.parallel=fsdp``: accelerate's FSDP2 plugin, refused where accelerate would not apply it, and the
training loop's checkpoints under really sharded parameters.

accelerate (1.16) applies an FSDP plugin only to processes a launcher started on GPUs: on CPUs it trains with
DDP and in a process started without a launcher it leaves the model alone, both without a word. So on CPU the
stage refuses ``distill.parallel=fsdp`` (tested here). torch's FSDP2 itself (``fully_shard``) runs on CPU
over gloo: the two-process tests switch accelerate's FSDP2 path on for gloo CPU processes
(:func:`_force_fsdp_on_cpu`), so that the loop's gathering, saving and resuming run against DTensor shards.
What they cannot show is NCCL on GPUs (``scripts/gpu_check.sh`` runs that).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loop_settings import loop_settings
from spawned import spawn_and_collect

from distill.errors import ConfigError, DraftsmithError

WORLD_SIZE = 2
BATCH = 2      # examples per process per micro-batch
GRAD_ACCUM = 2  # micro-batches per step: FSDP's unsynchronised backward passes, then one reduce-scatter
STEPS = 3      # 3 steps x 2 processes x 2 x 2 examples = 24 > 8 examples: crosses epoch boundaries
SEED = 0
LR = 1e-2      # large, so a wrong gradient shows in the weights after a few steps
COMPLETION_LENGTHS = (2, 3, 5, 9, 14, 20, 6, 11)

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                          reason="torch.distributed with the gloo backend is not available")


def _examples() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"prompt_ids": torch.randint(0, 256, (3 + i % 4,), generator=g).tolist(),
             "completion_ids": torch.randint(0, 256, (n,), generator=g).tolist()}
            for i, n in enumerate(COMPLETION_LENGTHS)]


# ---------------------------------------------------------------------------------------------
# the setting, its plugin and its refusals (no process group)


def _compose(*overrides: str):
    from tests.distill.test_config import _compose as compose

    return compose(*overrides)


def test_composed_fsdp_config_carries_the_fsdp2_plugin():
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import CPUOffloadPolicy, StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from distill.models.tiny import tiny_model
    from distill.parallel import accelerator_kwargs

    cfg = _compose("experiment=tiny", "distill.parallel=fsdp", "distill.grad_accum=3")
    assert cfg.distill.parallel == "fsdp"
    kwargs = accelerator_kwargs(cfg.distill.parallel, grad_accum=cfg.distill.grad_accum, mixed_precision="no")
    assert kwargs["gradient_accumulation_steps"] == 3 and kwargs["mixed_precision"] == "no"
    plugin = kwargs["fsdp_plugin"]
    assert plugin.fsdp_version == 2
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.mixed_precision_policy is None  # float32 throughout
    # bf16: layers gathered in bf16 for compute, gradients reduced in float32 as under DDP
    bf16 = accelerator_kwargs("fsdp", grad_accum=1, mixed_precision="bf16")["fsdp_plugin"].mixed_precision_policy
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    # the unit of sharding is the decoder layer (the model's _no_split_modules)
    model = tiny_model("drafter")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    units = [name for name, module in model.named_modules() if policy(module)]
    assert units == ["model.layers.0"] and isinstance(model.model.layers[0], Qwen2DecoderLayer)
    # the default is DDP as before: no plugin
    ddp = _compose("experiment=tiny")
    assert ddp.distill.parallel == "ddp"
    assert accelerator_kwargs(ddp.distill.parallel, grad_accum=1, mixed_precision="no") == {
        "gradient_accumulation_steps": 1, "mixed_precision": "no"}


@pytest.mark.parametrize("overrides, key, hint", [
    (("distill.parallel=zero3",), "distill.parallel", "must be ddp or fsdp"),
    (("distill.parallel=fsdp", "distill.on_policy_fraction=0.5", "distill.target_source=online"),
     "distill.on_policy_fraction", "distill.parallel=ddp"),
    (("distill.parallel=fsdp", "distill.method=qlora"), "distill.method", "distill.method=lora or full"),
])
def test_fsdp_settings_it_cannot_run_are_refused_when_composed(overrides, key, hint):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        _compose(*overrides)
    assert hint in str(err.value)


@cpu_only
def test_fsdp_without_cuda_is_refused_before_anything_loads(tmp_path):
    from tests.distill.test_config import cli_in_process

    # no generate run exists: the refusal comes before the stage looks for one
    proc = cli_in_process("distill", "experiment=tiny", "distill.parallel=fsdp", f"outputs={tmp_path}/out",
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "distill.parallel=fsdp needs CUDA GPUs" in proc.stderr and "use distill.parallel=ddp" in proc.stderr
    assert "Traceback" not in proc.stderr and not list((tmp_path / "out").glob("distill/*"))


@cpu_only
def test_training_loop_refuses_fsdp_that_accelerate_would_drop(monkeypatch, tmp_path):
    from distill.models.tiny import tiny_model
    from distill.training.loop import train_drafter

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    drafter = tiny_model("drafter", seed=1)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    with pytest.raises(DraftsmithError, match="on CPU use distill.parallel=ddp"):
        train_drafter(drafter, tiny_model("target", seed=0), _examples(), loop_settings(max_steps=1, parallel="fsdp"),
                      output_dir=tmp_path, progress=False)
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert not list(tmp_path.iterdir())  # refused before the first step and the first file
    # accelerate set ACCELERATE_USE_FSDP=true when given the plugin: unset again, a later run is not FSDP
    assert "ACCELERATE_USE_FSDP" not in os.environ


def test_a_checkpoint_resumes_only_under_the_parallel_that_wrote_it(tmp_path):
    from distill.training.checkpoint import check_resume_parallel

    check_resume_parallel({"step": 2}, tmp_path, "ddp")  # checkpoints that do not say are DDP's
    check_resume_parallel({"parallel": "fsdp"}, tmp_path, "fsdp")
    with pytest.raises(DraftsmithError, match="resume with distill.parallel=fsdp"):
        check_resume_parallel({"parallel": "fsdp"}, tmp_path, "ddp")
    with pytest.raises(DraftsmithError, match="resume with distill.parallel=ddp"):
        check_resume_parallel({"step": 2}, tmp_path, "fsdp")


def test_an_fsdp_run_is_keyed_apart_for_auto_resume():
    from distill.training.resume import resume_key

    ddp = resume_key(_compose("experiment=tiny"), "data-a", "fp")
    assert resume_key(_compose("experiment=tiny", "distill.parallel=ddp"), "data-a", "fp") == ddp
    assert resume_key(_compose("experiment=tiny", "distill.parallel=fsdp"), "data-a", "fp") != ddp


# ---------------------------------------------------------------------------------------------
# two gloo CPU processes, FSDP2-sharded


def _force_fsdp_on_cpu() -> None:
    """Turn accelerate's FSDP2 path on for CPU processes, which accelerate itself runs as DDP.

    The state is what accelerate sets on GPUs (``distributed_type`` FSDP and the plugin); from there its
    ``prepare`` calls torch's ``fully_shard`` on a CPU device mesh over gloo. The process-wide state says FSDP
    too, as on GPUs: every later ``AcceleratorState()`` copies its ``distributed_type`` from there.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    init = Accelerator.__init__

    def init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    Accelerator.__init__ = init_with_fsdp


def _train(output_dir: Path, batch_size: int, max_steps: int = STEPS, resume_from: Path | None = None,
           parallel: str = "ddp", lora: bool = False) -> dict:
    """Train a fresh tiny drafter (with ``lora``: LoRA adapters on it) against the tiny target; returns the caller's
    drafter's weights afterwards, the result dict and, per parameter of the model that trained, ``(local shape,
    full shape)`` where it was sharded."""
    from torch.distributed.tensor import DTensor

    from distill.drafters.build import LoraSettings, build_drafter
    from distill.models.tiny import tiny_model
    from distill.training import loop as train

    record: dict = {"shards": {}, "is_fsdp2": False}
    setup = train._setup

    def recording_setup(*args, **kwargs):
        run = setup(*args, **kwargs)
        record["is_fsdp2"] = run.accelerator.is_fsdp2
        record["shards"] = {n: (tuple(p.to_local().shape), tuple(p.shape))
                            for n, p in run.drafter.named_parameters() if isinstance(p, DTensor)}
        return run

    drafter = tiny_model("drafter", seed=1)
    if lora:
        torch.manual_seed(123)  # the adapters' initialisation
        drafter = build_drafter(drafter, init="sibling", lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    train._setup = recording_setup
    try:
        result = train.train_drafter(drafter, tiny_model("target", seed=0), _examples(),
                                     loop_settings(lr=LR, max_steps=max_steps, batch_size=batch_size, seed=SEED,
                                                   grad_accum=GRAD_ACCUM, checkpoint_every=2, parallel=parallel),
                                     output_dir=output_dir, progress=False, resume_from=resume_from,
                                     val_examples=_examples()[:3], validation_draft_length=2)
    finally:
        train._setup = setup
    record["plain_types"] = sorted({type(p).__name__ for p in drafter.parameters()})
    record["weights"] = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    return {**record, "result": result}


def _worker(rank: int, port: int, out: str) -> None:
    """One FSDP process (``torch.multiprocessing.spawn`` entry): the env:// rendezvous accelerate reads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE), ACCELERATE_USE_CPU="1",
                      HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    _force_fsdp_on_cpu()
    recorded = _train(Path(out) / "shared", batch_size=BATCH, parallel="fsdp")
    # stopped at checkpoint-2 of the run above and resumed from it, in another folder
    resumed = _train(Path(out) / "resumed", batch_size=BATCH, parallel="fsdp",
                     resume_from=Path(out) / "shared" / "checkpoint-2")
    recorded["resumed_weights"] = resumed["weights"]
    recorded["resumed_is_fsdp2"] = resumed["is_fsdp2"]
    # LoRA (the default distill.method): frozen base and trained adapters in the same sharded units
    recorded["lora"] = _train(Path(out) / "lora", batch_size=BATCH, parallel="fsdp", lora=True)
    recorded["lora_resumed"] = _train(Path(out) / "lora_resumed", batch_size=BATCH, parallel="fsdp", lora=True,
                                      resume_from=Path(out) / "lora" / "checkpoint-2")["weights"]
    from accelerate import PartialState

    state = PartialState()
    recorded["backend"] = dist.get_backend()
    torch.save(recorded, Path(out) / f"rank{rank}.pt")
    state.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Both ranks' recordings and the output folder of a 2-process FSDP2 run on CPU."""
    out = tmp_path_factory.mktemp("fsdp")
    return spawn_and_collect(_worker, out, WORLD_SIZE), out


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """One process (no sharding) with both ranks' batches in each micro-batch: the steps FSDP must take."""
    out = tmp_path_factory.mktemp("single")
    return _train(out, batch_size=WORLD_SIZE * BATCH), out



@pytest.mark.slow
@gloo
@pytest.mark.usefixtures("one_thread")
def test_fsdp_shards_every_parameter_and_trains(fsdp_run):
    from distill.models.tiny import tiny_model

    ranks, out = fsdp_run
    initial = tiny_model("drafter", seed=1).state_dict()
    for rank in ranks:
        assert rank["backend"] == "gloo" and rank["is_fsdp2"] and rank["resumed_is_fsdp2"]
        # every parameter is a DTensor holding half of the rows (dim 0 split over the 2 processes)
        assert set(rank["shards"]) == {n for n, _ in tiny_model("drafter").named_parameters()}
        for local, full in rank["shards"].values():
            assert local[0] == -(-full[0] // WORLD_SIZE) or local[0] == full[0] // WORLD_SIZE
            assert local[1:] == full[1:]
        # the caller's drafter is an ordinary model again, with the trained weights
        assert rank["plain_types"] == ["Parameter"]
        assert max(float((rank["weights"][k] - initial[k]).abs().max()) for k in initial) > 1e-2
    w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    losses = [json.loads(line)["loss"] for line in (out / "shared" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS and all(0 < loss < 20 for loss in losses)


@pytest.mark.slow
@gloo
@pytest.mark.usefixtures("one_thread")
def test_fsdp_takes_the_single_process_steps(fsdp_run, single_run):
    ranks, out = fsdp_run
    single, single_dir = single_run
    # AdamW's first steps move a weight by about lr * sign(gradient): where a gradient is near 0, sums taken in
    # another order (per process, per micro-batch) become up to ~1e-4; a wrong gradient moves weights by ~lr = 1e-2
    for k, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, single["weights"][k], rtol=1e-4, atol=1e-4)
    lines = [json.loads(line) for line in (out / "shared" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (single_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["tokens"] for m in lines] == [m["tokens"] for m in expected]
    for got, want in zip(lines, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)  # the norm of the whole gradient
    # validation runs the sharded model on every process, before and after training
    for name in ("val_loss_before", "val_loss_after", "val_simulated_tau_after"):
        assert ranks[0]["result"][name] == pytest.approx(single["result"][name], rel=1e-4), name
    assert ranks[0]["result"]["val_loss_after"] < ranks[0]["result"]["val_loss_before"] - 0.1


@pytest.mark.slow
@gloo
@pytest.mark.usefixtures("one_thread")
def test_fsdp_resume_continues_as_uninterrupted(fsdp_run):
    ranks, out = fsdp_run
    for rank in ranks:  # same data position, optimizer (resharded from the full state) and scheduler
        w, resumed = rank["weights"], rank["resumed_weights"]
        assert all(torch.equal(w[k], resumed[k]) for k in w)
    lines = [json.loads(line) for line in (out / "resumed" / "metrics.jsonl").read_text().splitlines()]
    full = [json.loads(line) for line in (out / "shared" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{**m, "tokens_per_s": line["tokens_per_s"]} for m, line in zip(full[2:], lines, strict=True)]


@pytest.mark.slow
@gloo
@pytest.mark.usefixtures("one_thread")
def test_fsdp_checkpoint_holds_the_full_model_and_optimizer_state(fsdp_run):
    from transformers import AutoModelForCausalLM

    from distill.models.tiny import tiny_model
    from distill.training.checkpoint import load_weights

    ranks, out = fsdp_run
    final = out / "shared" / f"checkpoint-{STEPS}"
    assert json.loads((final / "trainer_state.json").read_text())["parallel"] == "fsdp"
    # the saved drafter is the ordinary full model: it loads into a fresh one, and on its own
    fresh = tiny_model("drafter", seed=5)
    load_weights(fresh, final)
    loaded = AutoModelForCausalLM.from_pretrained(final)
    for k, value in ranks[0]["weights"].items():
        assert torch.equal(fresh.state_dict()[k], value) and torch.equal(loaded.state_dict()[k], value)
    # AdamW's state, whole (not one process's shard), keyed by parameter name
    optimizer = torch.load(final / "optimizer.pt", weights_only=True)
    params = dict(fresh.named_parameters())
    assert set(optimizer["state"]) == set(params)
    for name, entry in optimizer["state"].items():
        assert entry["exp_avg"].shape == params[name].shape and float(entry["step"]) == STEPS
    assert sorted(p.name for p in (out / "shared").iterdir()) == ["checkpoint-2", f"checkpoint-{STEPS}",
                                                                   "metrics.jsonl", "validation.jsonl"]


@pytest.mark.slow
@gloo
@pytest.mark.usefixtures("one_thread")
def test_fsdp_trains_lora_adapters_and_resumes_them(fsdp_run):
    from peft import load_peft_weights

    from distill.models.tiny import tiny_model

    ranks, out = fsdp_run
    base = tiny_model("drafter", seed=1).state_dict()
    for rank in ranks:
        lora = rank["lora"]
        assert lora["is_fsdp2"] and any(".lora_A." in n for n in lora["shards"])  # the adapters were sharded too
        weights = lora["weights"]
        adapters = {k: v for k, v in weights.items() if "lora_" in k}
        frozen = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in weights.items()
                  if "lora_" not in k}
        assert all(torch.equal(frozen[k], base[k]) for k in base)  # the base did not move
        assert any(float(v.abs().max()) > 1e-3 for k, v in adapters.items() if "lora_B" in k)  # B starts at 0
        assert all(torch.equal(weights[k], rank["lora_resumed"][k]) for k in weights)
    # the checkpoint is the adapter alone, as save_pretrained writes it for a peft model
    final = out / "lora" / f"checkpoint-{STEPS}"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    saved = load_peft_weights(str(final), device="cpu")
    trained = ranks[0]["lora"]["weights"]
    assert saved and all(torch.equal(v, trained[k.replace(".weight", ".default.weight")]) for k, v in saved.items())
