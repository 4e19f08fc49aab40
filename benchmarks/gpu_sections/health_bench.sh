# Overhead of NumericalHealthCallback and NaNRollbackCallback on configs/gpu.yaml's CUDA-graph step
# (B=256, T=32, H=256, fused value head), 5 interleaved repeats of 300 timed steps.
run bench_health_overhead_graph 200 python3 benchmarks/bench_health_overhead.py --out "$R/health_graph" \
  --num-envs 256 --rollout-length 32 --hidden-size 256 --fused-value-head --cuda-graph --steps 300 --warmup 10 \
  --repeats 5
