# NaN-proof training on the GPU: the health/rollback campaign and the overhead benchmark.
run pytest_health_gpu 130 python3 -m pytest -q -rs -m gpu tests/health
run bench_health_overhead 120 python3 benchmarks/bench_health_overhead.py --out "$R" --steps 100
