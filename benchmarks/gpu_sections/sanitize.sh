TORCH_CUDA_SANITIZER=1 run csan 60 python3 benchmarks/sanitize_all_action_q.py --out "$R/csan"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 1 \
  --log-file "$R/memcheck.log" python3 benchmarks/sanitize_all_action_q.py --quick
