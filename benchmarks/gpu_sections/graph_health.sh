# configs/gpu.yaml as shipped (CUDA graph, DeterminismCallback with release_cublas_env, health + rollback):
# the determinism, health and refused-ops GPU tests side by side (correctness only), then, alone on the
# GPU, the overhead of the health callbacks on the CUDA-graph step and the refused-ops benchmark.
verify_tests() {
  local name=$1 limit=$2; shift 2
  ( timeout "$limit" python3 -m pytest -q -rs -m gpu "$@" > "$R/$name.txt" 2>&1; echo "rc=$? $name" >> "$R/status.txt" ) &
}
step "graph_health: GPU tests in parallel"
verify_tests pytest_determinism_gpu 150 tests/determinism
verify_tests pytest_foundation_health_gpu 120 tests/test_module_gpu.py tests/health
verify_tests pytest_refused_gpu 120 tests/ops/test_refused_ops_cuda.py tests/ops/test_interpolate_cuda.py
wait
for name in pytest_determinism_gpu pytest_foundation_health_gpu pytest_refused_gpu; do
  echo "--- $name"; tail -n 2 "$R/$name.txt"
done
pack
while pgrep -f "benchmarks/bench_ddp.py" > /dev/null; do sleep 2; done  # time nothing while bench_ddp runs
run bench_health_overhead_graph 80 python3 benchmarks/bench_health_overhead.py --out "$R/health_graph" \
  --num-envs 256 --rollout-length 32 --hidden-size 256 --fused-value-head --cuda-graph --steps 100 --warmup 10
run bench_refused_ops 40 python3 benchmarks/bench_refused_ops.py --out "$R"
