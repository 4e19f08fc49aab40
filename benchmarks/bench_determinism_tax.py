"""What determinism costs on the DeepEP train step, and why.

Run on the GPU machine (``bash benchmarks/gpu_suite.sh setup determinism_tax`` runs it with its settings)::

    PYTHONPATH=$PWD python benchmarks/bench_determinism_tax.py --out benchmarks/results/determinism_tax

Writes ``DIR/determinism_tax.json`` (every measurement) and ``DIR/summary.txt`` (the table).

Environment variables are read when CUDA/cuBLAS start, so each setting of them runs in its own
child process; inside a child the runtime flags (``use_deterministic_algorithms``, NaN-fill) are
toggled and the variants are measured **interleaved**, round after round, each on a freshly built
model from the same seed (median of rounds; a parameter hash after the same steps shows whether
the variants are bitwise equal). Children:

* ``plain``   no ``CUBLAS_WORKSPACE_CONFIG``: ``default`` (+ the in-process toggle probe).
* ``env4096`` ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` for the whole process: ``cublas_env`` (flags off),
  ``det`` (deterministic algorithms, no fill), ``det_fill`` (PyTorch's default fill).
* ``env16``   ``:16:8``: ``cublas_env``, ``det``.
* ``primed``  ``:4096:8`` only until the first forward+backward GEMM, then unset
  (``prime_cublas_and_release_env``): ``default``, ``det``, ``det_fill``, ``chosen`` (the plugin's
  ``configure()`` defaults with ``release_cublas_env``) (+ the deterministic-mode kernel probe).

Hypotheses tested, each written to the JSON under ``hypotheses``:

1. *The variable costs host time per GEMM, not GPU time* (PyTorch re-parses it with a
   ``std::regex`` in ``getChosenWorkspaceSize`` on every cuBLAS call in some versions). Per GEMM
   at the loop's shapes: host enqueue time (Python loop of calls, no sync; compared to a non-BLAS
   op) and pure GPU time (the same calls replayed from a CUDA graph). In the ``plain`` child the
   variable is also toggled *within the process*: if the host time follows the toggle, it is read
   on every call.
2. *It changes the kernels* (smaller workspace → no split-K): the kernel names launched per GEMM
   shape (``torch.profiler``) per child.
3. *The variable is not needed for bitwise results in one stream* (PyTorch gives every
   (device, stream) its own workspace): 50 repeats of each GEMM bitwise equal without it, and two
   streams running GEMMs concurrently, with and without it.
4. *What deterministic mode itself switches*: kernels of one short step (T=16) with and without
   ``use_deterministic_algorithms``, counted by name; the ``gather`` backward (``scatter_add``) of
   ``q.gather(-1, action)`` is the suspect, so it is timed against the one-hot form.
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from _timing import elapsed_ms

CHILDREN = {
    "plain": ({}, ["default"]),
    "env4096": ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, ["cublas_env", "det", "det_fill"]),
    "primed": ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "_BENCH_PRIME": "1"}, ["default", "det", "det_fill", "chosen"]),
    "env16": ({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, ["cublas_env", "det"]),
}


# ----------------------------------------------------------------------------- child side
def _repeat(fn, times: int) -> None:
    for _ in range(times):
        fn()


def _grad(form, tensor):
    import torch

    return torch.autograd.grad(form(), tensor)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_flags(variant: str) -> None:
    import torch

    det = variant in ("det", "det_fill", "chosen")
    torch.use_deterministic_algorithms(det)
    torch.utils.deterministic.fill_uninitialized_memory = variant == "det_fill"
    if variant == "chosen":
        from deepep_lightning.determinism import configure, prime_cublas_and_release_env

        configure(0)  # the plugin's defaults (sets CUBLAS_WORKSPACE_CONFIG again: the check is cached)
        if torch.cuda.is_available():
            prime_cublas_and_release_env()  # what DeterminismCallback(release_cublas_env=True) does


def _build_step(args, device):
    """DeepEPModule's train step (rollout + loss + backward + Adam); falls back to the probe loop."""
    import torch

    torch.manual_seed(0)
    try:
        from deepep_lightning.deepep import DeepEPModule
        from deepep_lightning.deepep.config import grouped

        model_args = {
            "num_envs": args.B,
            "rollout_length": args.T,
            "hidden_size": args.H,
            "seed": 0,
            "fused_value_head": args.fused,
            **json.loads(args.model_args),
        }
        module = DeepEPModule(**grouped(**model_args)).to(device)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)

        def step():
            module.ensure_rollout_state()
            module.seed_rollout()
            _, terms = module.rollout_and_loss()
            optimizer.zero_grad(set_to_none=True)
            terms.loss.backward()
            optimizer.step()
            module.rollout_state.step += 1
            return terms.loss

        return "DeepEPModule", list(module.parameters()), step
    except Exception as error:  # noqa: BLE001 - any failure falls back, and is reported
        fallback_reason = f"{type(error).__name__}: {error}"
    B, D, A, H, T = args.B, 64, 8, args.H, args.T
    policy = torch.nn.Sequential(torch.nn.Linear(D + H, 256), torch.nn.Tanh(), torch.nn.Linear(256, A)).to(device)
    value = torch.nn.Sequential(torch.nn.Linear(D + A + H, 256), torch.nn.Tanh(), torch.nn.Linear(256, 16)).to(device)
    cell = torch.nn.GRUCell(16, H).to(device)
    params = [*policy.parameters(), *value.parameters(), *cell.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    states = torch.randn(B, T, D, device=device)

    def step():
        hidden = torch.zeros(B, H, device=device)
        loss = 0.0
        for t in range(T):
            s = states[:, t]
            logits = policy(torch.cat([s, hidden], -1))
            action = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)
            one_hot = torch.nn.functional.one_hot(action, A).float()
            v = value(torch.cat([s, one_hot, hidden], -1))
            hidden = cell(v, hidden)
            log_prob = torch.log_softmax(logits, -1).gather(-1, action[:, None]).squeeze(-1)
            loss = loss + (v.pow(2).mean() - log_prob.mean() * v.detach().mean())
        optimizer.zero_grad(set_to_none=True)
        (loss / T).backward()
        optimizer.step()
        return loss

    return f"probe loop (DeepEPModule unavailable: {fallback_reason})", params, step


