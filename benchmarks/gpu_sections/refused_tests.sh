# The refused-ops GPU tests and the CPU-side registration/argument tests on the GPU machine's torch.
run pytest_refused_gpu 240 python3 -m pytest -q -rs -m gpu tests/ops/test_refused_ops_cuda.py tests/ops/test_interpolate_cuda.py
run pytest_refused_registration 150 python3 -m pytest -q -rs tests/ops/test_refused_ops_registration.py \
  tests/ops/test_grid_sample.py tests/ops/test_interpolate.py tests/ops/test_routing.py
