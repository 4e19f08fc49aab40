"""The NCCL profile of a bitwise-reproducible all-reduce, applied before ``init_process_group``.

The one definition of the profile: :class:`~deepep_lightning.strategies.DeterministicDDPStrategy`
applies it in ``setup_distributed`` and :func:`~deepep_lightning.configure` sets it with
``distributed=True`` (:data:`NCCL_DETERMINISTIC_ENV`, the default algorithm and protocol).

NCCL picks an algorithm (Ring, Tree, NVLS, CollNet, PAT) and a protocol (Simple, LL, LL128) per
call from the message size and the detected topology. Each choice sums the ranks' contributions in
its own order, so two runs agree bit for bit only if the same choice is made for every bucket:
that holds on the same topology with the same bucket sizes (``bucket_cap_mb``, PyTorch issue
30509: changing it changes the gradients' bits), but the tuner's thresholds move between NCCL
versions and with other variables. Pinning the pair removes the dependence on the tuner.

Choice and why:

* ``NCCL_ALGO=Ring``: every element is reduced along the ring in an order fixed by the rank
  order and the channel split; available on every topology and world size. Tree is deterministic
  too but its shape (and so the order) depends on the node layout; ``Tree`` is accepted.
* ``NCCL_PROTO=Simple``: the one protocol every algorithm supports; LL/LL128 change latency, not
  order, and are accepted as well (LL can be faster for small buckets: measure with
  ``benchmarks/bench_ddp.py``).
* ``NCCL_NVLS_ENABLE=0``: NVLink SHARP reduces inside the NVSwitch, whose order is not
  specified; CollNet likewise (never selected with ``NCCL_ALGO=Ring``). Multicast objects of
  symmetric memory and NVSHMEM are switched off for the same reason (and because machines without
  NVLink multicast support fail to create them).

Values the user exported are kept (an explicit choice wins) and recorded; a kept value that
re-enables a switch reduction is reported.
"""

from __future__ import annotations

import logging
import os
from typing import Literal, get_args

__all__ = [
    "ALLOWED_ALGORITHMS",
    "ALLOWED_PROTOCOLS",
    "NCCL_DETERMINISTIC_ENV",
    "NCCL_RECORDED_ENV",
    "NcclAlgorithm",
    "NcclProtocol",
    "apply_nccl_profile",
    "nccl_profile",
]

log = logging.getLogger(__name__)

#: Algorithms with an order fixed by the rank layout (no in-switch reduction).
NcclAlgorithm = Literal["Ring", "Tree"]
#: Protocols (all keep the reduction order of the algorithm).
NcclProtocol = Literal["Simple", "LL", "LL128"]
ALLOWED_ALGORITHMS: tuple[str, ...] = get_args(NcclAlgorithm)
ALLOWED_PROTOCOLS: tuple[str, ...] = get_args(NcclProtocol)
#: Variables recorded in the fingerprint (set or not).
NCCL_RECORDED_ENV = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)
_SWITCH_REDUCTIONS = ("nvls", "collnet")


def nccl_profile(algorithm: NcclAlgorithm = "Ring", protocol: NcclProtocol = "Simple") -> dict[str, str]:
    """The environment of the deterministic profile (see the module docstring for the choice)."""
    return {
        "NCCL_ALGO": algorithm,
        "NCCL_PROTO": protocol,
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_COLLNET_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }


#: The default profile (Ring, Simple), as :func:`~deepep_lightning.configure` sets it with ``distributed=True``.
NCCL_DETERMINISTIC_ENV = nccl_profile()


def apply_nccl_profile(
    algorithm: NcclAlgorithm = "Ring", protocol: NcclProtocol = "Simple"
) -> tuple[dict[str, str], list[str]]:
    """Set the profile in ``os.environ`` where unset; must run before the process group starts.

    Returns ``(recorded, problems)``: the value of every variable of :data:`NCCL_RECORDED_ENV`
    after the call (``"<unset>"`` when absent) and a description of each exported value that can
    break run-to-run equality (an in-switch reduction, or NVLS left on).
    """
    for name, value in nccl_profile(algorithm, protocol).items():
        os.environ.setdefault(name, value)
    problems = []
    algo = os.environ.get("NCCL_ALGO", "")
    if any(word in algo.lower() for word in _SWITCH_REDUCTIONS) or "," in algo or ";" in algo:
        problems.append(f"NCCL_ALGO={algo!r} lets NCCL choose per call or reduce in the switch")
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        problems.append(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')!r} (NVLink SHARP reduces in the switch)")
    if os.environ.get("NCCL_COLLNET_ENABLE") not in ("0", None):
        problems.append(f"NCCL_COLLNET_ENABLE={os.environ.get('NCCL_COLLNET_ENABLE')!r} (in-network reduction)")
    recorded = {name: os.environ.get(name, "<unset>") for name in NCCL_RECORDED_ENV}
    for problem in problems:
        log.warning("DeterministicDDPStrategy: %s; all-reduce results may differ run to run", problem)
    return recorded, problems
