#!/usr/bin/env bash
# The GPU machine's benchmarks and GPU tests, one section per benchmark, run from the repo root:
#
#   bash benchmarks/gpu_suite.sh setup SECTION...
#
# Sections (BENCHMARKS.md describes each):
#   setup             build the extension once (cached in TORCH_EXTENSIONS_DIR); install the wheels in .whl/
#   train_step        bench_train_step.py         all_action_q      bench_all_action_q.py
#   rollout_kernels   cluster_residency.cu (resident clusters by size), then bench_rollout_kernels.py: the block and
#                     cluster rollout kernels alone, B = 16 to 512
#   sanitize          CSAN + memcheck runs        determinism_tax   bench_determinism_tax.py (the eager step)
#   determinism_tax_graph  the shipped CUDA-graph step of configs/gpu.yaml with and without configure(0)
#   learning          bench_learning.py           health_overhead   bench_health_overhead.py (CUDA graph)
#   fit               bench_fit.py: train.py fit --config configs/gpu.yaml on seeds 0-9, 10 at a time, once per line
#                     of FIT_RUNS ("LABEL [bench_fit.py options]"; default "gpu_yaml --alone 3")
#   fit_startup       fit_startup.py: where train.py fit --config configs/gpu.yaml's start-up goes, 3 fresh runs,
#                     then 3 with a bytecode cache that fit's runs share (run fit_startup before fit)
#   collapse_recovery bench_collapse_recovery.py (train.py fit with and without the RegressionTrigger)
#   audit             audit_gpu.py                refused_ops       bench_refused_ops.py, twice
#   refused_ops_list  list_refused_ops.py         ddp, ddp_ablation bench_ddp.py, ddp_ablation.py (2 GPUs)
#   torchvision_ops   ps_roi_pool_agreement.py, then bench_torchvision_ops.py (20 repeats)
#   silent_ops        sweep_silent_ops.py: OpInfo, ModuleInfo, large/cuDNN/SDPA/compile cases, bitwise x3
#   tax_ablation      bench_tax_ablation.py for TAX_ABLATION_MODELS (default mixtral_moe swin_t): the plugin's
#                     settings one at a time in one process
#   zoo               bench_zoo.py: models ZOO_MODELS (default all), stages ZOO_STAGES (default verdict timing),
#                     ZOO_PARALLEL verdict processes (8), nothing started past ZOO_BUDGET_S (420); it continues
#                     benchmarks/results/zoo/zoo.json (earlier calls' records are kept), so calls can split the zoo
#   gpu-tests         every test marked gpu and not multigpu; gpu-tests-multi: the multigpu tests (2 GPUs)
#                     (GPU_TESTS="tests/ops/test_x.py ..." runs those files instead of tests/; GPU_TEST_WORKERS=N
#                     runs N pytest-xdist processes, a file each)
#
# Each section writes its result files to /tmp/r/results/<section>/ (the layout of benchmarks/results/) and its
# logs to /tmp/r/logs/ (<run>.txt, status.txt with one exit code per run). /tmp/r is packed into
# $OUT/results.tar.gz after every run and every 30 s during one: one file comes back from the device machine, and
# a call stopped at its time limit still returns every run that finished and what a running one had written.
set -u
PYCACHE=/tmp/pycache  # the fit sections' bytecode cache (bench_fit.fit_environment), kept off the packed results
SECTIONS="setup train_step rollout_kernels all_action_q sanitize determinism_tax determinism_tax_graph learning fit fit_startup"
SECTIONS+=" collapse_recovery health_overhead audit refused_ops refused_ops_list torchvision_ops silent_ops ddp"
SECTIONS+=" ddp_ablation tax_ablation zoo gpu-tests gpu-tests-multi"
for section in "$@"; do
  case " $SECTIONS " in
    *" $section "*) ;;
    *) echo "unknown section '$section'; choose from: $SECTIONS" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu_suite.sh SECTION...; sections: $SECTIONS" >&2; exit 2; }

OUT=${OUT:-/tmp/out}
STAGE=/tmp/r
RESULTS=$STAGE/results
LOGS=$STAGE/logs
mkdir -p "$RESULTS" "$LOGS" "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=/tmp/site  # the carried wheels (jsonargparse for LightningCLI is not in the GPU image), installed by setup
[ -d "$SITE" ] && export PYTHONPATH=$PWD:$SITE
RC=0

