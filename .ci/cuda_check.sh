#!/usr/bin/env bash
# CI step "CUDA compile check": builds vflow._C with its CUDA kernels against the
# CUDA build of torch and checks that the result imports, reports CUDA support and
# registers a CUDA kernel for every operator torch.ops.vflow.*.
# It needs nvcc but no GPU (importing the extension does not touch a device).
#
# Usage: .ci/cuda_check.sh [VENV_DIR]
#   VENV_DIR  virtual environment to build with (default /tmp/vflow-cuda-venv);
#             reused when it already holds torch==$TORCH_VERSION with CUDA, else
#             created/filled with pip.
# Environment:
#   PYTHON            interpreter used to create the venv (default python3)
#   CUDA_HOME         toolkit root; defaults to /usr/local/cuda when that exists,
#                     because a bare `nvcc` wrapper on PATH makes cpp_extension
#                     guess a root without lib64/libcudart.so
#   VFLOW_CI_ARCHS    TORCH_CUDA_ARCH_LIST for the build (default 9.0)
#   MAX_JOBS          parallel compile jobs (default 2)
#   VFLOW_KEEP_BUILD  set to 1 to keep the temporary build folder on success
#
# The build goes to a temporary folder (never the source tree), so it neither
# leaves a .so behind nor clobbers the CPU build of the repo's own .venv.
set -euo pipefail

# Its wheels bring CUDA 13.0 headers (cuda-toolkit==13.0.3 in torch's metadata, so
# nvidia-cuda-runtime 13.0), which setup.py puts first on the include path: the nvcc of
# CUDA_HOME must be 13.0 too, or setup.py stops before compiling (Note [nvcc, torch's
# CUDA and the headers]). A newer torch here needs the toolkit of its CUDA release.
TORCH_VERSION=2.14.1
VENV="${1:-/tmp/vflow-cuda-venv}"
PYTHON="${PYTHON:-python3}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
START=$(date +%s)

log() { printf '[cuda_check] %s\n' "$*"; }
die() { printf '[cuda_check] ERROR: %s\n' "$*" >&2; exit 1; }

# ---- 1. Virtual environment --------------------------------------------------
venv_has_torch() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$TORCH_VERSION" <<'EOF' 2>/dev/null
import sys
import torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] and torch.version.cuda else 1)
EOF
}

if venv_has_torch; then
  log "reusing $VENV (torch $TORCH_VERSION with CUDA already installed)"
  # Cheap when present; fills in the build tools if the venv was made elsewhere.
  if ! "$VENV/bin/python" -c "import numpy, ninja, setuptools, wheel" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet numpy ninja setuptools wheel
  fi
else
  log "creating $VENV and installing torch==$TORCH_VERSION (large download)"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION" numpy ninja setuptools wheel
  venv_has_torch || die "torch==$TORCH_VERSION in $VENV is not a CUDA build (torch.version.cuda is None)"
fi
VENV_PY="$VENV/bin/python"
# cpp_extension runs `ninja` from PATH.
export PATH="$VENV/bin:$PATH"

if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda
fi
log "CUDA_HOME=${CUDA_HOME:-(auto)}; $("$VENV_PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"

# ---- 2. Build into a temporary folder ------------------------------------------
BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/vflow-cuda-build.XXXXXX")"
BUILD_LOG="$BUILD_DIR/build.log"
cleanup() {
  local rc=$?
  if [[ $rc -eq 0 && "${VFLOW_KEEP_BUILD:-0}" != 1 ]]; then
    rm -rf "$BUILD_DIR"
  else
    log "build folder kept: $BUILD_DIR (log: $BUILD_LOG)"
  fi
}
trap cleanup EXIT

# Build artefacts in the source tree. Only new paths count here: an existing
# in-tree .so (the CPU build) may legitimately be rebuilt by someone else
# meanwhile; whether *this* build overwrote it is checked by content below.
tree_artefacts() {
  (cd "$REPO_ROOT" && find . -path ./.venv -prune -o -path ./.git -prune -o \
    \( -name '*.so' -o -name '*.egg-info' -o -path ./build \) -print | sort)
}
BEFORE="$(tree_artefacts)"

