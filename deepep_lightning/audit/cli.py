"""``deepep-audit``: is this training reproducible bitwise here, and if not, which op breaks it?"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from deepep_lightning.audit.report import EXIT_COULD_NOT_RUN, AuditReport, LevelResult, Status

__all__ = ["main"]

#: The module whose import adds DeepEP's value head to the L1 catalogue, imported unless ``--extend`` names others.
DEEPEP_CATALOGUE = "deepep_lightning.deepep.kernels"

_DESCRIPTION = textwrap.dedent("""\
    Audit bitwise reproducibility at four levels (the verification pyramid):

      l1   one op N times on fixed random inputs (never zeros). Without --callable: the built-in
           catalogue (the known offenders: index_add_, scatter_add_, index_put_ accumulate,
           index_reduce, histc, median(dim), 4-D cross_entropy, ctc_loss, grid_sample / interpolate /
           pooling backward, embedding backward, cumsum, ...; DeepEP's value head and what --extend
           adds) as a table, with columns:
           default (PyTorch's defaults: verdict and time per call) | deterministic (PyTorch's own
           torch.use_deterministic_algorithms: yes, NO or raises, time as a ratio to default) | plugin
           (deterministic mode with deepep_lightning's kernels for refused ops, patch_refused_ops(True)
           as DeterminismCallback sets it: what the plugin buys, ratio to default) | launch_blocking
           (CUDA_LAUNCH_BLOCKING=1, in a subprocess: it does not fix atomics). On CUDA, deterministic
           and plugin each run in a fresh subprocess.
      l2   one training step of a LightningModule (DeepEP: one timestep), N repeats in-process.
      l3   a whole sequence (DeepEP: one rollout of T timesteps; another module: --steps optimizer
           steps), N repeats in-process.
      l4   --steps training steps twice in fresh processes (optionally killed and resumed), comparing
           final state_dicts/optimizer states and every logged scalar bitwise.

    L2/L3 protocol: the module is built once; before each repeat every RNG (torch CPU/CUDA, NumPy,
    Python) is restored and the module is deep-copied from the template, so repeats start from the
    same weights, state and batches; compared: the loss and every gradient (L3 generic: also each
    step's loss and the final parameters). On a difference the locator re-runs under a
    TorchDispatchMode that hashes every op's inputs and outputs (forward and backward, with the module
    path and a short stack) and reports the first divergent op: name, module, shapes, dtype, max
    |diff| and the likely cause (atomic accumulation, uninitialised memory, RNG, Python state, input
    from outside, unknown).

    Targets: DeepEP by default; any LightningModule with --target package.module:Class and an
    optional --config (a LightningCLI YAML such as configs/default.yaml, or a YAML of constructor
    kwargs). For l4, extra LightningCLI arguments (--model.x=..., --trainer.x=...) are passed on.
    Data: as Trainer.fit(model, datamodule=...) does, a LightningDataModule gives the batches when
    one is named: --data package.module:DataModule (init args from the config's data: section), or
    the data: section's class_path; otherwise the module's own train_dataloader().

    JSON: --json PATH writes the report as JSON to PATH and prints the text report; --json - prints
    the JSON on stdout instead (the same convention as deepep-compare).

    Exit code: 0 reproducible, 1 divergence found, 2 could not run.
    """)

_EPILOG = textwrap.dedent("""\
    examples:
      deepep-audit l1 --repeats 100                       # catalogue table on this machine
      deepep-audit l1 --ops index_add_,cumsum --columns default,deterministic
      deepep-audit l1 --ops cross_entropy_4d,ctc_loss,histc --columns default,deterministic,plugin
      deepep-audit l3 --config configs/default.yaml --repeats 10
      deepep-audit l3 --variant fused_atomic --device cuda        # DeepEP's atomic value head
      deepep-audit l2 --target mypkg.models:Net --config net.yaml --json -
      deepep-audit l3 --target mypkg.models:Net --data mypkg.data:ImageData --config cli.yaml --json report.json
      deepep-audit l4 --config configs/default.yaml --steps 6 --resume-at 3 --model.execution.fused_value_head=false
    """)


_DATA_HELP = (
    "package.module:DataModule whose train_dataloader() gives the batches (init args: the config's data:"
    " section; default: the data: section's class_path, else the module's loader)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepep-audit",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH ('-': stdout, no text)")
    common.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    sub = parser.add_subparsers(dest="level", required=True, metavar="{l1,l2,l3,l4}")

    l1 = sub.add_parser("l1", parents=[common], help="one op N times; the catalogue table")
    l1.add_argument("--ops", help="comma-separated catalogue names (default: all); see --list")
    l1.add_argument("--list", action="store_true", help="list the catalogue and exit")
    l1.add_argument(
        "--extend",
        action="append",
        metavar="MODULE",
        help=f"import MODULE first, which adds its ops to the catalogue; repeatable (default: {DEEPEP_CATALOGUE},"
        " DeepEP's value head)",
    )
    l1.add_argument("--callable", metavar="PKG.MOD:FN", help="audit FN() instead of the catalogue (bind fixed inputs)")
    l1.add_argument(
        "--columns",
        default="default,deterministic,plugin,launch_blocking",
        help="comma-separated subset of default,deterministic,plugin,launch_blocking (plugin: deterministic"
        " mode with patch_refused_ops(True))",
    )
    l1.add_argument("--repeats", type=int, default=100, help="calls per op (default 100)")
    l1.add_argument("--size", choices=("small", "large"), help="input size (default: large on CUDA, small on CPU)")
    l1.add_argument("--table-out", metavar="FILE", help="write the markdown table to FILE")

    for name, text in (("l2", "one training step / DeepEP timestep"), ("l3", "a whole sequence / DeepEP rollout")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("--target", help="package.module:Class (default: DeepEP)")
        p.add_argument("--config", help="LightningCLI YAML or YAML of constructor kwargs")
        p.add_argument("--data", metavar="PKG.MOD:CLASS", help=_DATA_HELP)
        p.add_argument("--repeats", type=int, default=10, help="in-process repeats (default 10)")
        p.add_argument("--steps", type=int, default=3, help="L3 of a generic module: optimizer steps (default 3)")
        p.add_argument(
            "--variant",
            "--value-head",
            dest="variant",
            help="one of the target's audit_variants(); DeepEP: reference (PyTorch value head), fused (the"
            " extension's op) or fused_atomic (its atomic backward)",
        )
        p.add_argument(
            "--deterministic",
            action="store_true",
            help="torch.use_deterministic_algorithms(True) via deepep_lightning.determinism.configure",
        )
        p.add_argument("--no-locate", action="store_true", help="skip the first-divergent-op locator")
        p.add_argument("--locate-attempts", type=int, default=4, help="logged re-runs before giving up (default 4)")

    l4 = sub.add_parser(
        "l4",
        parents=[common],
        help="two fresh training processes, compared",
        description="extra --model.*/--trainer.* arguments go to LightningCLI",
    )
    l4.add_argument("--target", help="package.module:Class (default: DeepEP)")
    l4.add_argument("--config", help="LightningCLI YAML (e.g. configs/default.yaml) or constructor kwargs YAML")
    l4.add_argument("--data", metavar="PKG.MOD:CLASS", help=_DATA_HELP)
    l4.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    l4.add_argument("--resume-at", type=int, help="SIGKILL run b after this step and resume it from last.ckpt")
    l4.add_argument(
        "--determinism", action="store_true", help="add DeterminismCallback to both runs (unless the config has one)"
    )
    l4.add_argument("--seed", type=int, default=0)
    l4.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    l4.add_argument("--timeout", type=float, default=600.0, help="seconds per process (default 600)")
    return parser


def _l1(args: argparse.Namespace) -> tuple[list[LevelResult], str | None]:
    from deepep_lightning.audit.catalogue import CATALOGUE
    from deepep_lightning.audit.level1 import audit_callable, audit_catalogue, format_catalogue_table
    from deepep_lightning.audit.targets import load_class

    if args.callable:
        return [
            audit_callable(load_class(args.callable), repeats=args.repeats, name=args.callable, locate_ops=True)
        ], None
    columns = [c for c in args.columns.split(",") if c]
    table = audit_catalogue(
        ops=args.ops.split(",") if args.ops else None,
        columns=columns,
        device=args.device,
        repeats=args.repeats,
        size=args.size,
    )
    markdown = format_catalogue_table(table)
    if args.table_out:
        with open(args.table_out, "w", encoding="utf-8") as handle:
            handle.write(markdown + "\n")
    results = []
    for name, cells in table["rows"].items():
        decided = [c for c in cells.values() if c.get("status") in ("reproducible", "divergent")]
        if all(c.get("status") == "n/a" for c in cells.values()):
            continue  # e.g. a CUDA-only op on CPU: in the table, not a verdict
        status = (
            Status.DIVERGENT
            if any(c["status"] == "divergent" for c in decided)
            else (Status.REPRODUCIBLE if decided else Status.ERROR)
        )
        worst: dict[str, Any] = max(decided, key=lambda c: c.get("distinct_results") or 0, default={})
        results.append(
            LevelResult(
                "L1",
                f"{name} ({CATALOGUE[name].note})",
                status,
                repeats=args.repeats,
                distinct_results=worst.get("distinct_results", 0),
                max_abs_diff=worst.get("max_abs_diff"),
                error=None if decided else "; ".join(f"{k}: {c.get('error')}" for k, c in cells.items()),
                details={"cells": cells},
            )
        )
    return results, markdown


def _in_process(args: argparse.Namespace) -> list[LevelResult]:
    from deepep_lightning.audit.level2_3 import audit_module
    from deepep_lightning.audit.targets import ModuleTarget

    if args.deterministic:
        import torch

        from deepep_lightning.determinism import configure

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.use_deterministic_algorithms(True)  # too late for the cuBLAS setting; configure() would say so
        else:
            configure(0)
    target = ModuleTarget(
        args.target, args.config, device=args.device, steps=args.steps, variant=args.variant, data=args.data
    )
    return [
        audit_module(
            args.level.upper(),
            target,
            repeats=args.repeats,
            locate=not args.no_locate,
            locate_attempts=args.locate_attempts,
        )
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 reproducible, 1 divergent, 2 could not run)."""
    if os.getcwd() not in sys.path:  # as `python -m` does: --target may name a module of the working directory
        sys.path.insert(0, os.getcwd())
    parser = _parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extra and args.level != "l4":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.level == "l1":
        for module in args.extend or [DEEPEP_CATALOGUE]:
            try:
                importlib.import_module(module)
            except ImportError as error:
                print(f"deepep-audit: error: --extend {module!r}: cannot import it ({error})", file=sys.stderr)
                return EXIT_COULD_NOT_RUN
    if args.level == "l1" and args.list:
        from deepep_lightning.audit.catalogue import CATALOGUE

        print("\n".join(f"{name:32s} {entry.note}" for name, entry in CATALOGUE.items()))
        return 0
    markdown = None
    try:
        from deepep_lightning.audit.targets import DEEPEP_TARGET, audit_device, load_data, load_lightning_module_class

        if args.device is not None:
            audit_device(args.device)
        if args.level == "l4":
            load_lightning_module_class(args.target or DEEPEP_TARGET)
            load_data(args.data, args.config)  # a bad --data or data: section is refused before any process starts
        if args.level == "l1":
            results, markdown = _l1(args)
        elif args.level in ("l2", "l3"):
            results = _in_process(args)
        else:
            from deepep_lightning.audit.level4 import audit_training

            results = [
                audit_training(
                    args.target,
                    args.config,
                    steps=args.steps,
                    resume_at=args.resume_at,
                    determinism=args.determinism,
                    seed=args.seed,
                    extra_args=extra,
                    workdir=args.workdir,
                    timeout=args.timeout,
                    data=args.data,
                )
            ]
    except (ValueError, TypeError, OSError) as error:
        print(f"deepep-audit: error: {error}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    except Exception as error:  # the tool's own failure is "could not run" (2), never "divergent" (1)
        print(f"deepep-audit: error: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    report = AuditReport(results)
    if args.json and args.json != "-":
        try:
            with open(args.json, "w", encoding="utf-8") as handle:
                handle.write(report.to_json())
        except OSError as error:
            print(f"deepep-audit: error: --json {args.json!r}: {error}", file=sys.stderr)
            return EXIT_COULD_NOT_RUN
    if args.json == "-":
        print(report.to_json())
    elif markdown:  # the table already says it per op
        print(markdown)
        print(report.format_text().splitlines()[0])
    else:
        print(report.format_text())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
