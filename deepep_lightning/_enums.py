"""``StrEnum``: enum members that are their string values, so JSON files and event logs hold plain strings.

``enum.StrEnum`` from Python 3.11; the same behaviour on 3.10 (``str()`` and ``format()`` give the value).
"""

from __future__ import annotations

import enum
import sys

__all__ = ["StrEnum"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """A ``str`` whose value is one of the members' (``str(member) == member.value``)."""

        def __str__(self) -> str:
            return str(self.value)
