# Items that earlier sessions could only run while sharing the GPU: the CUDA-graph two-run + SIGKILL-resume
# test with the current DeterminismCallback defaults (release_cublas_env=True), alone, and the overhead of the
# health callbacks on configs/gpu.yaml's CUDA-graph step.
run pytest_determinism_graph_gpu 240 python3 -m pytest -q -rs -m gpu \
  "tests/determinism/test_resume.py::test_gpu_two_runs_and_sigkill_resume_are_bitwise_equal[cuda_graph]"
run bench_health_overhead_graph 120 python3 benchmarks/bench_health_overhead.py --out "$R/health_graph" \
  --num-envs 256 --rollout-length 32 --hidden-size 256 --fused-value-head --cuda-graph --steps 100 --warmup 10
