"""Capture and restore every global random state as ``torch.load(weights_only=True)``-safe values.

What is captured: the torch CPU generator, the generator of every CUDA device (only when CUDA is
already initialised: asking for it would otherwise create a CUDA context), numpy's legacy global
``RandomState``, Python's ``random`` module, and any extra ``torch.Generator`` handed in by name.
Everything is stored as tensors, ints, floats, strings or ``None``, so a checkpoint holding it loads
under ``weights_only=True``. Lightning's own ``_collect_rng_states`` keeps numpy's and Python's
states as tuples holding numpy arrays, which ``weights_only=True`` refuses.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from deepep_lightning import _lightning_compat
from deepep_lightning.determinism.streams import derive_seed

__all__ = [
    "capture_rng_state",
    "default_generator_is_unseeded",
    "restore_rng_state",
    "unseeded_draws_before_first_seed",
    "seed_everything_from",
    "fork_global_rng",
]

_NUMPY_SEED_MASK = 2**32 - 1

# torch seeds its default CPU generator from the OS at startup with a 53-bit random value; a seed a
# person or a library sets (``seed_everything``: 32 bits; ``configure``: a different derived value) replaces it.
_SEED_AT_IMPORT = torch.initial_seed()
_STATE_AT_IMPORT = torch.get_rng_state()
_LARGEST_USER_SEED = 2**32 - 1
# The plugin's own seeding (a DDP strategy seeds every rank before any callback's setup) replaces the
# start-up seed, which would hide that the model drew its weights before: remember it until someone else
# seeds (their seed is then what the generator's numbers come from).
_last_plugin_seed: int | None = None
_plugin_seeded_over_unseeded_draws = False


def _numpy_state() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # uint32 values fit into int64
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(state: Mapping[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (state["kind"], keys, int(state["position"]), int(state["has_gauss"]), float(state["cached_gaussian"]))
    )


def _python_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next}


def _set_python_state(state: Mapping[str, Any]) -> None:
    internal = tuple(int(v) for v in state["internal"].tolist())
    random.setstate((int(state["version"]), internal, state["gauss_next"]))


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Snapshot the global RNGs (and ``generators``) as plain, ``weights_only``-loadable values.

    Args:
        generators: extra named generators to include (e.g. the plugin's own streams).

    Example::

        state = capture_rng_state()
        torch.rand(3)
        restore_rng_state(state)  # the next torch.rand(3) repeats
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": _python_state(),
        "cuda": [],
        "generators": {},
    }
    # Never create a CUDA context just to read its RNG: configure() must be able to run first.
    if torch.cuda.is_initialized():  # implies a device, and is cheaper to ask than is_available
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    for name, generator in (generators or {}).items():
        state["generators"][str(name)] = {"device": str(generator.device), "state": generator.get_state()}
    return state


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> list[str]:
    """Restore a snapshot made by :func:`capture_rng_state`; returns what could not be restored.

    A CUDA snapshot is restored only when the number of visible devices matches; named generators
    missing on either side are reported, never guessed.

    Raises:
        KeyError: ``state`` lacks the ``"torch"`` entry (not a snapshot).
    """
    skipped: list[str] = []
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    if "python" in state:
        _set_python_state(state["python"])
    cuda_states = list(state.get("cuda", []))
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            skipped.append(f"cuda ({len(cuda_states)} saved device states, {count} visible devices)")
    saved = dict(state.get("generators", {}))
    for name, generator in (generators or {}).items():
        if name in saved:
            generator.set_state(saved.pop(name)["state"])
        else:
            skipped.append(f"generator {name!r} (not in the snapshot)")
    skipped.extend(f"generator {name!r} (not registered now)" for name in saved)
    return skipped


def default_generator_is_unseeded() -> bool:
    """True when torch's default CPU generator has drawn numbers but nobody has seeded it in this process.

    Weights a model initialised from such a generator differ in every fresh process. The test: the
    generator's ``initial_seed()`` is still the one torch chose from the OS at startup (seen when this
    module was imported; a value above 32 bits, which ``seed_everything`` never sets), and its state
    has moved since. A generator seeded before ``deepep_lightning`` was imported, or one that drew
    nothing, counts as seeded.

    Example::

        import deepep_lightning
        torch.nn.Linear(4, 4)          # drawn from the unseeded generator
        default_generator_is_unseeded()  # True; after torch.manual_seed(0): False
    """
    if _SEED_AT_IMPORT <= _LARGEST_USER_SEED or torch.initial_seed() != _SEED_AT_IMPORT:
        return False
    return not torch.equal(torch.get_rng_state(), _STATE_AT_IMPORT)


@functools.cache
def _only_cpu_and_cuda() -> bool:
    """True when torch.manual_seed would seed nothing but the CPU and CUDA generators (fixed per process)."""
    others = (
        torch.xpu.is_available(),
        hasattr(torch, "mtia") and torch.mtia.is_available(),
        torch.backends.mps.is_available(),
        hasattr(torch, _lightning_compat.privateuse1_backend_name()),
    )
    return not any(others)


def _note_plugin_seed(derived: int) -> None:
    global _last_plugin_seed, _plugin_seeded_over_unseeded_draws
    if default_generator_is_unseeded():
        _plugin_seeded_over_unseeded_draws = True
    elif _last_plugin_seed is None or torch.initial_seed() != _last_plugin_seed:
        _plugin_seeded_over_unseeded_draws = False  # seeded by someone else since
    _last_plugin_seed = derived


def unseeded_draws_before_first_seed() -> bool:
    """True when torch's default generator drew numbers before anyone seeded it in this process.

    :func:`default_generator_is_unseeded`, and also when the first seed came from the plugin itself
    (:func:`seed_everything_from`, e.g. ``DeterministicDDPStrategy`` seeding each rank before the callbacks'
    ``setup``) over a generator that had already drawn: that seed cannot have made the model's weights. A
    seed set by anyone else afterwards (``seed_everything``) ends it.

    Example::

        torch.nn.Linear(4, 4)                # drawn from the unseeded generator
        seed_everything_from(0, "rank", 0)   # the plugin's own seeding hides it from the start-up check
        unseeded_draws_before_first_seed()   # True
    """
    if default_generator_is_unseeded():
        return True
    return _plugin_seeded_over_unseeded_draws and torch.initial_seed() == _last_plugin_seed


def seed_everything_from(seed: int, *keys: int | str) -> int:
    """Seed torch (CPU and every CUDA device), numpy and ``random`` from ``derive_seed(seed, *keys)``.

    Returns the derived seed. CUDA is seeded lazily before it starts (as ``torch.manual_seed``
    does), so this is safe before CUDA starts.

    Called every training step (DeterminismCallback, DeterministicDDPStrategy), so it avoids
    ``torch.manual_seed`` where it can: for a device type that is not initialised (XPU and MTIA on
    a CUDA machine, CUDA in a CPU run) ``torch.manual_seed`` queues the seed and records
    ``traceback.format_stack()`` with it, which costs host time on every call under Lightning's
    deep call stacks, for generators that never produce a number. With only CPU and CUDA present the same states are
    set directly; otherwise ``torch.manual_seed`` runs (``tests/determinism/test_rng.py`` checks
    both paths give equal states).
    """
    derived = derive_seed(seed, *keys)
    _note_plugin_seed(derived)
    if _only_cpu_and_cuda():
        torch.default_generator.manual_seed(derived)
        if torch.cuda.is_initialized():
            for generator in torch.cuda.default_generators:
                generator.manual_seed(derived)
        elif torch.cuda.is_available() and not _lightning_compat.cuda_in_bad_fork():
            torch.cuda.manual_seed_all(derived)  # queued until CUDA starts, as torch.manual_seed does
    else:
        torch.manual_seed(derived)
    np.random.seed(derived & _NUMPY_SEED_MASK)
    random.seed(derived)
    return derived


class fork_global_rng:  # noqa: N801 - used like torch.random.fork_rng
    """Context manager: run a block with its own global RNG state and put the outer one back.

    Unlike ``torch.random.fork_rng`` it also covers numpy and ``random``, and leaves CUDA alone when
    CUDA has not started (a fork must never be the thing that creates the context). It keeps the states
    as the libraries return them (no conversion to checkpoint values, :func:`capture_rng_state`'s job):
    the data loader forks once per batch in the main process.
    """

    def __init__(self) -> None:
        self._saved: tuple[torch.Tensor, Any, Any, list[torch.Tensor] | None] | None = None

    def __enter__(self) -> "fork_global_rng":
        # is_initialized implies a device; it never starts CUDA, unlike reading a generator's state.
        cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
        self._saved = (torch.get_rng_state(), np.random.get_state(), random.getstate(), cuda)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        assert self._saved is not None
        torch_state, numpy_state, python_state, cuda = self._saved
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        if cuda is not None:  # CUDA started inside the block: nothing to put back for it
            torch.cuda.set_rng_state_all(cuda)
        self._saved = None
