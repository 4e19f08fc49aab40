"""Where the time of a deform_conv2d backward goes: device time per call of each kernel, torchvision's atomic
backward against the routed deterministic one, at the DCNv2 shapes of ``bench_torchvision_ops.py``.

    PYTHONPATH=$PWD python benchmarks/profile_deform_conv2d.py --out deform_conv2d_profile.json

Per stage and backward: the kernels' names (cut to 90 characters) and milliseconds per call, the 14 longest,
from ``torch.profiler`` over 5 calls after 3 warm-up calls (deterministic mode off, as the benchmark runs both).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._timing import environment, write_json  # noqa: E402
from benchmarks.bench_torchvision_ops import DCN_STAGES, deform_conv2d_case  # noqa: E402

CALLS = 5


def kernel_ms(call) -> dict[str, float]:
    """Device milliseconds per call of the 14 longest kernels of ``call()``."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    rows = {event.key[:90]: round(event.device_time_total / CALLS / 1000, 4) for event in profiler.key_averages()}
    return dict(sorted(((k, v) for k, v in rows.items() if v > 0), key=lambda kv: -kv[1])[:14])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_deform_conv2d.py: needs a GPU")
    import torchvision  # noqa: F401 - registers torch.ops.torchvision

    from deepep_lightning.ops.deform_conv2d import deform_conv2d_backward

    torch.use_deterministic_algorithms(False)  # torchvision's atomic kernel runs only outside it
    profiles = {}
    for stage in DCN_STAGES:
        case = deform_conv2d_case(stage)
        profiles[f"{stage}_torchvision"] = kernel_ms(lambda c=case: torch.ops.torchvision._deform_conv2d_backward(*c))
        profiles[f"{stage}_deterministic"] = kernel_ms(lambda c=case: deform_conv2d_backward(*c))
        print(stage, json.dumps(profiles[f"{stage}_deterministic"], indent=1), flush=True)
    command = " ".join([sys.executable] + sys.argv)
    write_json(args.out, {"environment": environment(), "command": command, "ms": profiles})


if __name__ == "__main__":
    main()
