# DeterministicDDPStrategy's 2-GPU test alone (bitwise runs, lockstep rollback, 1-vs-2 invariance): nvidia-h200-x2.
run pytest_ddp_gpu 300 python3 -m pytest -q -rs -m multigpu tests/strategies/test_deterministic_ddp_gpu.py
