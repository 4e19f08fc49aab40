"""Where ``train.py fit``'s start-up goes: seconds from the process's launch to each phase and to its first steps.

    python benchmarks/fit_startup.py --out DIR [--config configs/gpu.yaml] [--runs 2] [--steps 30] [--label NAME] \
        [--pycache DIR] [--arg=--KEY=VALUE ...]
    # writes DIR/fit_startup_<label>.json

Each run is a fresh ``python -X importtime train.py fit --config C`` (``bench_fit.py``'s command line: seed 0,
the progress bar off, its logs under ``DIR``; ``--trainer.max_steps=--steps``) with :class:`StartupTimeline`
appended to the config's callbacks. The timeline records ``time.time()`` at each mark, minus the launcher's
``time.time()`` just before ``Popen`` (``FIT_STARTUP_LAUNCHED``):

- ``cli_parsed``: LightningCLI has parsed the config and builds the callbacks (``train.py``'s imports, the
  parser's construction and the parse are before it);
- ``setup``: the Trainer has run every callback's ``setup`` (the plugin's determinism settings and op routes);
- ``train_start``: the model is set up and the loop starts;
- ``step_1``, ``step_10``, ``step_<steps>``: after that many optimizer steps, the device synchronised (the
  first includes the CUDA-graph capture), and ``ms_per_step`` from ``step_10`` to the last;
- ``exited``: the process has ended (teardown and the interpreter's exit included).

Python's own ``-X importtime`` report gives the imports: ``imports_s`` sums the top-level imports,
``heaviest_top_level`` lists the heaviest of them and ``watched`` gives, for each ``WATCHED`` module, the
cumulative seconds of its heaviest import line (the package's own, or a submodule's where another program's
output cut that line). Where the interpreter cannot write its bytecode cache (read-only site-packages), every
run compiles every module it imports; ``--pycache DIR`` gives the runs a cache (``bench_fit.fit_environment``),
so that the first run compiles and writes it and the later runs import as an installed environment does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("torch", "torchmetrics", "transformers", "sklearn", "scipy", "torch._dynamo", "torchvision", "tensorboard",
           "jsonargparse", "lightning.pytorch", "deepep_lightning")  # fmt: skip
_IMPORTTIME = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)\s*$")


class StartupTimeline(pl.Callback):
    """Seconds since ``FIT_STARTUP_LAUNCHED`` at each start-up mark, written as JSON to ``FIT_STARTUP_OUT``."""

    def __init__(self) -> None:
        self.launched = float(os.environ["FIT_STARTUP_LAUNCHED"])
        self.path = Path(os.environ["FIT_STARTUP_OUT"])
        self.marks: dict[str, float] = {}
        self._mark("cli_parsed")

    def _mark(self, name: str, sync: bool = False) -> None:
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.marks[name] = round(time.time() - self.launched, 3)
        self.path.write_text(json.dumps(self.marks))  # each mark at once: a run that dies still says how far it got

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._mark("setup")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark("train_start")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step in (1, 10) or step == trainer.max_steps:
            self._mark(f"step_{step}", sync=True)


def read_importtime(text: str, top: int = 12) -> dict[str, Any]:
    """``-X importtime`` lines -> the total of the top-level imports, the ``top`` heaviest, the ``WATCHED`` ones."""
    top_level: dict[str, float] = {}
    watched: dict[str, float] = {}
    for line in text.splitlines():
        match = _IMPORTTIME.match(line)
        if match is None:
            continue
        cumulative_s = int(match.group(2)) / 1e6
        name = match.group(4)
        if len(match.group(3)) == 1:  # one space after the bar: imported by the program itself
            top_level[name] = top_level.get(name, 0.0) + cumulative_s
        families = [module for module in WATCHED if name == module or name.startswith(module + ".")]
        if families:  # a package's line can be cut by other output; its heaviest member bounds it below
            family = max(families, key=len)
            watched[family] = round(max(watched.get(family, 0.0), cumulative_s), 3)
    heaviest = sorted(top_level.items(), key=lambda item: -item[1])[:top]
    return {
        "imports_s": round(sum(top_level.values()), 3),
        "heaviest_top_level": {name: round(seconds, 3) for name, seconds in heaviest},
        "watched": watched,
    }


def startup_run(config: str, steps: int, extra: list[str], work: Path, pycache: str | None = None) -> dict[str, Any]:
    """One ``train.py fit`` process under ``-X importtime``: its marks, import report and return code."""
    marks_path, stderr_path = work / "marks.json", work / "stderr.txt"
    marks_path.unlink(missing_ok=True)
    from bench_fit import fit_command, fit_environment  # here: the child process imports this module for its callback

    timeline = [f"--trainer.max_steps={steps}", "--trainer.callbacks+=fit_startup.StartupTimeline", *extra]
    python, *fit = fit_command(config, 0, work, timeline)
    command = [python, "-X", "importtime", *fit]
    launched = time.time()
    env = {**fit_environment(pycache, ROOT / "benchmarks"), "FIT_STARTUP_LAUNCHED": repr(launched),
           "FIT_STARTUP_OUT": str(marks_path)}  # fmt: skip
    with open(stderr_path, "w") as stderr:
        returncode = subprocess.call(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    marks = json.loads(marks_path.read_text()) if marks_path.exists() else {}
    marks["exited"] = round(time.time() - launched, 3)
    last, ten = marks.get(f"step_{steps}"), marks.get("step_10")
    timed = last is not None and ten is not None and steps > 10
    ms_per_step = round((last - ten) * 1000 / (steps - 10), 3) if timed else None
    text = stderr_path.read_text(errors="replace")
    errors = [line for line in text.splitlines() if not line.startswith("import time:")]
    return {
        "returncode": returncode, "marks_s": marks, "ms_per_step": ms_per_step, **read_importtime(text),
        "output_tail": errors[-5:] if returncode else [],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpu.yaml"))
    parser.add_argument("--label", default=None, help="names the output file (default: the config's stem)")
    parser.add_argument("--runs", type=int, default=2, help="fresh processes, one after another")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (trainer.max_steps)")
    parser.add_argument("--pycache", default=None, help="Python's bytecode cache for the runs (a folder)")
    parser.add_argument("--arg", action="append", default=[], metavar="--KEY=VALUE", help="a train.py override")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs!r}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps!r}")
    for item in args.arg:
        if not item.startswith("--") or "=" not in item:
            parser.error(f"--arg: expected --KEY=VALUE (a train.py override), got {item!r}")
    from _timing import environment, write_json

    out = Path(args.out)
    label = args.label or Path(args.config).stem
    work = out / f"fit_startup_{label}"
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for index in range(args.runs):
        runs.append(startup_run(args.config, args.steps, args.arg, work, args.pycache))
        print(f"run {index}:", {key: runs[-1][key] for key in ("returncode", "marks_s", "ms_per_step", "imports_s")})
    write_json(out / f"fit_startup_{label}.json", {"environment": environment(), "args": vars(args), "runs": runs})
    return 1 if any(run["returncode"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
