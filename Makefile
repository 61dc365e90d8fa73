# Every target creates .venv on first use and installs what it needs.
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/digits.yaml
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install train train-dp train-multinode compare test bench lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev,train]"
	touch $@

install: $(VENV)/.installed

train: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) launch/train.py --config $(CONFIG)

train-dp: install
	$(PY) launch/train.py --config configs/digits_dp.yaml

# One intra-op thread per test process: xdist workers and the gloo ranks they spawn share the cores.
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(NPROC) tests

compare: install
	OMP_NUM_THREADS=1 $(PY) launch/compare.py --config configs/compare.yaml

bench: install
	$(PY) launch/bench.py --config configs/bench.yaml

lint: install
	$(VENV)/bin/ruff check syncbn_dist launch tests

clean:
	rm -rf $(VENV) outputs .pytest_cache build *.egg-info
