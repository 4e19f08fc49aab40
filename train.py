"""Train DeepEP with Lightning: ``python train.py fit --config configs/default.yaml``.

Every key of the YAML maps to a constructor argument (LightningCLI reads the signatures of
``DeepEPModule`` and ``Trainer``); an unknown key or a bad value stops here, before training.
``python train.py fit --help`` lists them all.

The optimizer is DeepEP's own (``configure_optimizers``: Adam with two learning rates,
``model.learning_rate`` for the critic and recurrent cell, ``model.policy_learning_rate`` for the
policy; ``model.optimizer: sgd`` for plain SGD), so LightningCLI's ``--optimizer``/``--lr_scheduler``
are not offered (``auto_configure_optimizers=False``) and are refused with that explanation.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from deepep_lightning import configure
from deepep_lightning.deepep import DeepEPModule


class DeepEPCLI(LightningCLI):
    """LightningCLI that configures determinism before anything is built.

    ``seed_everything`` also seeds DeepEP's environments and rollouts, and ``configure(seed)`` runs
    after parsing but before the model and Trainer exist, so the cuBLAS workspace, deterministic
    algorithms and seeds are in place before anything can create a CUDA context.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("seed_everything", "model.seed")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        seed = config.get("seed_everything")
        configure(int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 0)


_OPTIMIZER_FLAGS = ("--optimizer", "--lr_scheduler")


def refuse_optimizer_flags(args: Sequence[str]) -> None:
    """Exit with a clear message (status 2) on LightningCLI's ``--optimizer``/``--lr_scheduler`` flags."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _OPTIMIZER_FLAGS or flag.startswith(tuple(f"{f}." for f in _OPTIMIZER_FLAGS)):
            print(
                f"train.py: error: {arg!r}: DeepEPModule configures its own optimizer (Adam with two learning "
                "rates), which a LightningCLI optimizer would silently replace. HINT: --model.optim.learning_rate, "
                "--model.optim.policy_learning_rate, --model.optim.optimizer=sgd",
                file=sys.stderr,
            )
            raise SystemExit(2)


def main(args: list[str] | None = None) -> DeepEPCLI:
    refuse_optimizer_flags(sys.argv[1:] if args is None else args)
    return DeepEPCLI(
        DeepEPModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=args,
    )


if __name__ == "__main__":
    main()
