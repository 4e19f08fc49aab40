# DeterministicDDPStrategy on 2 GPUs: bitwise run-to-run, lockstep rollback, scaling, cost vs plain ddp.
run bench_ddp 220 python3 benchmarks/bench_ddp.py --out "$R/ddp" --gpus 2
