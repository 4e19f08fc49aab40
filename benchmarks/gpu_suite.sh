#!/usr/bin/env bash
# Everything the GPU machine runs, in sections: bash benchmarks/gpu_suite.sh SECTION... Results are written
# under /tmp/r and packed into $OUT/results.tar.gz after every run (only a few files come back from the
# device machine, and a run killed at the time limit must still return what finished).
# Sections: setup foundation ops sanitize learning determinism health audit refused ddp ddp_ablation verify
# graph_checks graph_health health_bench ddp_test refused_bench refused_verify refused_tests
set -u
OUT=${OUT:-/tmp/out}
R=/tmp/r
mkdir -p "$R" "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then  # jsonargparse (LightningCLI) is not in the GPU image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
step() { echo "=== $* ($(date +%T))"; }
pack() { tar -czf "$OUT/results.tar.gz.tmp" -C /tmp r && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"; }
run() {
  local name=$1 limit=$2; shift 2; step "$name"
  timeout "$limit" "$@" > "$R/$name.txt" 2>&1
  echo "rc=$? $name" | tee -a "$R/status.txt"; tail -n 5 "$R/$name.txt"; pack
}

for section in "$@"; do
  case $section in
    setup)
      nvidia-smi > "$R/nvidia-smi.txt" 2>&1
      run build 300 python3 -c "
import time; t=time.time()
from deepep_lightning.ops import cuda_kernels_available as c, extension_error as e
assert c(), e(); print('extension with CUDA kernels built in', round(time.time()-t,1), 's')" ;;
    foundation)
      run pytest_foundation_gpu 240 python3 -m pytest -q -rs -m gpu tests/test_module_gpu.py tests/agent tests/envs
      run bench_train_step 240 python3 benchmarks/bench_train_step.py --out "$R" ;;
    ops)
      run pytest_ops_gpu 240 python3 -m pytest -q -rs -m gpu tests/ops
      run bench_all_action_q 240 python3 benchmarks/bench_all_action_q.py --out "$R" ;;
    learning)
      run bench_learning 500 python3 benchmarks/bench_learning.py --out "$R" --budget-s 150 --memory-horizons 32 64 128 256 --memory-budget-s 80 ;;
    *) [ -f "benchmarks/gpu_sections/$section.sh" ] && source "benchmarks/gpu_sections/$section.sh" || echo "unknown section $section" ;;
  esac
done
pack
cat "$R/status.txt"
