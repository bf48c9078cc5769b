#!/usr/bin/env bash
# CI step "newest torch": builds vflow (CPU-only) against the newest torch release and
# runs a chosen subset of the tests against that build, beside the pinned torch that
# .venv and `make test` use. The torch range the project claims is the range CI tests.
#
# Usage: .ci/torch_check.sh [--install-only] [VENV_DIR]
#   --install-only  only fill VENV_DIR (.ci/run does it beside the CUDA compile check,
#                   downloading and unpacking while that compiles)
#   VENV_DIR  virtual environment for that torch (default /tmp/vflow-torch$TORCH_VERSION);
#             reused when it already holds torch==$TORCH_VERSION, else created/filled.
# Environment:
#   PYTHON     interpreter used to create the venv (default python3)
#   MAX_JOBS   parallel compile jobs (default 2)
#   TEST_JOBS  pytest-xdist processes (default 2)
#
# The build happens in a copy of the checkout's files (git ls-files: tracked and
# untracked-not-ignored), installed non-editable into VENV_DIR: the checkout's own
# in-tree vflow/_C*.so belongs to .venv's torch and is neither used nor touched.
set -euo pipefail

TORCH_VERSION=2.15.0
INSTALL_ONLY=0
if [[ "${1:-}" == --install-only ]]; then
  INSTALL_ONLY=1
  shift
fi
VENV="${1:-/tmp/vflow-torch$TORCH_VERSION}"
PYTHON="${PYTHON:-python3}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The subset: the tests of the code that reaches into torch's private names
# (vflow/_torch_private.py lists them; tests/test_torch_private.py checks each against
# this torch) or into its C++ ABI, one or a few files per package, chosen for coverage
# per second. A file listing rather than a pytest marker: the choice is this stage's, and
# the test files stay as their authors wrote them. Left out for time (each 50-100 s of
# worker processes on 2 cores, none with a private torch name of its own):
# runtime/test_distributed.py (DDP comparisons), runtime/test_registered_state.py
# (state_dict() objects through joins), elastic/test_record.py (store restarts), and
# the timing-bound elastic/test_job.py. On a 2-core machine shared with four other
# sessions (load 10-14), tests/elastic, pipeline, runtime and planning took 23.5 min
# with this torch; this list with those three files, 11 min; this list, 3.5 min.
TESTS=(
  tests/test_torch_private.py  # every private torch name vflow uses, and the table is whole
  tests/test_ops.py            # the C++ operators against this torch's ATen and dispatcher
  tests/elastic/test_rendezvous.py
  tests/pipeline/test_executor.py
  tests/pipeline/test_spec.py
  tests/runtime/test_executor.py
  tests/runtime/test_reducer.py
  tests/runtime/test_checkpoint.py
  tests/planning/test_emulation.py
  tests/planning/test_planner.py
)

log() { printf '[torch_check] %s\n' "$*"; }
die() { printf '[torch_check] ERROR: %s\n' "$*" >&2; exit 1; }
t0=$SECONDS
lap() { local now=$SECONDS; log "$1 took $((now - t0))s"; t0=$now; }

# ---- 1. torch ---------------------------------------------------------------------
DEPS=("torch==$TORCH_VERSION" numpy ninja setuptools wheel pytest pytest-xdist scikit-learn
  matplotlib)
venv_complete() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$TORCH_VERSION" <<'EOF' 2>/dev/null
import sys

import matplotlib, ninja, numpy, pytest, setuptools, sklearn, torch, wheel, xdist  # noqa

sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
EOF
}
if venv_complete; then
  log "reusing $VENV (torch $TORCH_VERSION and the test tools installed)"
else
  log "filling $VENV: torch==$TORCH_VERSION (about 1.2 GB to download, 5.7 GB installed with its CUDA libraries) and the test tools"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  # pip's config may name a constraints file (global.constraint) that caps torch: this
  # machine's caps it at the releases kept on its disk (2.14.1), which would refuse
  # $TORCH_VERSION. An empty PIP_CONSTRAINT replaces it for this install alone; where
  # pip has no such file it changes nothing.
  empty_constraints="$(mktemp)"
  PIP_CONSTRAINT="$empty_constraints" "$VENV/bin/python" -m pip install -q "${DEPS[@]}"
  rm -f "$empty_constraints"
  venv_complete || die "torch==$TORCH_VERSION or a test tool did not install into $VENV"
fi
"$VENV/bin/python" -c 'import torch; print("[torch_check] torch", torch.__version__, "CUDA", torch.version.cuda)'
lap "installing torch"
[[ $INSTALL_ONLY == 1 ]] && exit 0

# ---- 2. vflow, built out of the tree --------------------------------------------------
SRC="$(mktemp -d "${TMPDIR:-/tmp}/vflow-torch-src.XXXXXX")"
trap 'rm -rf "$SRC"' EXIT
(cd "$REPO_ROOT" && git ls-files -z -co --exclude-standard | tar -c --null -T - -f -) |
  tar -x -f - -C "$SRC"
# VFLOW_CUDA=0: the newest torch is a CUDA build, and nvcc may be of another release
# than its CUDA (setup.py would refuse the pair; the CUDA build is cuda_check.sh's).
(
  cd "$SRC"
  PATH="$VENV/bin:$PATH" VFLOW_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" \
    "$VENV/bin/python" -m pip install -v --no-build-isolation --no-deps .
) > "$SRC/build.log" 2>&1 || { tail -n 60 "$SRC/build.log" >&2; die "build failed"; }
# setup.py's decisions (pip -v prints each twice, indented).
sed -nE 's/^ *(vflow: .*)/\1/p' "$SRC/build.log" | awk '!seen[$0]++'
# The tests then import the installed vflow, not the copy's sources beside them.
rm -rf "$SRC/vflow" "$SRC/build"
lap "building vflow against torch $TORCH_VERSION"

# ---- 3. the subset ----------------------------------------------------------------------
# pytest exits 5 when it ran no test: an error here like any other.
(
  cd "$SRC"
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${TEST_JOBS:-2}" --dist loadfile \
    -m "not alone" --durations=10 "${TESTS[@]}"
)
lap "the tests"
