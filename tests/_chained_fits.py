"""``--then``: one child process runs several fits in turn, so that the tests start fewer interpreters.

The fit scripts of the tests (``_run_fit.py``, ``_ddp_run.py``, ``_fsdp2_run.py``, ``_multinode_run.py``,
``_deepep_virtual_run.py``, ``_epoch_end_resume_run.py``) take ``A... --then B... --then C...``: each part is
one fit's arguments, parsed and fitted in turn in the same process (and process group), each from
``configure`` and a new Trainer.
"""

from __future__ import annotations

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
