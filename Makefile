# Every target creates .venv on first use and installs what it needs.
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/digits.yaml
ARGS ?=
RDZV_PORT ?= 29510
# How many times torchrun restarts the workers after one dies; a restart resumes from the last checkpoint.
MAX_RESTARTS ?= 1
MULTINODE_CONFIG ?= configs/digits_multinode.yaml
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# For torchrun: a fresh store for every restart, so that no attempt reads a dead attempt's keys
# (launch/common/torchrun.py, RESTART_SAFE_AGENT_ENV; docs/training.md, "Restarts and preemption").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1

# make compat: the suite in a separate venv, .venv-compat-<python>-<torch> (docs/compat.md), e.g.
#   make compat PYTHON=/root/.pyenv/versions/3.10.13/bin/python TORCH=2.10.0
# PyPI's torch for Linux is a CUDA build: it runs on the CPU once its nvidia-* dependencies are in (several GB).
TORCH ?= 2.13.0
COMPAT_ARGS ?=
COMPAT_VENV = .venv-compat-$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-$(TORCH)

# make frameworks: real model zoos through their own SyncBatchNorm paths, in .venv-frameworks (not part of CI: timm
# needs a torchvision built for its torch, a CUDA build of several GB on x86_64).
FRAMEWORKS_VENV := .venv-frameworks
FRAMEWORKS_PINS := torch==2.14.1 torchvision==0.29.1 timm==1.0.31

.PHONY: install train train-dp train-multinode compare test test-quick fuzz compat frameworks bench bench-gpu docs docs-check lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev,train,docs]"
	touch $@

install: $(VENV)/.installed

train: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) --max-restarts=$(MAX_RESTARTS) \
		-m launch.digits.train --config $(CONFIG) $(ARGS)

train-dp: install
	$(PY) -m launch.digits.train --config configs/digits_dp.yaml

# Two "nodes" x 1 process on loopback through torchrun's c10d rendezvous (which assigns the node ranks:
# torchrun ignores --node_rank with c10d); fails if either node fails. OMP_NUM_THREADS=1 because the two
# nodes share this machine's cores (torchrun sets it only for --nproc_per_node > 1). The rendezvous id names
# this launch (a restart resumes only a checkpoint written under it), so it is new for every invocation.
train-multinode: install
	@pids=""; trap 'kill -TERM $$pids 2>/dev/null' INT TERM; id=digits-multinode-$$(date +%s)-$$$$; \
	for node in 0 1; do \
		OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d \
			--rdzv_endpoint=127.0.0.1:$(RDZV_PORT) --rdzv_id=$$id --local_addr=127.0.0.1 --max-restarts=$(MAX_RESTARTS) \
			-m launch.digits.train --config $(MULTINODE_CONFIG) $(ARGS) & \
		pids="$$pids $$!"; \
	done; \
	status=0; for pid in $$pids; do wait $$pid || status=1; done; exit $$status

# One intra-op thread per test process: xdist workers and the gloo ranks they spawn share the cores. worksteal: a
# worker that runs out of tests takes some of the other's, so a few minute-long tests do not leave one core idle.
# The run ends with its slowest tests, and the unmarked ones over the test budget (pyproject.toml, test_budget_s).
# Multi-process tests share long-lived gloo worlds (docs/testing.md); SYNCBN_DIST_TEST_POOL=0 spawns every job afresh.
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(NPROC) --dist worksteal --durations=25 tests

# The edit-test loop: the correctness tests, without those that exist for the recipes, benchmarks, packaging,
# launchers and docs (plumbing) and the longest ones (slow, over_budget). docs/testing.md, "The quick tier".
QUICK_MARKS := not plumbing and not slow and not over_budget
test-quick: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(NPROC) --dist worksteal --durations=10 -m "$(QUICK_MARKS)" tests

# The fuzzer of rank-divergent programs (launch/fuzz; tests/test_fuzz.py runs a fixed seed of it): FUZZ_PROGRAMS
# programs with the seed FUZZ_SEED (empty: a random one, printed); each failing class is printed as a script that
# reproduces it. FUZZ_ARGS: more key=value overrides, e.g. FUZZ_ARGS="known_open=true not_caught=true".
FUZZ_PROGRAMS ?= 300
FUZZ_SEED ?=
FUZZ_ARGS ?=
fuzz: install
	OMP_NUM_THREADS=1 $(PY) -m launch.fuzz programs=$(FUZZ_PROGRAMS) $(if $(FUZZ_SEED),seed=$(FUZZ_SEED)) $(FUZZ_ARGS)

# Not part of CI. torch is pinned while the project installs, so pip fails rather than replace it.
compat:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install --quiet "torch==$(TORCH)"
	$(COMPAT_VENV)/bin/python -m pip install --quiet -e ".[dev,train]" "torch==$(TORCH)"
	$(COMPAT_VENV)/bin/python -c 'import sys, torch; print("compat: Python", sys.version.split()[0], "torch", torch.__version__)'
	OMP_NUM_THREADS=1 $(COMPAT_VENV)/bin/python -m pytest -n $(NPROC) tests $(COMPAT_ARGS)

frameworks:
	test -x $(FRAMEWORKS_VENV)/bin/python || $(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/python -m pip install --quiet $(FRAMEWORKS_PINS)
	$(FRAMEWORKS_VENV)/bin/python -m pip install --quiet --no-deps -e .
	OMP_NUM_THREADS=1 PYTHONPATH=. $(FRAMEWORKS_VENV)/bin/python tests/frameworks/real_timm.py

compare: install
	OMP_NUM_THREADS=1 $(PY) -m launch.compare.run --config configs/compare.yaml $(ARGS)

bench: install
	$(PY) -m launch.bench.run --config configs/bench.yaml $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m launch.bench.compiled_graph output=docs/performance_compiled_graph.md
	$(PY) -m launch.bench.fast_paths output=docs/performance_fast_paths.md

# On a CUDA machine: the gpu-marked tests, the one-layer benchmark on the GPU, the ResNet-50 training step with each
# library's synchronization forced (launch.bench.resnet50_step: issue 34's G1-G3 ratios) and the kernels' device time
# (launch/bench/gpu.sh). GPU_PY: a python whose torch has CUDA (the .venv's is the CPU build).
# Together they outlast one 10-minute device call: GPU_STAGES="tests step" (of tests micro step kernels other) picks.
GPU_PY ?= $(PY)
GPU_OUT ?= outputs/bench_gpu
bench-gpu:
	bash launch/bench/gpu.sh $(GPU_PY) $(GPU_OUT) $(ARGS)

# The documentation site, into site/: the design page's diagrams redrawn (launch/docs/diagrams.py), then a strict
# build, which reaches no network (mkdocs.yml; tests/test_docs.py builds it too).
docs: install
	$(PY) -m launch.docs.diagrams
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The built site in a headless browser (not in CI, which has no browser): Debian's chromium and chromium-driver
# (apt-get install chromium chromium-driver). launch/docs/browser_check.py says what it checks.
docs-check: docs
	$(PY) -m launch.docs.browser_check site

lint: install
	$(VENV)/bin/ruff check syncbn_dist launch tests

clean:
	rm -rf $(VENV) .venv-compat-* $(FRAMEWORKS_VENV) outputs .pytest_cache build dist *.egg-info site
