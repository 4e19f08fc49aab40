# Every GPU-marked test suite at once (correctness only: they run concurrently on the one GPU, so nothing
# here is timed), then the short benchmarks one after another, most important first; results are packed
# after each, so a call stopped at its time limit still returns what finished. Needs `setup` first.
verify_tests() {
  local name=$1 limit=$2; shift 2
  ( timeout "$limit" python3 -m pytest -q -rs -m gpu "$@" > "$R/$name.txt" 2>&1; echo "rc=$? $name" >> "$R/status.txt" ) &
}
step "verify: GPU tests in parallel"
verify_tests pytest_foundation_health_gpu 240 tests/test_module_gpu.py tests/agent tests/envs tests/health
verify_tests pytest_determinism_gpu 300 tests/determinism
verify_tests pytest_audit_gpu 200 tests/audit
verify_tests pytest_ops_gpu 200 tests/ops
wait
for name in pytest_foundation_health_gpu pytest_determinism_gpu pytest_audit_gpu pytest_ops_gpu; do
  echo "--- $name"; tail -n 3 "$R/$name.txt"
done
pack
# Determinism tax on configs/gpu.yaml's shape (B=256, T=32, H=256, CUDA graph), separate processes alternated.
for round in 1 2; do
  run graph_plain_t32_$round 60 python3 benchmarks/bench_train_step.py --out "$R" --horizon 32 --graph-only --tag _graph_plain_t32_$round
  run graph_det_t32_$round 60 python3 benchmarks/bench_train_step.py --out "$R" --horizon 32 --graph-only --deterministic --tag _graph_det_t32_$round
done
run train_py_gpu_yaml 90 python3 train.py fit --config configs/gpu.yaml --trainer.max_steps=300 \
  --trainer.logger.init_args.save_dir=/tmp/runs
run bench_refused_ops 120 python3 benchmarks/bench_refused_ops.py --out "$R"
# Why the cuBLAS variable costs on the eager path: per-GEMM host time with/without it, toggled in-process.
run bench_determinism_tax 150 python3 benchmarks/bench_determinism_tax.py --out "$R/determinism_tax" --fused \
  --T 16 --rounds 3 --steps 3 --children plain,env4096,primed
run audit_gpu 120 python3 benchmarks/audit_gpu.py --out "$R"
