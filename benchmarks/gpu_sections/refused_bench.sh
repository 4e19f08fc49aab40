# The refused-ops backward benchmark alone, twice (burst-timed wall and host ms per call, GPU kernel ms from
# torch.profiler), to show how stable the ratios are from one run to the next.
for round in 1 2; do
  run bench_refused_ops_$round 120 python3 benchmarks/bench_refused_ops.py --out "$R/refused_$round" --profile
done
