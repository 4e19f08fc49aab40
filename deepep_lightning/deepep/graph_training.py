"""DeepEPModule's CUDA-graph training step (``cuda_graph=True``): the whole step as one graph replay.

The step (rollout, loss, backward, clipping, Adam step) is captured once by
:class:`~deepep_lightning.deepep.agent.graphed_step.GraphedTrainStep` and replayed every training step;
Lightning's optimizer hooks run around the replay so its step count stays right. A file of its own: it
is manual optimisation with its own rules (capturable Adam, re-capture on a changed learning rate, static
tensors a rollback restores in place), none of which the eager path has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning._lightning_compat import counted_optimizer_step
from deepep_lightning.deepep.agent.graphed_step import GraphedTrainStep
from deepep_lightning.deepep.lr_decay import decay_module_lrs

if TYPE_CHECKING:
    from deepep_lightning.deepep.module import DeepEPModule

__all__ = ["StandaloneStep", "graph_capture_key", "graph_static_tensors", "graphed_training_step", "whole_step"]


def graph_capture_key(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters: capturable Adam bakes the Python floats (lr, betas...) into the graph."""
    return [
        {k: v.data_ptr() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def graph_static_tensors(module: DeepEPModule, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a rollback restores and the graph reads in place: parameters, optimizer state, recurrent state."""
    params = list(module.parameters())
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return params + state + ([module._hidden] if module._hidden is not None else [])


def graphed_training_step(module: DeepEPModule) -> dict[str, torch.Tensor]:
    """One training step of ``module`` as a replay of its graph (captured at the first call), or eagerly inside
    :meth:`~deepep_lightning.deepep.module.DeepEPModule.uncaptured_steps`.

    Raises:
        MisconfigurationException: the module is not on a CUDA device (outside ``uncaptured_steps``).
    """
    lightning_optimizer = cast(LightningOptimizer, module.optimizers())  # one optimizer
    optimizer = lightning_optimizer.optimizer
    if not module._uncaptured and module.device.type != "cuda":
        raise MisconfigurationException(
            f"`DeepEPModule(cuda_graph=True)` needs a CUDA device, the module is on {module.device}"
            " (HINT: set cuda_graph: false for CPU runs)"
        )
    if module._graphed is None and not module._uncaptured:
        assert module._generator is not None
        # A changed learning rate (NaNRollbackCallback's lower_lr policy, a scheduler) re-captures the graph.
        module._graphed = GraphedTrainStep(
            lambda: module._whole_step(optimizer),
            module._generator,
            capture_key=lambda: module._graph_capture_key(optimizer),
            static_tensors=lambda: graph_static_tensors(module, optimizer),
        )
    # Lightning counts the optimizer step through its own bookkeeping; the step itself runs inside the graph.
    with counted_optimizer_step(lightning_optimizer):
        outputs = module._whole_step(optimizer) if module._uncaptured else cast(GraphedTrainStep, module._graphed)()
    return outputs


def whole_step(module: DeepEPModule, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Rollout, loss, backward, gradient norm, clipping and optimizer step: what the graph captures."""
    optimizer.zero_grad(set_to_none=True)
    rollout, terms = module._rollout_and_loss()
    terms.loss.backward()
    params = [p for p in module.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if module.hparams.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, module.hparams.max_grad_norm, foreach=True)
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


class StandaloneStep:
    """``module``'s whole training step outside a Trainer, as ``training_step`` runs it (benchmarks, tests).

    Each call applies the module's learning-rate decay for the step, seeds the rollout from ``(seed, rank,
    step)``, runs the module's :func:`whole_step` (rollout, loss, backward, clipping, optimizer step) — one
    CUDA-graph replay when the module has ``cuda_graph=True`` (re-captured when a learning rate changes),
    eagerly otherwise — and moves the module's rollout step on. ``optimizer`` must be capturable for the graph
    (``module.configure_optimizers()`` makes one).

    Attributes:
        graphed: the :class:`GraphedTrainStep` of the graph path (its ``captures`` count), None eagerly.

    Example::

        step = StandaloneStep(model, model.configure_optimizers())
        losses = [step()["loss"].clone() for _ in range(100)]
    """

    def __init__(self, module: DeepEPModule, optimizer: torch.optim.Optimizer) -> None:
        module._ensure_rollout_state()
        assert module._generator is not None
        self.module, self.optimizer = module, optimizer
        self.graphed: GraphedTrainStep | None = None
        if module.hparams.cuda_graph:
            self.graphed = GraphedTrainStep(
                lambda: module._whole_step(optimizer),
                module._generator,
                capture_key=lambda: graph_capture_key(optimizer),
            )

    def __call__(self) -> dict[str, torch.Tensor]:
        decay_module_lrs(self.module, self.module._rollout_step, self.optimizer)
        self.module._seed_rollout()
        outputs = self.graphed() if self.graphed is not None else self.module._whole_step(self.optimizer)
        self.module._rollout_step += 1
        return outputs