def _param_hash(params) -> str:
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest()[:16]


def _time_steps(args, device, variants):
    results = {v: {"s_per_step": [], "hashes": set()} for v in variants}
    workload = None
    errors = {}
    for _ in range(args.rounds):
        for variant in variants:
            if variant in errors:
                continue
            try:
                _set_flags(variant)
                workload, params, step = _build_step(args, device)
                step()  # warm-up (also allocator, cuBLAS handles)
                _sync(device)
                steps_ms = elapsed_ms(functools.partial(_repeat, step, args.steps), device)
            except Exception as error:  # noqa: BLE001 - e.g. an op without a deterministic kernel
                errors[variant] = f"{type(error).__name__}: {str(error)[:300]}"
                continue
            results[variant]["s_per_step"].append(steps_ms / 1e3 / args.steps)
            results[variant]["hashes"].add(_param_hash(params))
    summary = {}
    for variant, r in results.items():
        if variant in errors:
            summary[variant] = {"error": errors[variant]}
            continue
        summary[variant] = {
            "median_s_per_step": statistics.median(r["s_per_step"]),
            "s_per_step": r["s_per_step"],
            "param_hashes": sorted(r["hashes"]),
        }
    return workload, summary


def _gemm_shapes(args):
    B, H = args.B, args.H
    # (name, M, K, N, bias): the loop's linear layers, forward and the two backward GEMMs
    return [
        ("policy_in", B, 64 + H, 256, True),
        ("policy_out", B, 256, 8, True),
        ("gru_hh", B, H, 3 * H, True),
        ("grad_input", B, 256, 64 + H, False),
        ("grad_weight", 256, B, 64 + H, False),
    ]


