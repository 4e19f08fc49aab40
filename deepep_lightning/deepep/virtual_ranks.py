"""DeepEP's virtual ranks: the rollouts of ``K`` ranks on any number of processes dividing ``K``.

With ``DeterministicDDPStrategy(virtual_world_size=K)`` a process of ``W`` owns the virtual ranks
``rank * K/W ... (rank + 1) * K/W - 1``, each with its own environments, recurrent state and
generator (seeded from ``derive_seed(seed, "env_init", v)`` and ``derive_seed(seed, "rollout", v,
step)``). Training step ``s`` of the module is one micro-batch per virtual rank, in virtual-rank
order (``accumulate_grad_batches = K / W``); the strategy adds their gradients in virtual-rank order
(:mod:`~deepep_lightning.strategies.micro_batch_gradients`, or the ordered hook when ``W = K``).
At a window's last micro-batch the per-virtual-rank scalars and finished episodes of every process
are gathered rank-major, so every process logs the mean of the ``K`` virtual ranks summed in order
and feeds the rolling return the ``K`` rollouts in order: the same bits whatever ``W``.

Cost: ``K / W`` sets of environments and recurrent states per process (memory), ``K / W`` rollouts
per optimizer step (time: the global batch is ``K`` rollouts whatever ``W``), and one small gather
of the scalars and episode returns per optimizer step.

The process's virtual ranks are :class:`VirtualRollouts`: one
:class:`~deepep_lightning.deepep.rollout_state.RolloutState` per virtual rank, the one whose rollout runs now,
and the scalars of the optimizer step's micro-batches until its last one gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep.config import DeepEPConfig
from deepep_lightning.deepep.rollout_state import RolloutState
from deepep_lightning.strategies.ordered_reduction import ordered_sum

__all__ = ["VirtualRollouts", "check_virtual_support", "gather_rows", "ordered_mean", "virtual_layout"]


def virtual_layout(strategy: Any) -> tuple[int, int] | None:
    """``(first virtual rank of this process, virtual ranks per process)``, or None without ``virtual_world_size``."""
    if getattr(strategy, "virtual_world_size", None) is None:
        return None
    return int(strategy.virtual_rank(0)), int(strategy.micro_batches_per_step)


def check_virtual_support(config: DeepEPConfig) -> None:
    """Refuse the options whose per-process state would follow the process count.

    Raises:
        MisconfigurationException: ``cuda_graph``, ``compile_step`` or ``target_entropy`` is set.
    """
    run = config.execution
    for owner, name, value, why in (
        (
            "ExecutionConfig",
            "cuda_graph",
            run.cuda_graph,
            "the graph holds one rollout per step; virtual ranks accumulate several",
        ),
        (
            "ExecutionConfig",
            "compile_step",
            run.compile_step,
            "the compiled timestep is bound to one set of environments",
        ),
        (
            "LossConfig",
            "target_entropy",
            config.loss.target_entropy,
            "the adaptive coefficient would move once per virtual rank of a process",
        ),
    ):
        if value not in (None, False):
            raise MisconfigurationException(
                f"`{owner}({name}={value!r})` is not supported with"
                f" `DeterministicDDPStrategy(virtual_world_size=...)`: {why}. HINT: leave {name} at its default"
            )


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every process's ``rows`` stacked rank-major (row ``v`` is virtual rank ``v``); ``rows`` itself on one process."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    flat = rows.contiguous().reshape(-1)
    gathered = flat.new_empty(dist.get_world_size() * flat.numel())
    dist.all_gather_into_tensor(gathered, flat)
    return gathered.view(-1, *rows.shape[1:])


def ordered_mean(rows: torch.Tensor) -> torch.Tensor:
    """``(((rows[0] + rows[1]) + rows[2]) + ...) / len(rows)``: the same bits for the same rows, whatever ``W``."""
    return ordered_sum(rows).div_(rows.shape[0])


class VirtualRollouts:
    """This process's virtual ranks: a :class:`RolloutState` each, sharing one rollout step.

    Training step ``s`` runs micro-batch ``i`` on ``select(i)`` for ``i`` in ``0 .. K/W - 1``;
    :meth:`record` keeps each micro-batch's scalars and finished episodes, and :meth:`end_step` (after the
    last one) gathers the ``K`` virtual ranks' rows rank-major and moves every rank's step on.

    Args:
        states: one per virtual rank of this process, in virtual-rank order.

    Example::

        build_state = functools.partial(RolloutState.build, agent, "cartpole", 32, None, "cpu", 0)
        rollouts = VirtualRollouts.build(build_state, first=2, per_process=2)
        state = rollouts.select(1)  # virtual rank 3
    """

    def __init__(self, states: list[RolloutState]) -> None:
        if not states:
            raise ValueError("`VirtualRollouts(states=...)` must hold at least one RolloutState, got []")
        self.states = states
        self.active = states[0]
        self._window: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @classmethod
    def build(cls, build_state: Callable[[int], RolloutState], first: int, per_process: int) -> VirtualRollouts:
        """The virtual ranks ``first .. first + per_process - 1``, each built by ``build_state(virtual rank)``."""
        return cls([build_state(rank) for rank in range(first, first + per_process)])

    def __len__(self) -> int:
        return len(self.states)

    @property
    def ranks(self) -> list[int]:
        return [state.rank for state in self.states]

    @property
    def step(self) -> int:
        return self.active.step

    def select(self, index: int) -> RolloutState:
        """Make virtual rank ``index`` of this process the active one and return its state."""
        self.active = self.states[index]
        return self.active

    def record(self, scalars: torch.Tensor, episode_returns: torch.Tensor, dones: torch.Tensor) -> None:
        """Keep one micro-batch's scalars ``[S]``, episode returns and dones (``[T, B]`` each) for :meth:`end_step`."""
        self._window.append((scalars, episode_returns, dones))

    def end_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's recorded rows of all ``K`` virtual ranks, rank-major; every rank's step moves on.

        Returns:
            ``(scalars [K, S], episode_returns [K, T, B], dones [K, T, B])``.
        """
        window, self._window = self._window, []
        scalars, returns, dones = (gather_rows(torch.stack(column)) for column in zip(*window, strict=True))
        for state in self.states:
            state.step += 1
        return scalars, returns, dones

    def state_dict(self) -> dict[str, Any]:
        """The rollout state keyed by virtual rank: the entries of a process are its virtual ranks'."""
        virtual = {}
        for state in self.states:
            entry = state.state_dict()
            del entry["rollout_step"]
            virtual[state.rank] = entry
        return {"virtual": virtual, "rollout_step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned into this process's virtual ranks.

        Raises:
            ValueError: the state lacks one of this process's virtual ranks (another ``virtual_world_size``).
        """
        saved = state.get("virtual")
        if saved is None or any(rank not in saved for rank in self.ranks):
            raise ValueError(
                f"DeepEPModule: the rollout state holds virtual ranks {sorted(saved) if saved else None!r}, this"
                f" process trains virtual ranks {self.ranks!r}. HINT: resume with the virtual_world_size of the"
                " checkpoint"
            )
        for rollout in self.states:
            rollout.load_state_dict({**saved[rollout.rank], "rollout_step": state["rollout_step"]})


class ProcessRollouts:
    """The rollout states this process trains: one rank's :class:`RolloutState`, or its :class:`VirtualRollouts`.

    They are built once, on the module's device (:meth:`build`); a state loaded before that (a checkpoint
    restored before the fit starts) waits in :attr:`pending` and is restored by the build. :attr:`active` is the
    state of the (virtual) rank whose rollout runs now.

    Example::

        rollouts = ProcessRollouts()
        rollouts.load_state_dict(checkpoint_state)  # kept until the build
        state = rollouts.build(build_state, rank=0, virtual_ranks=None)
    """

    def __init__(self) -> None:
        self.active: RolloutState | None = None
        self.virtual: VirtualRollouts | None = None  # DeterministicDDPStrategy(virtual_world_size=K)
        self.pending: dict[str, Any] | None = None  # loaded before the build

    def build(
        self, build_state: Callable[..., RolloutState], rank: int, virtual_ranks: tuple[int, int] | None
    ) -> RolloutState:
        """Build the states with ``build_state(rank, saved=...)``, restoring a pending state; return the active one.

        Args:
            build_state: builds the state of a (virtual) rank.
            rank: this process's rank (without virtual ranks).
            virtual_ranks: ``(first virtual rank, virtual ranks per process)``, or None for one state of ``rank``.
        """
        pending, self.pending = self.pending, None
        if virtual_ranks is not None:
            self.virtual = VirtualRollouts.build(build_state, *virtual_ranks)
            self.active = self.virtual.select(0)
            if pending:
                self.virtual.load_state_dict(pending)
        else:
            self.active = build_state(rank, saved=pending)
        return self.active

    def select(self, index: int) -> RolloutState:
        """Make virtual rank ``index`` of this process the active one."""
        if self.virtual is None:
            raise RuntimeError("ProcessRollouts: no virtual ranks to select from")
        self.active = self.virtual.select(index)
        return self.active

    def state_dict(self) -> dict[str, Any]:
        """Environment states, recurrent state and the step counter (CPU tensors and ints); a pending state as is."""
        if self.active is None:
            return dict(self.pending) if self.pending else {}
        return self.virtual.state_dict() if self.virtual is not None else self.active.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, in place (graph-safe); before the build, keep it pending.

        Raises:
            ValueError: a state of virtual ranks for a process without them.
        """
        if not state:
            return
        if self.active is None:
            self.pending = state
        elif self.virtual is not None:
            self.virtual.load_state_dict(state)
        elif "virtual" in state:
            raise ValueError(
                f"DeepEPModule: the rollout state holds virtual ranks {sorted(state['virtual'])!r}, this process"
                " trains virtual ranks None. HINT: resume with the virtual_world_size of the checkpoint"
            )
        else:
            self.active.load_state_dict(state)
