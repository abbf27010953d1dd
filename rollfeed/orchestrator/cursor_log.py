"""The cursor's log: records appended durably, one writer, read back whole after a crash.

Two forms of one log (records framed by :mod:`rollfeed.orchestrator.cursor_frames`), chosen by
where the step files live:

- a local directory: one append-only file ``<dir>/cursor/log.rfc``. An append writes one frame
  at the end and ``fsync``\\ s it (``fsync=False``: survives a killed process, not a machine
  crash). Opening it takes an exclusive ``flock`` (a second producer is refused with
  :class:`~rollfeed.orchestrator.errors.CursorInUseError`), reads it whole, and cuts a torn tail
  off (the frame an interrupted append left; logged at WARNING and counted in ``torn``) so the
  next append follows the last whole record;
- an object-store prefix (``s3://bucket/run/steps``): one object per record,
  ``cursor/<seq, 12 digits>.rfc``, each put once with a conditional PUT that fails when the name
  exists. A PUT is atomic, so there is no torn tail; two producers appending record ``n`` are
  fenced: the second one's PUT fails and it stops with ``CursorInUseError``.

Why a log and not a state file rewritten by temp + fsync + rename: a producer records every turn
that comes back (kilobytes each, thousands per step), and a log makes each one a single small
append instead of rewriting everything recorded so far; the checksummed frames make a crash in the
middle of an append detectable, so it costs at most the record being appended. The form fits an
object store too, where appending is impossible but a new object per record is natural.

Example::

    log = open_log("/run/steps")           # the lock is held until close()
    log.records                            # [b'{"kind": "begin", ...}', ...]
    log.append(b'{"kind": "turn", ...}')   # -> its number; durable when it returns
    log.close()
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Mapping
from typing import Protocol

from rollfeed.loaders.step_files import step_root
from rollfeed.orchestrator.cursor_frames import frame, one_record, scan
from rollfeed.orchestrator.errors import CursorCorruptError, CursorInUseError, CursorWriteError
from rollfeed.payload import PayloadError, is_store_url

logger = logging.getLogger(__name__)
FOLDER = "cursor"
LOG_NAME = "log.rfc"
_OBJECT = re.compile(r"^(\d{12})\.rfc$")


class CursorLog(Protocol):
    """An open log: its ``records`` (payloads, in order), ``torn`` (bytes of a torn tail cut off
    at open) and ``where`` (its path or URL)."""

    records: list[bytes]
    torn: int
    where: str

    def append(self, payload: bytes) -> int: ...
    def close(self) -> None: ...


class LocalLog:
    """The log file of a local step directory (see the module doc)."""

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = True) -> None:
        folder = os.path.join(os.fspath(directory), FOLDER)
        self.where, self.fsync = os.path.join(folder, LOG_NAME), fsync
        os.makedirs(folder, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.where, flags, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise CursorInUseError(
                "another producer holds this cursor (its lock on the log): one step directory "
                "has one producer; stop the other one or give this one its own step directory",
                file=self.where,
            ) from None
        try:
            data = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
            found = scan(data, name=self.where)
            self.records, self.torn, self.end = found.payloads, found.torn, found.end
            if found.torn:
                logger.warning(
                    "cursor %s: cut off a torn tail of %d bytes after record %d (an append a "
                    "crash interrupted)",
                    self.where,
                    found.torn,
                    len(found.payloads) - 1,
                )
                os.ftruncate(self.fd, found.end)
                os.fsync(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def append(self, payload: bytes) -> int:
        """Append ``payload`` as the next record; its number, once durable."""
        seq = len(self.records)
        data = frame(seq, payload)
        try:
            view, at = memoryview(data), self.end
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
            if self.fsync:
                os.fsync(self.fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.end)
            raise CursorWriteError(
                f"appending cursor record {seq} failed ({err}); the log ends at its last whole "
                "record: free space and start the producer again",
                file=self.where,
                record=seq,
            ) from None
        self.end += len(data)
        self.records.append(payload)
        return seq

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # lets the lock go
            self.fd = -1


class ObjectLog:
    """The records of an object-store step prefix, one object each (see the module doc)."""

    def __init__(
        self, directory: str, *, store: Mapping[str, object] | None = None, fsync: bool = True
    ) -> None:
        del fsync  # a PUT is durable when it returns
        self.root = step_root(directory, store)
        self.where, self.torn = self.root.store.where(FOLDER), 0
        names = [e.rel for e in self.root.store.names(FOLDER) if not e.folder]
        numbered = sorted(
            (int(m.group(1)), rel) for rel in names if (m := _OBJECT.match(rel.rsplit("/", 1)[-1]))
        )
        self.records = []
        for seq, (got, rel) in enumerate(numbered):
            if got != seq:
                raise CursorCorruptError(
                    f"cursor records jump from {seq - 1} to {got}: records are put one after "
                    "another, so some were deleted",
                    file=self.root.store.where(rel),
                    record=seq,
                )
            f = self.root.store.open_file(rel)
            try:
                data = f.read(0, f.size)
            finally:
                f.close()
            self.records.append(one_record(data, seq=seq, name=self.root.store.where(rel)))

    def append(self, payload: bytes) -> int:
        seq = len(self.records)
        rel = f"{FOLDER}/{seq:012d}.rfc"
        try:
            wrote = self.root.store.put_blob(rel, frame(seq, payload))
        except PayloadError as err:
            raise CursorWriteError(
                f"putting cursor record {seq} failed ({err.message}); start the producer again",
                file=self.root.store.where(rel),
                record=seq,
            ) from None
        if not wrote:
            raise CursorInUseError(
                f"cursor record {seq} was put by another writer first: another producer writes "
                "this step prefix; stop one of them",
                file=self.root.store.where(rel),
                record=seq,
            )
        self.records.append(payload)
        return seq

    def close(self) -> None:
        self.root.close()


def open_log(
    directory: str | os.PathLike[str],
    *,
    store: Mapping[str, object] | None = None,
    fsync: bool = True,
) -> CursorLog:
    """The cursor log of step directory ``directory`` (a local one or ``s3://``; ``store``: an
    object store's endpoint and credentials), opened for appending."""
    if is_store_url(os.fspath(directory)):
        return ObjectLog(os.fspath(directory), store=store, fsync=fsync)
    return LocalLog(directory, fsync=fsync)