pack() { tar -czf "$OUT/results.tar.gz.tmp" -C "$STAGE" . && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"; }

run() {  # run NAME LIMIT_S COMMAND...: output to logs/NAME.txt, exit code to RC and status.txt, then pack
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T))"
  # pack every 30 s meanwhile: a call stopped at its time limit still returns what a long run has written so far
  (while sleep 30; do pack; done) &
  local packer=$!
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  RC=$?
  kill "$packer" 2>/dev/null
  wait "$packer" 2>/dev/null
  echo "rc=$RC $name" | tee -a "$LOGS/status.txt"
  tail -n 5 "$LOGS/$name.txt"
  pack
}

keep() {  # keep FILE DIR: copy a result file out of a run's working folder (it may be missing after a failure)
  mkdir -p "$2" && { cp -f "$1" "$2/" 2>/dev/null || echo "no $1"; }
}

to_logs() {  # to_logs FILE NAME: a side output that is not a result file goes to the logs
  [ -f "$1" ] && mv -f "$1" "$LOGS/$2"
}

memcheck() {  # memcheck NAME LIMIT_S COMMAND...: compute-sanitizer memcheck; summary in results/sanitize/NAME.json
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
    --log-file "$LOGS/$name.log" "$@"
  mkdir -p "$RESULTS/sanitize"
  python3 - "$LOGS/$name.log" "$LOGS/$name.txt" "$RESULTS/sanitize/$name.json" "$RC" \
    "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 $*" <<'PY'
import json, os, sys

log, output, path, code, command = sys.argv[1:6]
lines = open(log, errors="replace").read().splitlines() if os.path.exists(log) else []
summary = next((line.strip("= ").strip() for line in reversed(lines) if "ERROR SUMMARY" in line), None)
errors = int(summary.split(":")[1].split()[0]) if summary else None
tail = [line.strip() for line in open(output, errors="replace") if line.strip()][-1:] if os.path.exists(output) else []
record = {"tool": "compute-sanitizer --tool memcheck", "command": command, "exit_code": int(code), "errors": errors,
          "error_summary": summary, "output_tail": tail[0] if tail else None}
with open(path, "w") as handle:
    json.dump(record, handle, indent=2)
print(f"wrote {path}: {summary}")
PY
  pack
}

csan() {  # csan NAME LIMIT_S COMMAND...: run under TORCH_CUDA_SANITIZER=1; summary in results/sanitize/NAME.json
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" env TORCH_CUDA_SANITIZER=1 "$@"
  mkdir -p "$RESULTS/sanitize"
  python3 - "$LOGS/$name.txt" "$RESULTS/sanitize/$name.json" "$RC" <<'PY'
import json, os, sys

output, path, code = sys.argv[1:4]
text = open(output, errors="replace").read() if os.path.exists(output) else ""
races = text.count("CSAN detected a possible data race")
tail = [line.strip() for line in text.splitlines() if line.strip()][-1:]
record = {"tool": "TORCH_CUDA_SANITIZER=1 (CSAN)", "exit_code": int(code), "data_races": races,
          "output_tail": tail[0] if tail else None}
with open(path, "w") as handle:
    json.dump(record, handle, indent=2)
print(f"wrote {path}: exit {code}, {races} data races")
PY
  pack
}

