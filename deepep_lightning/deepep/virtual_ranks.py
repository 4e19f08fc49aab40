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

This module also holds :class:`~deepep_lightning.deepep.module.DeepEPModule`'s virtual-rank path, as
functions of the module: building the virtual ranks' rollouts, pointing the rollout at one of them,
their training step and window end, and their rollout state in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep.envs import BatchedEnv, make_env
from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.strategies.ordered_reduction import ordered_sum

if TYPE_CHECKING:
    from deepep_lightning.deepep.module import DeepEPModule

__all__ = [
    "VirtualRollout",
    "check_virtual_support",
    "end_virtual_step",
    "ensure_virtual_rollouts",
    "gather_rows",
    "load_virtual_rollout_state",
    "ordered_mean",
    "select_virtual_rank",
    "virtual_layout",
    "virtual_rollout_state_dict",
    "virtual_training_step",
]


@dataclass
class VirtualRollout:
    """What one virtual rank carries from step to step."""

    rank: int
    env: BatchedEnv
    hidden: torch.Tensor
    generator: torch.Generator


def virtual_layout(strategy: Any) -> tuple[int, int] | None:
    """``(first virtual rank of this process, virtual ranks per process)``, or None without ``virtual_world_size``."""
    if getattr(strategy, "virtual_world_size", None) is None:
        return None
    return int(strategy.virtual_rank(0)), int(strategy.micro_batches_per_step)


def check_virtual_support(hparams: Any) -> None:
    """Refuse the options whose per-process state would follow the process count.

    Raises:
        MisconfigurationException: ``cuda_graph``, ``compile_step`` or ``target_entropy`` is set.
    """
    for name, value, why in (
        ("cuda_graph", hparams.cuda_graph, "the graph holds one rollout per step; virtual ranks accumulate several"),
        ("compile_step", hparams.compile_step, "the compiled timestep is bound to one set of environments"),
        (
            "target_entropy",
            hparams.target_entropy,
            "the adaptive coefficient would move once per virtual rank of a process",
        ),
    ):
        if value not in (None, False):
            raise MisconfigurationException(
                f"`DeepEPModule({name}={value!r})` is not supported with"
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


def ensure_virtual_rollouts(module: DeepEPModule, first: int, per_process: int) -> None:
    """One set of environments, recurrent state and generator per virtual rank of this process."""
    hp = module.hparams
    check_virtual_support(hp)
    for rank in range(first, first + per_process):
        generator = torch.Generator(device=module.device)
        generator.manual_seed(derive_seed(hp.seed, "env_init", rank))
        env = make_env(hp.env, hp.num_envs, module.device, **(hp.env_kwargs or {}))
        env.reset(generator)
        hidden = module.agent.initial_state(hp.num_envs, module.device)
        module._virtual.append(VirtualRollout(rank, env, hidden, generator))
    select_virtual_rank(module, 0)
    if module._pending_rollout_state is not None:
        state, module._pending_rollout_state = module._pending_rollout_state, None
        module.load_rollout_state_dict(state)


def select_virtual_rank(module: DeepEPModule, index: int) -> None:
    """Point the rollout at virtual rank ``index`` of this process (its env, recurrent state, generator)."""
    slot = module._virtual[index]
    module._env, module._hidden = slot.env, slot.hidden
    module._generator, module._virtual_rank = slot.generator, slot.rank


def load_virtual_rollout_state(module: DeepEPModule, state: dict[str, Any]) -> None:
    """Restore what :func:`virtual_rollout_state_dict` returned into this process's virtual ranks.

    Raises:
        ValueError: the state lacks one of this process's virtual ranks (another ``virtual_world_size``).
    """
    saved = state.get("virtual")
    ranks = [slot.rank for slot in module._virtual]
    if not module._virtual or saved is None or any(rank not in saved for rank in ranks):
        raise ValueError(
            f"DeepEPModule: the rollout state holds virtual ranks {sorted(saved) if saved else None!r}, this"
            f" process trains virtual ranks {ranks!r}. HINT: resume with the virtual_world_size of the checkpoint"
        )
    for slot in module._virtual:
        slot.env.load_state_dict({k: v.to(module.device) for k, v in saved[slot.rank]["env"].items()})
        slot.hidden.copy_(saved[slot.rank]["hidden"])
    module._rollout_step = int(state["rollout_step"])


def virtual_training_step(module: DeepEPModule, batch_idx: int, writes_logs: bool) -> torch.Tensor:
    """The rollout and loss of one virtual rank: micro-batch ``batch_idx % (K / W)`` of the optimizer step."""
    index = batch_idx % len(module._virtual)
    select_virtual_rank(module, index)
    module._seed_rollout()
    rollout, terms = module._rollout_and_loss(first_of_step=index == 0)
    module.last_rollout = rollout
    scalars = torch.stack([terms.loss, terms.policy_loss, terms.value_loss, terms.entropy]).detach().float()
    module._virtual_window.append((scalars, rollout.episode_returns.detach().float(), rollout.dones.float()))
    # epoch mean, summed over processes by the metric: exact in any order while returns are integers (CartPole)
    module.episode_return.update(rollout.episode_returns.sum(), rollout.dones.sum())
    module.log("train/episode_return", module.episode_return, on_step=False, on_epoch=True)
    if index == len(module._virtual) - 1:
        end_virtual_step(module, writes_logs)
    return terms.loss


def end_virtual_step(module: DeepEPModule, writes_logs: bool) -> None:
    """Gather the window's K virtual ranks rank-major; log their ordered means, add their episodes in order."""
    window, module._virtual_window = module._virtual_window, []
    scalars, returns, dones = (gather_rows(torch.stack(column)) for column in zip(*window, strict=True))
    for episode_returns, done in zip(returns, dones, strict=True):
        module.episode_return_100.update(episode_returns, done > 0)
    means = ordered_mean(scalars)
    module._rollout_step += 1
    for position, name in enumerate(("loss", "policy_loss", "value_loss", "entropy")):
        module.log(f"train/{name}", means[position].clone(), on_step=True, on_epoch=False)
    module.log("train/episode_return_100", module.episode_return_100.compute(), on_step=True, on_epoch=False)
    if writes_logs:
        module._log_progress(means[0])


def virtual_rollout_state_dict(module: DeepEPModule) -> dict[str, Any]:
    """The rollout state keyed by virtual rank: the entries of a process are its virtual ranks'."""
    virtual = {
        slot.rank: {
            "env": {k: v.cpu() for k, v in slot.env.state_dict().items()},
            "hidden": slot.hidden.detach().cpu().clone(),
        }
        for slot in module._virtual
    }
    return {"virtual": virtual, "rollout_step": module._rollout_step}
