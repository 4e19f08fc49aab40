"""DeepEP's CUDA-graph training step (``cuda_graph=True``): the whole step as one graph replay.

The step (rollout, loss, backward, clipping, Adam step) is captured once by
:class:`~deepep_lightning.deepep.agent.graphed_step.GraphedTrainStep` and replayed every training step;
Lightning's optimizer hooks run around the replay so its step count stays right. A file of its own: it
is manual optimisation with its own rules (capturable Adam, re-capture on a changed learning rate, static
tensors a rollback restores in place), none of which the eager path has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep.agent.graphed_step import GraphedTrainStep
from deepep_lightning.protocols import counted_optimizer_step

if TYPE_CHECKING:
    from deepep_lightning.deepep.module import DeepEPModule
    from deepep_lightning.deepep.rollout_state import RolloutState

__all__ = ["GraphTraining", "StandaloneStep", "graph_capture_key"]

#: One rollout and its loss terms, ``(rollout, terms)``: what :meth:`GraphTraining.whole_step` differentiates.
RolloutAndLoss = Callable[[], tuple[Any, Any]]


def graph_capture_key(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters: capturable Adam bakes the Python floats (lr, betas...) into the graph."""
    return [
        {k: v.data_ptr() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


class GraphTraining:
    """The whole training step (rollout, loss, backward, clipping, optimizer step), replayed as one CUDA graph.

    Args:
        rollout_and_loss: runs one rollout on ``state`` and returns ``(rollout, terms)``.
        parameters: the trained parameters (called at each step: their set may follow the optimizer).
        state: the rollout state the graph reads and writes in place (recurrent state, generator).
        max_grad_norm: clip the gradients' global norm inside the graph (None: no clipping).

    Attributes:
        graphed: the :class:`GraphedTrainStep`, captured at the first replayed :meth:`step`; None before.

    Example::

        graph = GraphTraining(module.rollout_and_loss, module.parameters, module.rollout_state, None)
        outputs = graph.step(lightning_optimizer)  # in a manually optimised training_step
    """

    def __init__(
        self,
        rollout_and_loss: RolloutAndLoss,
        parameters: Callable[[], Iterable[torch.nn.Parameter]],
        state: RolloutState,
        max_grad_norm: float | None,
    ) -> None:
        self.rollout_and_loss, self.parameters, self.state = rollout_and_loss, parameters, state
        self.max_grad_norm = max_grad_norm
        self.graphed: GraphedTrainStep | None = None

    @property
    def captures(self) -> int:
        """How many times the step was captured (0 before the first replay)."""
        return self.graphed.captures if self.graphed is not None else 0

    def static_tensors(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """What a rollback restores and the graph reads in place: parameters, optimizer state, recurrent state."""
        params = list(self.parameters())
        state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return [*params, *state, self.state.hidden]

    def whole_step(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Rollout, loss, backward, gradient norm, clipping and optimizer step: what the graph captures."""
        optimizer.zero_grad(set_to_none=True)
        rollout, terms = self.rollout_and_loss()
        terms.loss.backward()
        params = [p for p in self.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm, foreach=True)
        optimizer.step()
        return {
            "loss": terms.loss.detach(),
            "policy_loss": terms.policy_loss.detach(),
            "value_loss": terms.value_loss.detach(),
            "entropy": terms.entropy.detach(),
            "grad_norm": grad_norm,
            "episode_return_sum": rollout.episode_returns.sum(),
            "episodes": rollout.dones.sum(),
        }

    def step(self, lightning_optimizer: LightningOptimizer, uncaptured: bool = False) -> dict[str, torch.Tensor]:
        """One training step as a replay of the graph (captured at the first call), or eagerly when ``uncaptured``.

        Raises:
            MisconfigurationException: the rollout state is not on a CUDA device (unless ``uncaptured``).
        """
        optimizer = lightning_optimizer.optimizer
        if not uncaptured and self.state.device.type != "cuda":
            raise MisconfigurationException(
                f"`ExecutionConfig(cuda_graph=True)` needs a CUDA device, the module is on {self.state.device}"
                " (HINT: set cuda_graph: false for CPU runs)"
            )
        if self.graphed is None and not uncaptured:
            # A changed learning rate (NaNRollbackCallback's lower_lr policy, a scheduler) re-captures the graph.
            self.graphed = GraphedTrainStep(
                lambda: self.whole_step(optimizer),
                self.state.generator,
                capture_key=lambda: graph_capture_key(optimizer),
                static_tensors=lambda: self.static_tensors(optimizer),
            )
        # Lightning counts the optimizer step through its own bookkeeping; the step itself runs inside the graph.
        with counted_optimizer_step(lightning_optimizer):
            outputs = self.whole_step(optimizer) if uncaptured or self.graphed is None else self.graphed()
        return outputs


class StandaloneStep:
    """``module``'s whole training step outside a Trainer, as ``training_step`` runs it (benchmarks, tests).

    Each call seeds the module's active rollout state from ``(seed, rank, step)``, runs
    :meth:`GraphTraining.whole_step` (rollout, loss, backward, clipping, optimizer step) — one CUDA-graph replay
    when the module has ``cuda_graph=True`` (re-captured when a learning rate changes), eagerly otherwise —
    moves the rollout step on and steps
    the learning-rate scheduler, if any. The optimizer must be capturable for the graph
    (``module.configure_optimizers()`` makes one).

    Args:
        module: the module to train; its rollout state is built here.
        optimizers: an optimizer of the module's parameters, or what ``module.configure_optimizers()`` returns
            (an optimizer, or a dict with its ``"lr_scheduler"``, stepped after every step as Lightning steps a
            ``"step"``-interval scheduler).

    Attributes:
        optimizer: the optimizer.
        scheduler: the learning-rate scheduler, None without one.

        graphed: the :class:`GraphedTrainStep` of the graph path (its ``captures`` count), None eagerly.

    Example::

        step = StandaloneStep(model, model.configure_optimizers())
        losses = [step()["loss"].clone() for _ in range(100)]
    """

    def __init__(
        self,
        module: DeepEPModule,
        optimizers: torch.optim.Optimizer | dict[str, Any],
    ) -> None:
        module.ensure_rollout_state()
        configured: dict[str, Any] = optimizers if isinstance(optimizers, dict) else {"optimizer": optimizers}
        optimizer = configured["optimizer"]
        scheduler = configured["lr_scheduler"]["scheduler"] if "lr_scheduler" in configured else None
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        state, max_grad_norm = module.rollout_state, module.config.optim.max_grad_norm
        self.training = GraphTraining(module.rollout_and_loss, module.parameters, state, max_grad_norm)
        self.graphed: GraphedTrainStep | None = None
        if module.config.execution.cuda_graph:
            self.graphed = GraphedTrainStep(
                lambda: self.training.whole_step(optimizer),
                state.generator,
                capture_key=lambda: graph_capture_key(optimizer),
            )

    def __call__(self) -> dict[str, torch.Tensor]:
        state = self.module.rollout_state  # the active one: a test may select another virtual rank between calls
        state.seed_rollout(self.module.config.seed)
        outputs = self.graphed() if self.graphed is not None else self.training.whole_step(self.optimizer)
        state.step += 1
        if self.scheduler is not None:
            self.scheduler.step()
        return outputs
