# Deterministic backward kernels for ops PyTorch refuses (issue 9): tests, the refused-ops list, the benchmark
# (the deterministic kernels against PyTorch's atomic kernels in one process, with a bitwise-repeat check and a
# torch.profiler table per shape), then compute-sanitizer memcheck over the kernels on small odd shapes.
run pytest_refused_gpu 240 python3 -m pytest -q -rs -m gpu tests/ops/test_refused_ops_cuda.py tests/ops/test_interpolate_cuda.py
run bench_refused_ops 150 python3 benchmarks/bench_refused_ops.py --out "$R" --profile
run list_refused_ops 120 python3 benchmarks/list_refused_ops.py --out "$R"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck_refused 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  --log-file "$R/memcheck_refused.log" python3 -c "
import torch
from deepep_lightning.ops import grid_sample, interpolate
torch.manual_seed(0)
for dtype in (torch.float32, torch.float64):
    for c in (1, 3, 9):
        x = torch.randn(2, c, 9, 13, device='cuda', dtype=dtype, requires_grad=True)
        grid = (torch.rand(2, 7, 11, 2, device='cuda', dtype=dtype) * 2.4 - 1.2).requires_grad_()
        for padding in ('zeros', 'border', 'reflection'):
            torch.autograd.grad(grid_sample(x, grid, padding_mode=padding, align_corners=False).sum(), (x, grid))
        for size in ((40, 3), (4, 70), (9, 13), (600, 41)):
            torch.autograd.grad(interpolate(x, size=size, mode='bilinear', align_corners=True).sum(), x)
torch.cuda.synchronize()
print('memcheck run finished')"
