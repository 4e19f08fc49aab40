# The refused-ops GPU tests, then the benchmark twice (section refused_bench).
run pytest_refused_gpu 240 python3 -m pytest -q -rs -m gpu tests/ops/test_refused_ops_cuda.py tests/ops/test_refused_ops_registration.py
source benchmarks/gpu_sections/refused_bench.sh
