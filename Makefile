# Two entry points for a fresh machine (Python 3.10+ with pip, venv and a C++ compiler):
#   make demo   - installs everything into .venv and runs the main job end to end
#   make test   - installs everything into .venv and runs the test suite
#   make bench  - the benchmark suite of this checkout (benchmarks/run.py; ARGS=--full)
# TORCH_VERSION pins the PyTorch the extension is built against (default: the CPU build).
# Everything runs in .venv: `source .venv/bin/activate`, or prefix commands with .venv/bin/.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
# Test processes: the slowest tests mostly wait (worker processes starting, rendezvous
# rounds, heartbeats), so two of them share 2 cores well.
TEST_JOBS ?= 2
DEPS := "torch==$(TORCH_VERSION)" numpy ninja setuptools wheel pytest pytest-xdist ruff \
	scikit-learn matplotlib
# Named after the list, so that a .venv made for another list is topped up.
DEPS_STAMP := $(VENV)/.deps-$(shell echo '$(DEPS)' | cksum | cut -d' ' -f1)
BUILD_STAMP := $(VENV)/.built
EXT_SOURCES := setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/*/*.h csrc/*/*.cpp csrc/cuda/*.cu)

.PHONY: install demo test bench lint format clean

install: $(BUILD_STAMP)

$(DEPS_STAMP):
	@$(PYTHON) -c "import venv, ensurepip" 2> /dev/null || { echo "make: $(PYTHON) cannot \
	create a virtual environment (no venv/ensurepip); on Debian/Ubuntu: sudo apt install \
	python3-venv" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make: installing torch==$(TORCH_VERSION), numpy, scikit-learn, matplotlib, pytest, \
	pytest-xdist and ruff into $(VENV) (a few hundred MB; once)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar on $(DEPS)
	touch $@

# Shows the compiler's progress, one line per file, and any error (pip -v prints whole
# compiler commands; setup.py prints its decisions twice).
$(BUILD_STAMP): $(DEPS_STAMP) $(EXT_SOURCES)
	@echo "make: compiling vflow's C++ extension (15 files, 2-4 minutes on 2 cores; once)"
	MAX_JOBS=2 $(PY) -m pip install -v --no-build-isolation -e . 2>&1 | \
		sed -nuE -e 's#^ *\[([0-9]+/[0-9]+)\] .* -c [^ ]*/(csrc/[^ ]+) .*#  [\1] \2#p' \
		-e 's#^ *(vflow: .*)#\1#p' -e '/error:|Error:|^ERROR/p' | \
		awk '!seen[$$0]++ { print; fflush() }'
	touch $@

demo: $(BUILD_STAMP)
	$(PY) -m vflow demo $(ARGS)
	@echo "vflow is installed in $(VENV): run its commands as $(VENV)/bin/python -m vflow ..., \
	$(VENV)/bin/torchrun ..., or after: source $(VENV)/bin/activate"

# Tests marked "alone" read timing (the automatic planner's decisions): they run after
# the others, one at a time, so that no other test's processes share the cores.
test: $(BUILD_STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not alone" tests
	$(PY) -m pytest -q -m alone tests

bench: $(BUILD_STAMP)
	$(PY) benchmarks/run.py $(ARGS)

lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check vflow tests benchmarks examples setup.py
	$(VENV)/bin/ruff format --check vflow tests benchmarks examples setup.py

format: $(DEPS_STAMP)
	$(VENV)/bin/ruff format vflow tests benchmarks examples setup.py
	$(VENV)/bin/ruff check --fix vflow tests benchmarks examples setup.py

clean:
	rm -rf build *.egg-info vflow/_C*.so $(BUILD_STAMP)
