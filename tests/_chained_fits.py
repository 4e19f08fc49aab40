"""``--then``: one child process runs several fits in turn, so that the tests start fewer interpreters.

The fit scripts of the tests (``_run_fit.py``, ``_ddp_run.py``, ``_fsdp2_run.py``, ``_multinode_run.py``,
``_deepep_virtual_run.py``, ``_epoch_end_resume_run.py``) take ``A... --then B... --then C...``: each part is
one fit's arguments, parsed and fitted in turn in the same process (and process group), each from
``configure`` and a new Trainer.
"""

from __future__ import annotations

import os
from collections.abc import Callable

THEN = "--then"


def chained_fits(argv: list[str]) -> list[list[str]]:
    """The argument lists of the fits that ``argv`` chains with :data:`THEN`, in order.

    Example::

        >>> chained_fits(["--out", "a", "--then", "--out", "b"])
        [['--out', 'a'], ['--out', 'b']]
    """
    fits: list[list[str]] = [[]]
    for token in argv:
        if token == THEN:
            fits.append([])
        else:
            fits[-1].append(token)
    return fits


def fit_in_one_process_group(argv: list[str], fit: Callable[[list[str], int], None]) -> None:
    """``fit(arguments, index)`` for each fit that ``argv`` chains, in turn, in the same ranks and process group.

    The first fit's Lightning launcher starts the other ranks with ``LOCAL_RANK`` set; setting it here too
    after that fit tells the next fits' launchers that the ranks are already running.
    """
    for index, arguments in enumerate(chained_fits(argv)):
        fit(arguments, index)
        os.environ.setdefault("LOCAL_RANK", "0")
