# The refused-ops GPU tests, the registration tests (opcheck, torch.compile) on the GPU machine's torch, then
# the benchmark twice (section refused_bench).
run pytest_refused_gpu 240 python3 -m pytest -q -rs -m gpu tests/ops/test_refused_ops_cuda.py tests/ops/test_interpolate_cuda.py
run pytest_refused_registration 120 python3 -m pytest -q -rs tests/ops/test_refused_ops_registration.py \
  tests/ops/test_grid_sample.py tests/ops/test_interpolate.py tests/ops/test_routing.py
source benchmarks/gpu_sections/refused_bench.sh
