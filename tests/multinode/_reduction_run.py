"""Test helper: DDP gradient averaging on 4 gloo processes, DDP's all-reduce vs the ordered hook.

Usage: ``python _reduction_run.py OUT.json [--backend nccl --world-size 2]`` (gloo on CPU with 4
processes by default; NCCL puts rank ``r`` on ``cuda:r``). Each rank runs the same forward/backward twice on
the same weights and inputs: the first backward reduces DDP's initial bucket (every parameter, in
definition order), the second the buckets rebuilt in gradient-ready order, as after any start or
resume. Rank 0 writes, per mode (``allreduce`` and ``ordered``), whether the two gradients are
bitwise equal, and whether they equal the rank-ordered sum of the gathered local gradients
divided by the world size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)).to(device)


def _inputs(rank: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    scale = 10.0 ** torch.randint(-3, 4, (16, 1), generator=generator)  # magnitudes that make the order matter
    return (torch.randn(16, 32, generator=generator) * scale).to(device)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def _step(ddp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    ddp.zero_grad(set_to_none=False)
    ddp(x).pow(2).sum().backward()
    return _grads(ddp.module)


def _ordered_reduction():
    """``deepep_lightning/strategies/ordered_reduction.py`` loaded from its file: it needs only torch, and
    the package's ``__init__`` would import Lightning (seconds of start-up in each of the spawned ranks)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "deepep_lightning" / "strategies" / "ordered_reduction.py"
    spec = importlib.util.spec_from_file_location("ordered_reduction", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, port: int, out: str, backend: str, world_size: int) -> None:
    reduction = _ordered_reduction()
    ordered_mean_hook, ordered_sum = reduction.ordered_mean_hook, reduction.ordered_sum

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    x = _inputs(rank, device)
    local = _model(device)
    local(x).pow(2).sum().backward()
    gathered = [torch.empty_like(_grads(local)) for _ in range(world_size)]
    dist.all_gather(gathered, _grads(local))
    expected = ordered_sum(torch.stack(gathered)).div_(world_size)
    result = {}
    for mode in ("allreduce", "ordered"):
        # small buckets: the rebuilt layout (two buckets, reversed order) differs from the initial one
        ddp = torch.nn.parallel.DistributedDataParallel(_model(device), bucket_cap_mb=0.004)
        if mode == "ordered":
            ddp.register_comm_hook(None, ordered_mean_hook)
        first, second = _step(ddp, x), _step(ddp, x)
        result[mode] = {
            "restart_equal": bool(torch.equal(first, second)),
            "ordered_sum_equal": bool(torch.equal(first, expected)),
            "mean_close": bool(torch.allclose(first, expected, rtol=1e-5, atol=1e-6)),
        }
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import argparse
    import socket

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    port = os.environ.get("MASTER_PORT")  # the tests' launcher gives each child its own (conftest.free_port)
    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
    worker_args = (port, args.out, args.backend, args.world_size)
    torch.multiprocessing.spawn(_worker, args=worker_args, nprocs=args.world_size)


if __name__ == "__main__":
    main()