def _gemm_probe(args, device):
    """Hypotheses 1-3 at the loop's shapes."""
    import torch

    out = {}
    calls = args.gemm_calls
    for name, m, k, n, bias in _gemm_shapes(args):
        a = torch.randn(m, k, device=device)
        w = torch.randn(n, k, device=device)
        b = torch.randn(n, device=device) if bias else None
        fn = functools.partial(torch.nn.functional.linear, a, w, b)
        for _ in range(20):
            fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls
        _sync(device)
        entry = {"host_us_per_call": host * 1e6}
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
                with torch.cuda.graph(graph):
                    for _ in range(100):
                        fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            _sync(device)
            replays_ms = elapsed_ms(functools.partial(_repeat, graph.replay, 5), device)
            entry["gpu_us_per_call"] = replays_ms * 1e3 / 500  # 5 replays of 100 calls
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                _sync(device)
            entry["kernels"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
        reference = fn()
        entry["bitwise_50_repeats"] = all(torch.equal(reference, fn()) for _ in range(50))
        out[name] = entry
    # a non-BLAS op of similar launch cost, to tell "BLAS host overhead" from "everything slower"
    x = torch.randn(args.B, 256, device=device)
    start = time.perf_counter()
    for _ in range(calls):
        torch.add(x, x)
    _sync(device)
    out["non_blas_add_host_us_per_call"] = (time.perf_counter() - start) / calls * 1e6
    if device.type == "cuda":
        out["two_streams_bitwise"] = _two_streams(device)
    return out


def _two_streams(device) -> bool:
    import torch

    a = torch.randn(2048, 2048, device=device)
    results = []
    for _ in range(2):
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            r1 = [a @ a for _ in range(10)]
        with torch.cuda.stream(s2):
            r2 = [a.t() @ a for _ in range(10)]
        _sync(device)
        results.append(torch.stack(r1 + r2))
    return bool(torch.equal(results[0], results[1]))


def _toggle_probe(args, device):
    """Hypothesis 1, in one process: does the host cost of a GEMM follow the variable's presence?"""
    import torch

    a = torch.randn(args.B, 256, device=device)
    w = torch.randn(256, 256, device=device)
    out = {}
    for label in ("unset", "set", "unset_again", "set_again"):
        if label.startswith("set"):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        else:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        _sync(device)
        start = time.perf_counter()
        for _ in range(args.gemm_calls):
            torch.mm(a, w)
        out[label] = (time.perf_counter() - start) / args.gemm_calls * 1e6
        _sync(device)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    return {"host_us_per_mm": out}


def _det_mode_kernels(args, device):
    """Hypothesis 4: kernels of one short step with and without deterministic algorithms."""
    import torch

    short = argparse.Namespace(**{**vars(args), "T": 16})
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    kind = "CUDA" if device.type == "cuda" else "CPU"
    counts = {}
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = False
        _, _, step = _build_step(short, device)
        step()
        _sync(device)
        with torch.profiler.profile(activities=[activity]) as prof:
            step()
            _sync(device)
        counts[det] = collections.Counter(e.name for e in prof.events() if e.device_type.name == kind)
    torch.use_deterministic_algorithms(False)
    names = set(counts[False]) | set(counts[True])
    delta = {n: counts[True][n] - counts[False][n] for n in names if counts[True][n] != counts[False][n]}
    gather = {}
    q = torch.randn(args.B, 8, device=device, requires_grad=True)
    action = torch.randint(0, 8, (args.B,), device=device)
    one_hot = torch.nn.functional.one_hot(action, 8).float()
    forms = {"gather": lambda: q.gather(-1, action[:, None]).sum(), "one_hot": lambda: (q * one_hot).sum()}
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        for name, form in forms.items():
            for _ in range(10):
                torch.autograd.grad(form(), q)
            _sync(device)
            total_ms = elapsed_ms(functools.partial(_repeat, functools.partial(_grad, form, q), 200), device)
            gather[f"{name}_{'det' if det else 'default'}_us"] = total_ms / 200 * 1e3
    torch.use_deterministic_algorithms(False)
    return {
        "kernel_count_delta_det_minus_default": dict(sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:25]),
        "total_kernels": {"default": sum(counts[False].values()), "det": sum(counts[True].values())},
        "gather_vs_one_hot_fwd_bwd": gather,
    }