gpu_tests() {  # gpu_tests NAME LIMIT_S MARKER: pytest -m MARKER over $GPU_TESTS (tests/); summary in results/NAME/NAME.json
  local name=$1 limit=$2 marker=$3 paths=${GPU_TESTS:-tests} workers=()
  # GPU_TEST_WORKERS=N: N pytest-xdist processes sharing the GPU, a test file each (needs pytest-xdist in .whl/)
  [ -n "${GPU_TEST_WORKERS:-}" ] && workers=(-n "$GPU_TEST_WORKERS" --dist loadfile)
  rm -f "$LOGS/$name.xml"
  # shellcheck disable=SC2086 # $paths is a list of test paths
  run "$name" "$limit" python3 -m pytest -q -rs -m "$marker" "${workers[@]}" $paths --junitxml="$LOGS/$name.xml"
  mkdir -p "$RESULTS/$name"
  python3 - "$LOGS/$name.xml" "$LOGS/$name.txt" "$RESULTS/$name/$name.json" "$RC" \
    "python3 -m pytest -q -rs -m \"$marker\" ${workers[*]} $paths" <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET

xml_path, output, path, code, command = sys.argv[1:6]


def split_id(classname, name):
    """tests.ops.test_x.TestY + test_z -> (tests/ops/test_x.py, tests/ops/test_x.py::TestY::test_z)."""
    if not classname:  # a collection error names the module in ``name``
        classname, name = name, "<collection>"
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if os.path.exists(candidate):
            return candidate, "::".join([candidate, *parts[end:], name])
    return classname, f"{classname}::{name}"


record = {"command": command, "exit_code": int(code), "totals": {}, "files": {}, "failures": [], "skipped": []}
totals = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
if os.path.exists(xml_path):
    root = ET.parse(xml_path).getroot()
    seconds = sum(float(suite.get("time", 0)) for suite in root.iter("testsuite"))
    for case in root.iter("testcase"):
        test_file, test_id = split_id(case.get("classname", ""), case.get("name", ""))
        outcome = "passed"
        for tag, kind in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            child = case.find(tag)
            if child is not None:
                outcome = kind
                message = (child.get("message") or "").splitlines()[:1]
                entry = {"test": test_id, "message": message[0][:300] if message else ""}
                (record["skipped"] if kind == "skipped" else record["failures"]).append(entry)
                break
        counts = record["files"].setdefault(test_file, dict.fromkeys(totals, 0))
        counts[outcome] += 1
        totals[outcome] += 1
    record["totals"] = {**totals, "seconds": round(seconds, 1)}
else:  # pytest was killed (time limit, crash) before writing its report
    tail = open(output, errors="replace").read().splitlines()[-20:] if os.path.exists(output) else []
    record["error"] = f"no JUnit report (pytest exit code {code})"
    record["output_tail"] = tail
try:
    import torch

    record["torch"] = torch.__version__
    gpus = torch.cuda.device_count()
    record["device"] = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "cpu"
except Exception as error:  # noqa: BLE001 - the summary is written either way
    record["device"] = f"unknown ({type(error).__name__})"
with open(path, "w") as handle:
    json.dump(record, handle, indent=2)
print(f"wrote {path}: {record['totals'] or record.get('error')}")
PY
  pack
}

# grid_sample and interpolate forward + backward on small odd shapes, both dtypes, every padding (for memcheck)
REFUSED_OPS_DRIVER="
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

# deepep::cartpole_rollout on odd sizes (rows per block that leave a partial block, episodes that end), both dtypes
ROLLOUT_DRIVER="
import torch
from deepep_lightning.deepep.agent import DeepEPAgent
from deepep_lightning.deepep.agent.fused_rollout import rollout_steps_fused
from deepep_lightning.deepep.envs import BatchedCartPole
for dtype in (torch.float32, torch.float64):
    torch.set_default_dtype(dtype)
    for batch, hidden, rows in ((7, 24, 3), (33, 64, 8), (5, 40, 1)):
        agent = DeepEPAgent(4, 2, hidden, logit_bound=2.0).cuda()
        env = BatchedCartPole(batch, 'cuda', max_episode_steps=9)
        generator = torch.Generator('cuda').manual_seed(0)
        env.reset(generator)
        rollout_steps_fused(agent, env, torch.zeros(batch, hidden, device='cuda'), 20, generator, rows)
torch.cuda.synchronize()
print('memcheck run finished')"

# deepep::lambda_returns on odd shapes (a partial block, one timestep, one column), both dtypes
LAMBDA_DRIVER="
import torch
from deepep_lightning.deepep.kernels import lambda_returns
generator = torch.Generator('cuda').manual_seed(0)
for dtype in (torch.float32, torch.float64):
    for horizon, batch in ((33, 257), (1, 5), (300, 1)):
        def draw(*shape):
            return torch.randn(*shape, device='cuda', dtype=dtype, generator=generator)
        dones = torch.rand(horizon, batch, device='cuda', generator=generator) < 0.3
        lambda_returns(draw(horizon, batch), dones, draw(horizon, batch), draw(batch), 0.99, 0.95)
torch.cuda.synchronize()
print('memcheck run finished')"

