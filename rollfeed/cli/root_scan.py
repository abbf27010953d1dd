"""The scan behind ``inspect`` and ``verify`` of a payload root: the root checked, the groups
selected, progress shown while files are scanned.

:func:`scan_groups` raises :class:`~rollfeed.cli.errors.UsageError` (exit 2) for a path that does
not exist or is not a directory (a local root), a root holding no payload file (``*.rfp``), and a
``--group`` pattern matching no group (:mod:`rollfeed.cli.groups`); problems inside the root are
findings of the :class:`~rollfeed.payload.scan.scan.RootScan` it returns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rollfeed.cli.errors import UsageError
from rollfeed.cli.groups import GroupFilter
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import shown
from rollfeed.payload.scan.scan import SUFFIX, RootScan, scan_root
from rollfeed.payload.stores.store_url import is_store_url


def check_directory(path: str, what: str) -> None:
    """:class:`UsageError` unless ``path`` is a directory (``what``: what it should hold)."""
    if not os.path.isdir(path):
        state = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise UsageError(f"{shown(path)} {state}: give the {what} directory")


def scan_groups(
    root: str, *, checksums: bool, groups: Sequence[str], progress: Progress
) -> RootScan:
    """Scan the files of ``root`` (a directory, or ``s3://bucket/prefix``) whose group matches
    ``groups`` (all when empty)."""
    if not is_store_url(root):
        check_directory(root, "payload root")
    select = GroupFilter(groups)

    def tick(done: int, total: int, nbytes: int) -> None:
        progress.update(done, total, "files", f", {nbytes / 2**20:.1f} MiB")

    try:
        scan = scan_root(root, checksums=checksums, select=select, progress=tick)
    finally:
        progress.close()
    if not select.seen:
        raise UsageError(
            f"no payload files found under {shown(root)} (payload files end in {SUFFIX})"
        )
    select.check()
    return scan