log "building in $BUILD_DIR"
# build_py puts the Python package next to the extension so that the import
# below resolves `vflow` (and so `vflow._C`) from the build folder alone.
(
  cd "$REPO_ROOT"
  VFLOW_CUDA=1 VFLOW_PTXAS_VERBOSE=1 \
    TORCH_CUDA_ARCH_LIST="${VFLOW_CI_ARCHS:-9.0}" MAX_JOBS="${MAX_JOBS:-2}" \
    "$VENV_PY" setup.py \
    build_py --build-lib "$BUILD_DIR/lib" \
    build_ext --build-temp "$BUILD_DIR/temp" --build-lib "$BUILD_DIR/lib"
) >"$BUILD_LOG" 2>&1 || {
  tail -n 80 "$BUILD_LOG" >&2
  die "build failed (full log: $BUILD_LOG)"
}
grep -E '^vflow: ' "$BUILD_LOG" || true

AFTER="$(tree_artefacts)"
if [[ "$BEFORE" != "$AFTER" ]]; then
  diff <(echo "$BEFORE") <(echo "$AFTER") >&2 || true
  die "the build created artefacts in the source tree"
fi

# ---- 3. Register / spill report of vflow's kernels ----------------------------
# ptxas prints, per entry function: "Compiling entry function '<mangled>'",
# "Function properties for ...", "N bytes stack frame, ... spill ...", "Used N
# registers ...". Keep the blocks whose entry function lives in namespace vflow.
PTXAS_REPORT="$(awk '
  /Compiling entry function/ { keep = ($0 ~ /_ZN5vflow/) }
  keep && (/ptxas info/ || /bytes stack frame/) && !/Compile time/ && !/Function properties/
' "$BUILD_LOG")"
[[ -n "$PTXAS_REPORT" ]] || die "no ptxas -v output for vflow kernels in $BUILD_LOG"
if command -v c++filt >/dev/null; then
  PTXAS_REPORT="$(c++filt <<<"$PTXAS_REPORT")"
fi
log "ptxas resource usage of vflow kernels:"
printf '%s\n' "$PTXAS_REPORT"
N_KERNELS=$(grep -c 'Compiling entry function' <<<"$PTXAS_REPORT")
log "$N_KERNELS kernel instantiations compiled"
if grep -Eq '[1-9][0-9]* bytes spill (stores|loads)' <<<"$PTXAS_REPORT"; then
  log "WARNING: register spills in a vflow kernel (see above)"
fi

# ---- 4. Import the built module -------------------------------------------------
SO_PATH="$(find "$BUILD_DIR/lib/vflow" -maxdepth 1 -name '_C*.so' -print -quit)"
[[ -n "$SO_PATH" ]] || die "no vflow/_C*.so under $BUILD_DIR/lib"
log "built $SO_PATH ($(du -h "$SO_PATH" | cut -f1))"
while IFS= read -r -d '' tree_so; do
  if cmp -s "$tree_so" "$SO_PATH"; then
    die "the build overwrote $tree_so in the source tree"
  fi
done < <(find "$REPO_ROOT/vflow" -name '_C*.so' -print0)
# Run from the build folder so the source tree's `vflow` (and its CPU .so) is
# not on sys.path; PYTHONPATH points only at the fresh build.
(
  cd "$BUILD_DIR"
  PYTHONPATH="$BUILD_DIR/lib" "$VENV_PY" - "$BUILD_DIR/lib" <<'EOF'
import os
import sys

import vflow

lib = os.path.realpath(sys.argv[1])
ext = vflow._C
where = os.path.realpath(ext.__file__)
assert where.startswith(lib + os.sep), f"imported {where}, not the build in {lib}"
assert ext.built_with_cuda() is True, "vflow._C.built_with_cuda() is not True"
print(f"[cuda_check] import OK: {where}; built_with_cuda() is True")

# Note [One op surface]: every kernel is an operator whose CUDA implementation the .cu
# files register (a CPU-only build's CUDA kernel would be the one in torch_ops.cpp).
import torch
import vflow.ops

for name in vflow.ops.OP_NAMES:
    qualified = f"vflow::{name}"
    assert hasattr(torch.ops.vflow, name), f"torch.ops.vflow.{name} is not registered"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA"), (
        f"{qualified} has no CUDA kernel"
    )
    cuda_line = next(
        line for line in torch._C._dispatch_dump(qualified).splitlines()
        if line.startswith("CUDA:")
    )
    assert ".cu:" in cuda_line, f"{qualified}'s CUDA kernel is not from a .cu file: {cuda_line}"
print(f"[cuda_check] CUDA kernels registered for {', '.join(vflow.ops.OP_NAMES)}")
EOF
)

log "passed in $(( $(date +%s) - START ))s"
