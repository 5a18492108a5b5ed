#!/usr/bin/env bash
# What the CPU test suite cannot run, checked in a few minutes on a GPU node (tiny random models, no downloads):
# distill over NCCL in N processes, distill with FSDP2 (distill.parallel=fsdp) in N processes stopped at a
# checkpoint and resumed, QLoRA on a bitsandbytes 4-bit base, evaluate's teacher-forced passes in N processes,
# greedy speculative output equal to the target's on the GPU.
#
#   bash scripts/gpu_check.sh              # N = every visible GPU (at least 1; one process runs FSDP unsharded)
#   NPROC=2 bash scripts/gpu_check.sh
#   bash scripts/gpu_check.sh --cpu        # the same steps on 2 CPU processes over gloo, without QLoRA, and with
#                                          # FSDP's refusal on CPU in place of the FSDP runs:
#                                          # checks the script itself on a machine without a GPU
#
# Writes under ${OUT:-/tmp/draftsmith_gpu_check}; the last line says what passed. Exits non-zero at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/draftsmith_gpu_check}
export HF_HUB_OFFLINE=1 USE_HUB_KERNELS=NO WANDB_MODE=offline PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CPU=0
[[ "${1:-}" == "--cpu" ]] && CPU=1
if [[ $CPU == 1 ]]; then
  export ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1
  NPROC=${NPROC:-2}
else
  NPROC=${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
  python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device: run with --cpu to check the script"
print("torch", torch.__version__, "CUDA", torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
fi
if [[ -e "$OUT" && ! -e "$OUT/.gpu_check" ]]; then
  echo "gpu_check: $OUT exists and is not an earlier check's folder: set OUT=<a new folder>" >&2; exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT" && touch "$OUT/.gpu_check"
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
launch() { python -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT" -m distill.cli "$@"; }
passed=()

echo "== generate (tiny, one process)"
python -m distill.cli generate experiment=tiny evaluate.num_prompts=10 "outputs=$OUT" >/dev/null
passed+=(generate)

echo "== distill in $NPROC processes ($([[ $CPU == 1 ]] && echo gloo || echo NCCL))"
launch distill experiment=tiny distill.max_steps=4 "outputs=$OUT" >/dev/null
run=$(ls -d "$OUT"/distill/*/ | tail -1)
test -f "$run/COMPLETE"
python - "$run" "$NPROC" <<'PY'
import json, sys
from pathlib import Path
state = json.loads(next(Path(sys.argv[1], "checkpoints").glob("checkpoint-*/trainer_state.json")).read_text())
assert state["data"]["num_processes"] == int(sys.argv[2]), state["data"]
PY
passed+=("distill x$NPROC")

gen=$(ls -d "$OUT"/generate/*/ | tail -1)
fsdp=(experiment=tiny distill.parallel=fsdp distill.max_steps=4 distill.checkpoint_every=2 distill.keep_checkpoints=0
      "inputs.generate=$gen")
if [[ $CPU == 0 ]]; then
  echo "== distill with FSDP2 in $NPROC processes (NCCL): whole, then resumed from its checkpoint-2"
  launch distill "${fsdp[@]}" distill.resume=never "outputs=$OUT/fsdp" >/dev/null
  whole=$(ls -d "$OUT"/fsdp/distill/*/ | tail -1)
  launch distill "${fsdp[@]}" "distill.resume=${whole}checkpoints/checkpoint-2" "outputs=$OUT/fsdp_resumed" >/dev/null
  python - "$whole" "$(ls -d "$OUT"/fsdp_resumed/distill/*/ | tail -1)" "$NPROC" <<'PY'
import json, math, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
whole, resumed, nproc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
for run in (whole, resumed):
    assert (run / "COMPLETE").is_file(), run
    state = json.loads((run / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["parallel"] == "fsdp" and state["data"]["num_processes"] == nproc, state
    losses = [json.loads(line)["loss"] for line in (run / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
# the saved drafter is the ordinary full model, and the resumed run ends where the whole one does
AutoModelForCausalLM.from_pretrained(whole / "drafter")
a, b = load_file(whole / "drafter" / "model.safetensors"), load_file(resumed / "drafter" / "model.safetensors")
assert a.keys() == b.keys()
diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
print("fsdp: losses", [round(x, 4) for x in losses], "| resumed vs whole, largest weight difference", diff)
for k in a:
    torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4)
PY
  passed+=("fsdp x$NPROC + resume")
else
  echo "== distill with FSDP on CPU: refused before anything loads"
  if launch distill "${fsdp[@]}" "outputs=$OUT/fsdp" >/dev/null 2>"$OUT/fsdp.err"; then
    echo "gpu_check: distill.parallel=fsdp ran on CPU (accelerate would have trained with DDP)" >&2; exit 1
  fi
  grep -q "on CPU use distill.parallel=ddp" "$OUT/fsdp.err"
  passed+=("fsdp refused on CPU")
fi

if [[ $CPU == 0 ]]; then
  echo "== distill with QLoRA (4-bit base, one process)"
  # drafter=tiny: QLoRA wraps a sibling drafter (experiment=tiny's cut drafter trains in full)
  python -m distill.cli distill experiment=tiny drafter=tiny distill.method=qlora distill.max_steps=2 distill.resume=never \
    "outputs=$OUT/qlora" "inputs.generate=$gen" >/dev/null
  passed+=(qlora)
fi

echo "== evaluate in $NPROC processes"
report=$(launch evaluate experiment=tiny evaluate.num_prompts=10 "inputs.distill=$run" "outputs=$OUT" | tail -1)
python - "$report" "$NPROC" <<'PY'
import json, sys
from pathlib import Path
report = json.loads(Path(sys.argv[1]).read_text())
manifest = json.loads((Path(sys.argv[1]).parent / "manifest.json").read_text())
assert manifest["processes"] == int(sys.argv[2]), manifest.get("processes")
assert report["simulated"]["num_prompts"] == 10, report["simulated"]["num_prompts"]
# float32 greedy: lossless on any device (TF32 matmuls are off by default in torch)
assert report["outputs_match_target"] is True, "greedy speculative output differs from the target's (float32)"
print("evaluate:", report["engine"], "| simulated tau", round(report["simulated"]["mean_accepted_tokens"], 3))
PY
passed+=("evaluate x$NPROC")
echo "gpu_check: passed: ${passed[*]}"
