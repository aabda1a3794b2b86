#!/usr/bin/env bash
# The checks that need a GPU, in one run (a lent machine is held for minutes; see docs/architecture.md's
# "Devices"). Each part has its own time limit and the script goes on after a failure, so one run gives
# every figure. Logs go to $OUT when set (the device tool brings that folder back), else to ./out/gpu.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a machine with CUDA
#   SKIP_CPU_SUITE=1 SKIP_FP8_GEMM=1 bash benchmarks/gpu_check.sh   # leave parts out
#
# Parts: the environment; the CUDA tests (tests/cuda); FP8 GEMM throughput (benchmarks/fp8_gemm.py);
# the one-GPU pipeline smoke run (benchmarks/gpu_pipeline.py, fp32 and fp8); the runtime's own cost
# (benchmarks/runtime_overhead.py); the CPU test suite under
# that machine's torch (another torch release than CI's: a compatibility check).
set -u
LOG=${OUT:-out/gpu}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the machine lacks (graphviz), carried as wheels
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
part() { echo; echo "=== $1 ($(date +%T))"; }

part environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), \
'capability', torch.cuda.get_device_capability())"

part "CUDA tests"
timeout 150 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/cuda tests/runtime/test_runtime_device.py \
    2>&1 | tee "$LOG/cuda_tests.log" | tail -25

part "FP8 GEMM"
[ "${SKIP_FP8_GEMM:-0}" = 1 ] && echo skipped || timeout 80 $PY benchmarks/fp8_gemm.py --device cuda --iters 20 \
    --sizes 4096x4096x4096 8192x7168x2048 16384x2048x7168 4096x18432x7168 2>&1 | tee "$LOG/fp8_gemm.log"

part "one-GPU pipeline (fp32, tf32 matmuls)"
timeout 110 $PY benchmarks/gpu_pipeline.py --steps 5 2>&1 | tee "$LOG/gpu_pipeline.log"
part "runtime overhead (ours / plain / torch, one process)"
[ "${SKIP_OVERHEAD:-0}" = 1 ] && echo skipped || timeout 120 $PY benchmarks/runtime_overhead.py --device cuda \
    --rounds 3 2>&1 | tee "$LOG/runtime_overhead.log"
part "one-GPU pipeline (fp8)"
timeout 150 $PY benchmarks/gpu_pipeline.py --steps 2 --chunks 4 --dim 1024 --seq 1024 --fp8 2>&1 | tee "$LOG/gpu_pipeline_fp8.log"

part "CPU test suite under this machine's torch"
[ "${SKIP_CPU_SUITE:-0}" = 1 ] && { echo skipped; exit 0; }
timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" -n 14 --dist loadfile -rf tests \
    2>&1 | tee "$LOG/cpu_suite.log" | tail -30
echo "=== done ($(date +%T))"