for section in "$@"; do
  case $section in
    setup)
      nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
      if [ -d .whl ]; then
        run install_wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target "$SITE" .whl/*.whl
        [ "$RC" = 0 ] && export PYTHONPATH=$PWD:$SITE
      fi
      run build 300 python3 -c "
import time; t = time.time()
from deepep_lightning.ops import cuda_kernels_available, extension_error
assert cuda_kernels_available(), extension_error()
print('extension with CUDA kernels built in', round(time.time() - t, 1), 's')" ;;
    train_step)
      run bench_train_step 300 python3 benchmarks/bench_train_step.py --out "$RESULTS/train_step" ;;
    rollout_kernels)
      mkdir -p "$RESULTS/train_step"
      run cluster_residency 120 bash -c "nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 \
        benchmarks/cluster_residency.cu -o /tmp/cluster_residency && /tmp/cluster_residency \
        > $RESULTS/train_step/cluster_residency.txt"
      run bench_rollout_kernels 240 python3 benchmarks/bench_rollout_kernels.py --out "$RESULTS/train_step" ;;
    all_action_q)
      run bench_all_action_q 240 python3 benchmarks/bench_all_action_q.py --out "$RESULTS/all_action_q" ;;
    sanitize)
      run sanitize_all_action_q 60 env TORCH_CUDA_SANITIZER=1 \
        python3 benchmarks/sanitize_all_action_q.py --out "$RESULTS/sanitize"
      memcheck memcheck_all_action_q 100 python3 benchmarks/sanitize_all_action_q.py --quick
      memcheck memcheck_refused_ops 150 python3 -c "$REFUSED_OPS_DRIVER"
      csan sanitize_cartpole_rollout 60 python3 -c "$ROLLOUT_DRIVER"
      memcheck memcheck_cartpole_rollout 120 python3 -c "$ROLLOUT_DRIVER"
      csan sanitize_lambda_returns 60 python3 -c "$LAMBDA_DRIVER"
      memcheck memcheck_lambda_returns 60 python3 -c "$LAMBDA_DRIVER" ;;
    determinism_tax)
      run bench_determinism_tax 240 python3 benchmarks/bench_determinism_tax.py --out "$RESULTS/determinism_tax" \
        --fused --T 16 --rounds 3 --steps 3 --children plain,env4096,primed
      to_logs "$RESULTS/determinism_tax/summary.txt" determinism_tax_summary.txt ;;
    determinism_tax_graph)
      # configs/gpu.yaml's shipped CUDA-graph step (the rollout kernel) with and without configure(0),
      # separate processes, alternated
      for i in 1 2; do
        for variant in plain det; do
          flag=$([ $variant = det ] && echo --deterministic)
          run train_step_rollout_kernel_graph_${variant}_t32_$i 60 python3 benchmarks/bench_train_step.py \
            --out "$RESULTS/determinism_tax" --horizon 32 --variants rollout_kernel_graph --no-census $flag \
            --tag _rollout_kernel_graph_${variant}_t32_$i
        done
      done ;;
    learning)
      run bench_learning 560 python3 benchmarks/bench_learning.py --out "$RESULTS/learning" \
        --seeds 0 1 2 3 4 5 6 7 8 9 --parallel 10 ;;
    fit)
      while read -r label options; do  # each run's TensorBoard logs (~4 MiB) stay off the packed results
        [ -n "$label" ] || continue
        # shellcheck disable=SC2086 # options is a list of bench_fit.py options
        run fit_$label 560 python3 benchmarks/bench_fit.py --out "$RESULTS/learning" --logs /tmp/fit_logs \
          --config configs/gpu.yaml --seeds 0 1 2 3 4 5 6 7 8 9 --parallel 10 --label "$label" \
          --pycache "$PYCACHE" $options
      done <<< "${FIT_RUNS:-gpu_yaml --alone 3}" ;;
    fit_startup)  # its per-run logs (the -X importtime report) stay in /tmp/fit_startup
      run fit_startup 300 python3 benchmarks/fit_startup.py --out /tmp/fit_startup --config configs/gpu.yaml --runs 3
      keep /tmp/fit_startup/fit_startup_gpu.json "$RESULTS/learning"
      # the same with a bytecode cache, which the first run writes: the later runs import as an installed
      # environment does (bench_fit.fit_environment); fit's runs share the cache
      run fit_startup_pycache 300 python3 benchmarks/fit_startup.py --out /tmp/fit_startup --config configs/gpu.yaml \
        --runs 3 --pycache "$PYCACHE" --label gpu_pycache
      keep /tmp/fit_startup/fit_startup_gpu_pycache.json "$RESULTS/learning" ;;
    collapse_recovery)
      run bench_collapse_recovery 560 python3 benchmarks/bench_collapse_recovery.py \
        --out "$RESULTS/collapse_recovery" --seeds 1 3 ;;
    health_overhead)
      run bench_health_overhead 200 python3 benchmarks/bench_health_overhead.py --out "$RESULTS/health_overhead" \
        --num-envs 256 --rollout-length 32 --hidden-size 256 --fused-value-head --cuda-graph \
        --steps 300 --warmup 10 --repeats 5 ;;
    audit)
      run audit_gpu 240 python3 benchmarks/audit_gpu.py --out "$RESULTS/audit"
      to_logs "$RESULTS/audit/audit_catalogue_h200.md" audit_catalogue_h200.md ;;
    refused_ops)
      for i in 1 2; do  # twice, to show how much the ratios move from one run to the next
        run bench_refused_ops_$i 300 python3 benchmarks/bench_refused_ops.py \
          --out "$RESULTS/refused_ops/repeat_$i" --profile
        to_logs "$RESULTS/refused_ops/repeat_$i/refused_ops_profile.txt" refused_ops_profile_$i.txt
      done ;;
    refused_ops_list)
      run list_refused_ops 120 python3 benchmarks/list_refused_ops.py --out "$RESULTS/refused_ops_list" ;;
    torchvision_ops)
      run ps_roi_pool_agreement 60 python3 benchmarks/ps_roi_pool_agreement.py \
        --out "$RESULTS/torchvision_ops/ps_roi_pool_agreement.json"
      run bench_torchvision_ops 300 python3 benchmarks/bench_torchvision_ops.py --repeats 20 \
        --out "$RESULTS/torchvision_ops/torchvision_ops.json" ;;
    silent_ops)
      run sweep_silent_ops 560 python3 benchmarks/sweep_silent_ops.py --out "$LOGS/silent_ops" --device cuda \
        --shards ${SILENT_OPS_SHARDS:-6} --budget-s ${SILENT_OPS_BUDGET_S:-420}
      mkdir -p "$RESULTS/silent_ops"
      cp -f "$LOGS"/silent_ops/silent_ops*.json "$RESULTS/silent_ops/" 2>/dev/null || echo "no sweep results" ;;
    ddp)
      run bench_ddp 300 python3 benchmarks/bench_ddp.py --out "$LOGS/ddp" --gpus 2
      keep "$LOGS/ddp/ddp.json" "$RESULTS/ddp" ;;
    ddp_ablation)
      run ddp_ablation 540 python3 benchmarks/ddp_ablation.py --out "$LOGS/ddp_ablation" --gpus 2 --budget-s 350
      keep "$LOGS/ddp_ablation/ddp_ablation.json" "$RESULTS/ddp_ablation" ;;
    tax_ablation)
      for model in ${TAX_ABLATION_MODELS:-mixtral_moe swin_t}; do
        run tax_ablation_$model 240 python3 benchmarks/bench_tax_ablation.py --model "$model" \
          --out "$RESULTS/tax_ablation"
      done ;;
    zoo)
      # a fresh machine has no /tmp/r: continue the result in the tree (the previous calls' records)
      mkdir -p "$RESULTS/zoo"
      [ -f "$RESULTS/zoo/zoo.json" ] || cp benchmarks/results/zoo/zoo.json "$RESULTS/zoo/" 2>/dev/null
      # shellcheck disable=SC2086 # ZOO_MODELS and ZOO_STAGES are lists
      run bench_zoo 560 python3 benchmarks/bench_zoo.py --models ${ZOO_MODELS:-all} --stages ${ZOO_STAGES:-verdict timing} \
        --parallel "${ZOO_PARALLEL:-8}" --budget-s "${ZOO_BUDGET_S:-420}" --out "$RESULTS/zoo" --runs-dir "$LOGS/zoo_runs" ;;
    gpu-tests)
      gpu_tests gpu_tests "${GPU_TESTS_LIMIT_S:-540}" "gpu and not multigpu" ;;
    gpu-tests-multi)
      gpu_tests gpu_tests_multi 540 multigpu ;;
  esac
  pack
done
cat "$LOGS/status.txt"
