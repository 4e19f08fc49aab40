"""Train DeepEP with Lightning: ``python train.py fit --config configs/default.yaml``.

Every key of the YAML maps to a constructor argument (LightningCLI reads the signatures of
``DeepEPModule`` and ``Trainer``); an unknown key or a bad value stops here, before training.
``python train.py fit --help`` lists them all.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from deepep_lightning import DeepEPModule


class DeepEPCLI(LightningCLI):
    """LightningCLI whose ``seed_everything`` also seeds DeepEP's environments and rollouts."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("seed_everything", "model.seed")


def main(args: list[str] | None = None) -> DeepEPCLI:
    return DeepEPCLI(
        DeepEPModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