def child_main(args) -> None:
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(4)
    device = torch.device(args.device)
    result = {"child": args.child, "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG",)}}
    if os.environ.pop("_BENCH_PRIME", None):
        from deepep_lightning.determinism import configure, prime_cublas_and_release_env

        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        configure(0)  # sets :4096:8 itself, so it may release it
        torch.use_deterministic_algorithms(False)
        result["released"] = prime_cublas_and_release_env(device) if device.type == "cuda" else False
        result["env_after_prime"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    variants = CHILDREN[args.child][1]
    result["workload"], result["steps"] = _time_steps(args, device, variants)
    torch.use_deterministic_algorithms(False)
    result["gemm"] = _gemm_probe(args, device)
    if args.child == "plain":  # deterministic mode stays off here: no variable at the first GEMM
        result["toggle"] = _toggle_probe(args, device)
    if args.child == "primed":  # PyTorch's cuBLAS check passed at the prime, so det mode can run
        result["det_mode"] = _det_mode_kernels(args, device)
    print("@@RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- parent side
def _run_child(name: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env.update(CHILDREN[name][0])
    command = [sys.executable, __file__, "--child", name, *args.passthrough]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULT ")]
    if not lines:
        return {"child": name, "error": proc.stderr[-3000:], "returncode": proc.returncode}
    result = json.loads(lines[-1][len("@@RESULT ") :])
    result["wall_s"] = time.perf_counter() - start
    return result


def _summarise(children: list[dict]) -> tuple[dict, str]:
    rows, hashes = [], set()
    base = None
    for child in children:
        for variant, r in child.get("steps", {}).items():
            if "error" in r:
                rows.append((child["child"], variant, float("nan"), [r["error"][:60]]))
                continue
            rows.append((child["child"], variant, r["median_s_per_step"], r["param_hashes"]))
            hashes.update(r["param_hashes"])
            if child["child"] == "plain" and variant == "default":
                base = r["median_s_per_step"]
    lines = [f"{'child':10s} {'variant':12s} {'s/step':>9s} {'vs plain':>9s}  param hash"]
    table = []
    for child, variant, s, h in rows:
        ratio = s / base if base else float("nan")
        table.append({"child": child, "variant": variant, "median_s_per_step": s, "ratio_vs_plain_default": ratio})
        lines.append(f"{child:10s} {variant:12s} {s:9.4f} {ratio:9.3f}  {','.join(h)}")
    lines.append(f"all variants bitwise equal: {len(hashes) == 1}")
    for child in children:
        if "det_mode" in child:
            det = child["det_mode"]
            lines.append(
                f"[{child['child']}] kernels per T=16 step {det['total_kernels']};"
                f" gather vs one-hot fwd+bwd us {det['gather_vs_one_hot_fwd_bwd']}"
            )
            lines.append(f"[{child['child']}] det-mode kernel delta {det['kernel_count_delta_det_minus_default']}")
        if "error" in child:
            lines.append(f"[{child['child']}] ERROR {child['error'][-400:]}")
    for child in children:
        gemm = child.get("gemm", {})
        host = {k: round(v.get("host_us_per_call", 0), 1) for k, v in gemm.items() if isinstance(v, dict)}
        gpu = {k: round(v.get("gpu_us_per_call", 0), 2) for k, v in gemm.items() if isinstance(v, dict)}
        lines.append(
            f"[{child['child']}] GEMM host us/call {host}; GPU us/call {gpu};"
            f" add host us {gemm.get('non_blas_add_host_us_per_call', 0):.1f}"
        )
        if "toggle" in child:
            lines.append(f"[{child['child']}] in-process toggle host us/mm {child['toggle']['host_us_per_mm']}")
    return {"table": table, "all_bitwise_equal": len(hashes) == 1}, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for determinism_tax.json and summary.txt")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--B", type=int, default=256, help="num_envs")
    parser.add_argument("--T", type=int, default=256, help="rollout_length")
    parser.add_argument("--H", type=int, default=256, help="hidden_size")
    parser.add_argument("--fused", action="store_true", help="the fused value head (fused_value_head=True)")
    parser.add_argument("--model-args", default="{}", help="JSON of extra DeepEPModule arguments (configs/gpu.yaml)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round and variant")
    parser.add_argument("--gemm-calls", type=int, default=2000)
    parser.add_argument("--child-timeout", type=int, default=150)
    parser.add_argument("--children", default=",".join(CHILDREN), help="subset, comma separated")
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if not args.out:
        parser.error("--out DIR is required")
    args.passthrough = [
        f"--device={args.device}",
        f"--B={args.B}",
        f"--T={args.T}",
        f"--H={args.H}",
        f"--model-args={args.model_args}",
        f"--rounds={args.rounds}",
        f"--steps={args.steps}",
        f"--gemm-calls={args.gemm_calls}",
    ] + (["--fused"] if args.fused else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    children = []
    for name in args.children.split(","):
        result = _run_child(name, args)
        children.append(result)
        print(json.dumps({k: v for k, v in result.items() if k in ("child", "steps", "error", "wall_s")}), flush=True)
    summary, text = _summarise(children)
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "args": {k: v for k, v in vars(args).items()},
        "children": children,
        "summary": summary,
    }
    try:
        import torch

        record["stack"] = {
            "torch": str(torch.__version__),
            "cuda": str(torch.version.cuda),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        }
    except Exception:  # noqa: BLE001
        pass
    (out / "determinism_tax.json").write_text(json.dumps(record, indent=1, default=str))
    (out / "summary.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
