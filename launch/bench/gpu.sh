#!/usr/bin/env bash
# The checks only a GPU can run (docs/gpu.md): the gpu-marked tests, then the one-layer microbenchmark on CUDA
# beside torch.nn.SyncBatchNorm's kernels, the ResNet-50 training step with each library's synchronization forced
# (launch.bench.resnet50_step: issue 34's G1-G3 and each row's device time per step), then each variant's kernels'
# device time (launch.bench.kernel_profile device=cuda). Writes 8 files into OUT_DIR, the most a device run brings back.
#
#   make bench-gpu GPU_PY=python3                   # writes outputs/bench_gpu/
#   bash launch/bench/gpu.sh python3 /tmp/out       # a GPU machine whose python3 has torch (and omegaconf, tqdm)
#   GPU_STAGES="tests step" bash launch/bench/gpu.sh python3 /tmp/out   # some stages only
#
# Into docs/ and the README, on any machine: performance.json becomes docs/performance_cuda.json (stage micro) and
# resnet50_step.md docs/performance_cuda_step.md (stage step); then `python -m launch.bench.render` writes
# docs/performance_cuda.md and the README's GPU table from them (launch/bench/render.py). Update
# docs/gpu.md by hand with what passed, on which GPU and at which commit.
#
# All stages take longer than one 10-minute device call: GPU_STAGES (default: all of them, in this order) picks
# some of tests (test_gpu.py), micro (the one-layer benchmark), step (the ResNet-50 step), kernels (device time)
# and other (the other files' gpu tests).
#
# From the repository root. Extra arguments go to launch.bench.run as KEY=VALUE overrides. Exits 1 if any step failed.
set -uo pipefail
PY=${1:-.venv/bin/python}
OUT_DIR=${2:-outputs/bench_gpu}
shift $(($# < 2 ? $# : 2))
mkdir -p "$OUT_DIR"
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))' \
    || exit 1
# The project into GPU_PY, as a user installs it (the README's runner drops PYTHONPATH, so the quick start's test needs
# an installed syncbn_dist): editable, without dependencies or build isolation, which need a network.
(cd / && env -u PYTHONPATH "$PY" -c 'import syncbn_dist' 2>/dev/null) \
    || "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
status=0
STAGES=" ${GPU_STAGES:-tests micro step kernels other} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
if stage tests; then
    "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT_DIR/pytest_gpu.log" || status=1
fi
# The microbenchmark alone (the scenarios need a GPU per rank), with one layer larger than the L2 beside make bench's.
if stage micro; then
    "$PY" -m launch.bench.run --config configs/bench.yaml 'scenarios=[]' device=cuda readme=null plot=false \
        output_dir="$OUT_DIR" 'micro.shapes=[[32,64,28,28],[8,256,14,14],[256,512],[64,256,56,56]]' "$@" 2>&1 \
        | tee "$OUT_DIR/bench.log" || status=1
fi
# The ResNet-50 step (ResNet-50, batch 64, 224x224, channels_last, bf16 autocast and float32, eager, torch.compile and
# reduce-overhead): its report, markdown then JSON, is one file; its table also goes to bench.log. Inductor compiles
# the model four times (minutes): past 480 s, SIGABRT makes the faulthandler print every thread's stack into the log.
if stage step; then
    timeout -s ABRT 480 "$PY" -X faulthandler -m launch.bench.resnet50_step device=cuda \
        output="$OUT_DIR/resnet50_step.md" 2>&1 | tee -a "$OUT_DIR/bench.log" || status=1
fi
# The kernels' device time (the layer inside a user's torch.compile, on Triton, and the eager ones) beside torch's, at
# a layer in L2 and one larger than it.
for args in "" "shape=[64,256,56,56] memory_format=channels_last"; do
    stage kernels || break
    # shellcheck disable=SC2086  # $args: zero or more KEY=VALUE words
    "$PY" -m launch.bench.kernel_profile device=cuda $args 2>&1 | tee -a "$OUT_DIR/kernel_profile.log" || status=1
done
# The other files' gpu tests. On one H100 (torch 2.11) a pass under pytest-xdist finished its tests and then did not
# exit: here it gets 300 s, and SIGABRT then makes pytest's faulthandler print every thread's stack into the log.
if stage other; then
    timeout -s ABRT 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_batchnorm.py tests/test_features.py tests/test_classic_api.py tests/test_replicate.py \
        tests/test_bench.py 2>&1 \
        | tee -a "$OUT_DIR/pytest_other.log" || status=1
fi
exit $status
