"""Test helper: write one checkpoint, then rewrite it forever, so a SIGKILL lands in the middle of a write.

Usage (from the tests)::

    python _write_loop.py PATH {atomic,plain}

``atomic`` writes through :class:`~deepep_lightning.AtomicCheckpointIO`, ``plain`` with ``torch.save``
straight to ``PATH`` (the negative control). After the first write ``PATH.ready`` holds its size in
bytes; every later write holds other values, so a file that mixes two writes cannot pass as either.
"""

from __future__ import annotations

import os
import sys

import torch

from deepep_lightning.checkpointing import AtomicCheckpointIO


def main(path: str, mode: str) -> None:
    io = AtomicCheckpointIO()
    version = 0
    while True:
        checkpoint = {"version": version, "weights": torch.full((8 * 2**20,), float(version))}  # 32 MiB
        if mode == "atomic":
            io.save_checkpoint(checkpoint, path)
        else:
            torch.save(checkpoint, path)
        if version == 0:
            with open(path + ".ready.tmp", "w") as handle:
                handle.write(str(os.path.getsize(path)))
            os.replace(path + ".ready.tmp", path + ".ready")
        version += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
