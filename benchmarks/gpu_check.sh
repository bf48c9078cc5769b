#!/usr/bin/env bash
# GPU check for a machine like the project's target (one H200; torch 2.11+cu130,
# Python 3.12, nvcc 13.0, no network). CI never has a GPU: this is the script to run
# whenever one is at hand, and its closing table goes into the issue's closing note.
#
#   1. build: `pip install --no-build-isolation .` against the machine's own torch
#      (sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise), VFLOW_CUDA=1 so a missing
#      toolchain fails the build instead of quietly dropping the kernels;
#   2. the CUDA tests: every test parametrised over devices, the exact kernels
#      against the CPU's integers, the executor on the GPU, a one-rank NCCL group
#      interrupted (its communicators aborted: Note [Interrupting an NCCL wait]);
#   3. benchmarks/accumulate.py on the GPU: fused-accumulate GB/s against the copy
#      bandwidth measured in the same run (target >= 85 %), and the exact kernels;
#   4. benchmarks/step.py on the GPU: Executor.step against a hand-written loop;
#   5. benchmarks/prefetch.py on the GPU: batches on the CPU fed through pinned memory
#      and a side stream, with and without prefetching, against the ideal.
#   6. pipelines on CUDA: examples/train_pipeline.py with --device cuda, --amp bf16 and
#      --max-grad-norm, deterministic: on one process (the PipelineExecutor's step on the
#      GPU: losses kept on the device, CUDA-event profiles), and, with 2 or more GPUs, 2
#      stages over NCCL, whose model must be bitwise the one-process model's.
#
# Usage: benchmarks/gpu_check.sh [LOG_DIR]
#   LOG_DIR (or VFLOW_GPU_LOG_DIR): where full logs and JSON go (default ./gpu_check_logs).
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores),
#   VFLOW_GPU_QUICK=1 for shorter benchmarks.
# Exit status: non-zero if any stage failed; every stage runs regardless.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG_DIR="${1:-${VFLOW_GPU_LOG_DIR:-$REPO_ROOT/gpu_check_logs}}"
mkdir -p "$LOG_DIR" && LOG_DIR="$(cd "$LOG_DIR" && pwd)" || exit 1
PYTHON="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PYTHONUNBUFFERED=1
cd "$REPO_ROOT"

declare -a SUMMARY=()
FAILED=0
START=$SECONDS

# run_stage NAME COMMAND...: runs COMMAND with its output in LOG_DIR/NAME.log.
run_stage() {
  local name="$1"
  shift
  local t0=$SECONDS
  printf '\n=== %s (%ss elapsed)\n' "$name" "$((SECONDS - START))"
  if "$@" >"$LOG_DIR/$name.log" 2>&1; then
    SUMMARY+=("$(printf '%-12s %-6s %5ss' "$name" ok "$((SECONDS - t0))")")
  else
    FAILED=1
    SUMMARY+=("$(printf '%-12s %-6s %5ss  (see %s)' "$name" FAILED "$((SECONDS - t0))" "$LOG_DIR/$name.log")")
    tail -n 40 "$LOG_DIR/$name.log"
  fi
}

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())'
  nvcc --version | tail -n 1
}

# The tests import `vflow` from the source tree (its folder is first on sys.path), so
# the extension that pip installed is placed beside the sources as an in-place build
# would be; .gitignore already ignores it.
build() {
  VFLOW_CUDA=1 "$PYTHON" -m pip install --no-build-isolation --no-deps -v . || return 1
  local so
  so="$(cd /tmp && "$PYTHON" -c 'import vflow._C as c; print(c.__file__)')" || return 1
  cp "$so" "$REPO_ROOT/vflow/"
  "$PYTHON" -c 'import vflow.ops; assert vflow.ops.built_with_cuda(); print("built_with_cuda: True")'
}

