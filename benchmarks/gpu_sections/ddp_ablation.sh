# Issue #7: where the deterministic strategy's extra step time comes from. One fresh launch per variant
# (plain vs deterministic, each feature of the strategy switched off alone, 1-GPU baselines, a repeat of
# both at the end for drift); ~5 min on 2 H200s, no variant starts after 400 s. Needs no extension build.
run ddp_ablation 540 python3 benchmarks/ddp_ablation.py --out "$R/ddp_ablation" --gpus 2 --budget-s 400
