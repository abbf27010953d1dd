"""Progress of a long command on stderr: one line of counts, never on stdout.

Shown when stderr is a terminal (the line is rewritten in place, at most ten times a second)
or when asked for (``--progress``; on a pipe or a file a new line at most every two seconds),
never with ``--no-progress``. The last count is always written when the command ends, so a
forced progress ends with the totals.

Example (``verify`` of a root of 12,000 files, on a terminal)::

    verify: 5210/12000 files, 1843.2 MiB
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


class Progress:
    """Counts of ``what`` (``"verify"``, ``"steps"``) written to stderr (see module doc);
    ``show``: ``None`` for stderr-is-a-terminal, else as given."""

    def __init__(self, what: str, *, show: bool | None, stream: TextIO | None = None) -> None:
        self._stream = sys.stderr if stream is None else stream
        self._tty = self._stream.isatty()
        self.shown = self._tty if show is None else show
        self._what = what
        self._every_s = 0.1 if self._tty else 2.0
        self._last = -math.inf
        self._pending = ""  # the latest text, not written yet
        self._written = ""

    def update(self, done: int, total: int, unit: str, detail: str = "") -> None:
        """The count now: ``done`` of ``total`` ``unit`` (e.g. ``files``), then ``detail``."""
        if not self.shown:
            return
        self._pending = f"{self._what}: {done}/{total} {unit}{detail}"
        now = time.monotonic()
        if now - self._last >= self._every_s:
            self._last = now
            self._write()

    def close(self) -> None:
        """Write the last count (when it was not yet) and end the line."""
        if not self.shown or not (self._pending or self._written):
            return
        if self._pending:
            self._write()
        if self._tty:
            self._stream.write("\n")
        self._stream.flush()

    def _write(self) -> None:
        text, self._pending = self._pending, ""
        if self._tty:  # rewrite in place, blanking what a longer previous line left
            self._stream.write(f"\r{text}{' ' * max(len(self._written) - len(text), 0)}")
        else:
            self._stream.write(f"{text}\n")
        self._stream.flush()
        self._written = text
