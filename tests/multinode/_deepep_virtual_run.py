"""Test helper: one ``fit`` of a tiny DeepEP agent with ``DeterministicDDPStrategy`` (gloo, CPU), in a fresh process.

Usage (from the tests)::

    python _deepep_virtual_run.py --out DIR --devices W [--virtual K] [--max-steps S] [--save-at S] [--resume CKPT]

With ``--virtual K`` the strategy gets ``virtual_world_size=K`` and the trainer accumulates ``K / W``
micro-batches. Lightning's subprocess launcher re-runs this script for ranks >= 1. Every rank writes
``DIR/rank{r}.json``: ``micro`` (``[step, virtual rank, loss]`` of every training step call),
``logged`` (``[step, train/loss, train/episode_return_100, train/grad_norm]`` after every optimizer
step), ``final_metrics`` (every callback metric after ``fit``, the epoch's ``train/episode_return``
included), floats as ``float.hex``, the virtual ranks of its rollout state and the fingerprint; and
``DIR/weights_rank{r}.pt`` (its final ``state_dict``). ``--save-at S`` writes ``DIR/stepS.ckpt`` after
optimizer step ``S`` (all ranks take part: the strategy gathers every rank's rollout state).

``--then ARGS...`` (repeatable, the same ``--devices``) fits again with its own arguments in the same
processes and process group once the fit before it is done, from ``configure`` and a new Trainer.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _virtual_fit import virtual_trainer, write_rank_outputs  # noqa: E402

from tests._chained_fits import fit_in_one_process_group  # noqa: E402

torch.set_num_threads(1)

SEED = 4321
SIZES = {"num_envs": 4, "rollout_length": 6, "hidden_size": 8, "steps_per_epoch": 4}
LOGGED = ("train/loss", "train/episode_return_100", "train/grad_norm")  # read after every optimizer step


def _module():
    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    class TracedDeepEP(DeepEPModule):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.micro: list = []
            self.logged: list = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.micro.append([int(self.global_step), self.rollout_state.rank, float(loss.detach()).hex()])
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if (batch_idx + 1) % self.trainer.accumulate_grad_batches:
                return  # mid-window: no optimizer step yet
            metrics = self.trainer.callback_metrics
            self.logged.append([int(self.global_step)] + [float(metrics[name]).hex() for name in LOGGED])

    return TracedDeepEP(**grouped(name="cartpole", seed=SEED, fused_value_head=False, **SIZES))


def main(argv: list[str]) -> None:
    fit_in_one_process_group(argv, lambda arguments, index: _fit(arguments))


def _fit(argv: list[str]) -> None:
    """One fit with the arguments ``argv``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--virtual", type=int, default=None, help="virtual_world_size (default: off)")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=0, help="checkpoint after this optimizer step")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args(argv)

    import lightning.pytorch as pl

    from deepep_lightning.determinism import configure

    class SaveAtStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window_end = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
            if args.save_at and trainer.global_step == args.save_at and window_end:
                trainer.save_checkpoint(os.path.join(args.out, f"step{args.save_at}.ckpt"))  # every rank

    class ReadsEveryStep(pl.Callback):  # the module logs its loss terms at every step for a reader that says so
        def monitored_metrics(self) -> tuple[str, ...]:
            return LOGGED

    configure(SEED)
    model = _module()
    trainer = virtual_trainer(args.devices, args.virtual, args.max_steps, args.out, [SaveAtStep(), ReadsEveryStep()])
    trainer.fit(model, ckpt_path=args.resume)
    record = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "micro": model.micro,
        "logged": model.logged,
        "final_metrics": {name: float(value).hex() for name, value in sorted(trainer.callback_metrics.items())},
        "rollout_state_ranks": sorted(model.rollout_state_dict().get("virtual", {})),
        "fingerprint": trainer.strategy.fingerprint(),
    }
    write_rank_outputs(args.out, trainer.global_rank, record, model)


if __name__ == "__main__":
    main(sys.argv[1:])
