"""Train DeepEP with Lightning: ``python train.py fit --config configs/default.yaml``.

Every key of the YAML maps to a constructor argument (LightningCLI reads the signatures of
``DeepEPModule`` and ``Trainer``); an unknown key or a bad value stops here, before training.
``python train.py fit --help`` lists them all.
"""

from __future__ import annotations

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


def main(args: list[str] | None = None) -> DeepEPCLI:
    return DeepEPCLI(
        DeepEPModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
