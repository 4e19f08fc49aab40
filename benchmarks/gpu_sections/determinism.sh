# Determinism on the GPU: resume/two-run tests (eager + CUDA graph), the tax benchmark, and the
# CUDA-graph step with and without the plugin's determinism settings (separate processes, since
# CUBLAS_WORKSPACE_CONFIG is read at CUDA start; alternated twice).
run pytest_determinism_gpu 200 python3 -m pytest -q -rs -m gpu tests/determinism
run bench_determinism_tax 240 python3 benchmarks/bench_determinism_tax.py --out "$R/determinism_tax" --fused
for round in 1 2; do
  run graph_plain_$round 90 python3 benchmarks/bench_train_step.py --out "$R" --graph-only --tag _graph_plain_$round
  run graph_det_$round 90 python3 benchmarks/bench_train_step.py --out "$R" --graph-only --deterministic --tag _graph_det_$round
done
run train_py_gpu_yaml 150 python3 train.py fit --config configs/gpu.yaml --trainer.max_steps=40 \
  --trainer.logger.init_args.save_dir=/tmp/runs
