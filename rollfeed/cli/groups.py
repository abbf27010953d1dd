"""``--group PATTERN``: which groups of a payload root ``inspect`` and ``verify`` cover.

A group is the directory of a payload file relative to the root (``step_000042`` for
``step_000042/w0.rfp``; ``.`` for a file at the root's top). Each pattern is a shell-style glob
matched against the whole group name, case-sensitive, ``*`` crossing ``/`` too (``step_0000*``,
``step_000042``); the option may be repeated, and a file is covered when its group matches any
pattern. No pattern covers every group. A pattern that matches no group of the root is a usage
error naming it and the groups there are (a typo never gives a quietly empty report).

Example (groups ``step_000001``, ``step_000002``, ``eval``)::

    GroupFilter(["step_*"]):   step_000001/w0.rfp -> True, eval/w0.rfp -> False
    GroupFilter(["step_*", "evl"]).check()  -> UsageError: --group evl matches no group ...
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fnmatch import fnmatchcase

from rollfeed.cli.errors import UsageError
from rollfeed.cli.report import shown


def group_of(path: str) -> str:
    """The group of a payload file path relative to the root (module doc)."""
    return os.path.dirname(path) or "."


class GroupFilter:
    """The patterns of ``--group`` as a predicate on paths (``select`` of
    :func:`~rollfeed.payload.scan.scan.scan_root`), remembering the groups it saw and the
    patterns that matched."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = list(patterns)
        self.seen: set[str] = set()
        self._matched: set[str] = set()

    def __call__(self, path: str) -> bool:
        group = group_of(path)
        self.seen.add(group)
        if not self.patterns:
            return True
        hits = {p for p in self.patterns if fnmatchcase(group, p)}
        self._matched |= hits
        return bool(hits)

    def check(self) -> None:
        """:class:`UsageError` naming each pattern that matched none of the groups seen."""
        missed = [p for p in self.patterns if p not in self._matched]
        if missed and self.seen:
            have = sorted(self.seen)
            listed = ", ".join(shown(g) for g in have[:8]) + (", ..." if len(have) > 8 else "")
            raise UsageError(
                f"--group {', '.join(shown(p) for p in missed)} matches no group of the root "
                f"(it has {len(have)}: {listed}); give a group name or a glob such as 'step_*'"
            )
