# Deterministic backward kernels for ops PyTorch refuses (issue 9): tests, the refused-ops list, the benchmark.
run pytest_refused_gpu 200 python3 -m pytest -q -rs -m gpu tests/ops/test_refused_ops_cuda.py
run list_refused_ops 120 python3 benchmarks/list_refused_ops.py --out "$R"
run bench_refused_ops 150 python3 benchmarks/bench_refused_ops.py --out "$R"