# Device-parametrised tests carry "cuda" in their ids (test_x[cuda], test_x[cuda-...])
# and CUDA-only tests in their names. Skips are listed (-rs): on this machine a skipped
# CUDA case is a finding, and the stage fails unless CUDA cases really ran.
cuda_tests() {
  local out="$LOG_DIR/cuda_tests.pytest.log"
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider -k "cuda" \
    tests/test_kernels.py tests/test_ops.py tests/runtime/test_exact.py \
    tests/runtime/test_executor.py tests/runtime/test_grad_buffer.py \
    tests/runtime/test_reducer.py tests/runtime/test_memory.py tests/runtime/test_tree.py \
    tests/data/test_prefetch.py tests/world/test_nccl.py 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  # pytest's last line, e.g. "2 failed, 80 passed, 3 skipped, 1 error in 9.1s".
  local passed failed skipped
  read -r passed failed skipped < <(tail -n 1 "$out" | awk '{
    for (i = 2; i <= NF; i++) {
      word = $i; sub(/,$/, "", word); n = $(i - 1) + 0
      if (word == "passed") p += n
      else if (word == "failed" || word ~ /^errors?$/) f += n
      else if (word == "skipped") s += n
    }
  } END { print p + 0, f + 0, s + 0 }')
  echo "CUDA test cases: $((passed + failed)) ran ($passed passed, $failed failed), $skipped skipped"
  [[ $passed -gt 0 ]] || { echo "no CUDA test case ran" >&2; return 1; }
  return "$rc"
}

quick_flag=()
[[ "${VFLOW_GPU_QUICK:-0}" == 1 ]] && quick_flag=(--quick)

accumulate() {
  "$PYTHON" benchmarks/accumulate.py --device cuda "${quick_flag[@]}" --rounds 3 \
    --min-run-time 0.2 --json "$LOG_DIR/accumulate.json"
}

step() {
  "$PYTHON" benchmarks/step.py --device cuda "${quick_flag[@]}" --reps 15 \
    --json "$LOG_DIR/step.json"
}

prefetch() {
  "$PYTHON" benchmarks/prefetch.py --device cuda "${quick_flag[@]}" --reps 10 \
    --json "$LOG_DIR/prefetch.json"
}

# Pipelines on CUDA (stage 6). NCCL refuses two ranks on one GPU: the 2-stage run
# needs 2 GPUs, and says so when there is one.
pipeline() {
  local flags=(--virtual-nodes 4 --steps 20 --seed 3 --deterministic --device cuda
    --amp bf16 --max-grad-norm 0.5 --log-every 5)
  "$PYTHON" examples/train_pipeline.py --stages 1 "${flags[@]}" \
    --out "$LOG_DIR/pipeline_1.pt" || return 1
  local gpus
  gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
  if [[ "$gpus" -lt 2 ]]; then
    echo "2 stages over NCCL: not run, $gpus GPU (NCCL refuses two ranks on one GPU)"
    return 0
  fi
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 \
    examples/train_pipeline.py --stages 2 "${flags[@]}" --out "$LOG_DIR/pipeline_2.pt" || return 1
  "$PYTHON" - "$LOG_DIR/pipeline_1.pt" "$LOG_DIR/pipeline_2.pt" <<'COMPARE'
import sys

import torch

one, two = (torch.load(path, weights_only=True)["model"] for path in sys.argv[1:])
differ = [key for key in one if not torch.equal(one[key].cpu(), two[key].cpu())]
print(f"2 stages over NCCL against one process: {len(one) - len(differ)}/{len(one)} tensors equal")
sys.exit(1 if differ else 0)
COMPARE
}

run_stage environment environment
run_stage build build
if [[ $FAILED == 0 ]]; then
  run_stage cuda_tests cuda_tests
  run_stage accumulate accumulate
  run_stage step step
  run_stage prefetch prefetch
  run_stage pipeline pipeline
fi

printf '\n=== GPU check summary (%ss in all; logs in %s)\n' "$((SECONDS - START))" "$LOG_DIR"
cat "$LOG_DIR/environment.log" 2>/dev/null
printf '%s\n' "${SUMMARY[@]}"
grep -h '^CUDA test cases' "$LOG_DIR/cuda_tests.log" 2>/dev/null
"$PYTHON" - "$LOG_DIR" <<'EOF'
import json
import sys
from pathlib import Path

from vflow.bench.summary import count_targets, rows_of, summary_table

log_dir = Path(sys.argv[1])
records = []
for name in ("accumulate", "step", "prefetch"):
    path = log_dir / f"{name}.json"
    if path.exists():
        records += json.loads(path.read_text())
rows = rows_of(records)
print(summary_table(rows, compared=False))
print(count_targets(rows).line())
EOF
exit $FAILED
