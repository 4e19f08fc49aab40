"""Test helper: one ``fit`` in world-size-invariant mode with a checkpoint at every epoch's end, in a fresh process.

Usage (from the tests)::

    python _epoch_end_resume_run.py --out DIR --module tiny|deepep [--devices W] [--virtual K] [--resume CKPT]
        [--lightning-restart]

``DeterministicDDPStrategy(virtual_world_size=K)`` with ``accumulate_grad_batches = K / W`` on gloo,
``max_steps`` set (Lightning restarts the fit loop of a resumed iteration-based run). ``tiny`` is a
linear model on a shuffled 6-batch loader with noise from the per-micro-batch stream (3 optimizer
steps per epoch at ``K / W = 2``); ``deepep`` is the DeepEP agent of ``_deepep_virtual_run.py`` (4
optimizer steps per epoch). A callback writes ``DIR/epoch{e}.ckpt`` in ``on_train_epoch_end`` (every
rank). Every rank writes ``DIR/rank{r}.json`` (``micro``: ``[epoch, batch_idx, global step, loss]`` of
every training step, the loss as ``float.hex``) and ``DIR/weights_rank{r}.pt``.
``--lightning-restart`` (negative control) resumes as Lightning alone does: the strategy's epoch-end
correction (``_lightning_compat.finish_restored_epoch``) is switched off, for that fit only.

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


def _tiny_module():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x + torch.randn_like(x) * 0.1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            x = torch.randn(48, 3, generator=generator)
            dataset = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
            return torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)

    return Tiny()


def _deepep_module():
    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    sizes = {"num_envs": 4, "rollout_length": 6, "hidden_size": 8, "steps_per_epoch": 4}
    return DeepEPModule(**grouped(name="cartpole", seed=SEED, fused_value_head=False, **sizes))


def main(argv: list[str]) -> None:
    fit_in_one_process_group(argv, lambda arguments, index: _fit(arguments))


def _fit(argv: list[str]) -> None:
    """One fit with the arguments ``argv``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--module", choices=["tiny", "deepep"], required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--lightning-restart", action="store_true", help="negative control: no epoch-end correction")
    args = parser.parse_args(argv)

    import lightning.pytorch as pl

    from deepep_lightning import _lightning_compat
    from deepep_lightning.determinism import configure

    finish_restored_epoch = _lightning_compat.finish_restored_epoch
    if args.lightning_restart:
        _lightning_compat.finish_restored_epoch = lambda trainer: False

    micro: list = []

    class Trace(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            micro.append([trainer.current_epoch, batch_idx, trainer.global_step, float(loss).hex()])

        def on_train_epoch_end(self, trainer, pl_module):
            trainer.save_checkpoint(os.path.join(args.out, f"epoch{trainer.current_epoch}.ckpt"))  # every rank

    configure(SEED)
    model = _tiny_module() if args.module == "tiny" else _deepep_module()
    trainer = virtual_trainer(args.devices, args.virtual, args.max_steps, args.out, [Trace()])
    try:
        trainer.fit(model, ckpt_path=args.resume)
    finally:
        _lightning_compat.finish_restored_epoch = finish_restored_epoch
    record = {"rank": trainer.global_rank, "global_step": trainer.global_step, "micro": micro}
    write_rank_outputs(args.out, trainer.global_rank, record, model)


if __name__ == "__main__":
    main(sys.argv[1:])
