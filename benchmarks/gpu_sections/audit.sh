# deepep-audit on the GPU: catalogue table, DeepEP L2/L3 per value head, locator overhead.
run pytest_audit_gpu 200 python3 -m pytest -q -rs -m gpu tests/audit
run audit_gpu 240 python3 benchmarks/audit_gpu.py --out "$R"
