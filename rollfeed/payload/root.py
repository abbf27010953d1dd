"""The payload root: opens payload files safely and reads byte ranges from them.

A :class:`PayloadRoot` is a small picklable value (a path and a few settings). Open files and the
thread pool live in a per-process cache that is created lazily and dropped after ``fork``, so the
object can be handed to DataLoader workers and never carries file descriptors across processes.

Every open goes through :func:`~rollfeed.payload.stores.safe_open.open_beneath`: a handle cannot
leave the root through a symlink (not even one swapped in mid-read), and a FIFO or directory is
refused at once instead of blocking ``open``.

The descriptor cache is shared by threads. A read *leases* the files it needs
(:class:`~rollfeed.payload.stores.lease.Lease`, handed to the reader by :meth:`PayloadRoot.run`
under the root's retry policy): each lease holds a reference on a cache entry, and an entry evicted
meanwhile (beyond ``max_open``, by :meth:`PayloadRoot.close`, or replaced by a reopen) leaves the
cache at once but closes its descriptor only when the last lease lets go. No read ever uses a closed
(or reused) descriptor, and open descriptors stay at most ``max_open`` plus the files of reads in
flight.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rollfeed.payload.errors import (
    PayloadError,
    PayloadInputError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadStaleFileError,
    PayloadTruncatedError,
)
from rollfeed.payload.format.layout import FILE_HEADER, parse_file_header
from rollfeed.payload.stores.lease import Lease
from rollfeed.payload.stores.safe_open import open_beneath, open_parent_beneath

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_OUTPUT_BYTES = 1 << 30  # the default bound on one field's values in one read


class _Entry:
    """One open payload file: descriptor, size (refreshed on demand), and its file header."""

    __slots__ = ("cached", "columns", "fd", "refs", "rel")

    def __init__(self, rel: str, fd: int, size: int, version: int, file_id: int, header_size: int):
        self.rel, self.fd, self.refs, self.cached = rel, fd, 0, True
        self.columns = (size, version, file_id, header_size)  # as Lease columns want them

    @property
    def size(self) -> int:
        return self.columns[0]

    def grow(self, size: int) -> None:
        if size > self.columns[0]:
            self.columns = (size, *self.columns[1:])


class _ProcessState:
    """Open files and the pool of one process; never pickled. ``lock`` guards ``files``, every
    entry's ``refs``/``cached`` and ``pool``."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.files: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.pool: ThreadPoolExecutor | None = None

    def drop(self, entry: _Entry) -> None:
        """Take ``entry`` out of the cache; its fd closes when no lease holds it. The caller
        holds ``lock``."""
        if not entry.cached:
            return
        entry.cached = False
        if self.files.get(entry.rel) is entry:
            del self.files[entry.rel]
        if entry.refs == 0:
            os.close(entry.fd)

    def release(self, entries: Sequence[_Entry]) -> None:
        with self.lock:
            for e in entries:
                e.refs -= 1
                if e.refs == 0 and not e.cached:
                    os.close(e.fd)

    def close(self) -> None:
        with self.lock:
            for entry in list(self.files.values()):
                self.drop(entry)
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False)


class PayloadRoot:
    """A directory of payload files, and how to read them.

    ``PayloadRoot("s3://bucket/prefix", ...)`` is an object-store root instead
    (:class:`~rollfeed.payload.stores.object_root.ObjectRoot`, its arguments there).

    ``retries`` / ``backoff_s``: a missing file, or a file shorter than a record needs, is reopened
    and retried with exponential backoff (shared filesystems can lag), then raises naming file,
    offset and the file's real size. A file replaced under its name (its file id differs from the
    record's) is reopened once, then raises :class:`PayloadStaleFileError`.
    ``verify_checksums``: every read also checks the CRC-32C of each block it reads (the whole
    blocks around its window, :mod:`rollfeed.payload.format.checksum`), raising
    :class:`~rollfeed.payload.errors.PayloadChecksumError` on a mismatch. It reads up to one block
    more at each end of a window and costs the checksum pass (``python -m rollfeed.bench payload``
    prints it); files of format version 1, which keep no checksums, are refused.
    ``max_open``: descriptors kept open between reads (least recently used ones close first).
    ``threads``: reads of different files run concurrently once a read touches at least
    ``parallel_min_bytes``. From the page cache on 2 cores, a 6 MiB window over 64 files took
    0.7 ms inline and 1.1-2.6 ms on 2-4 threads, so the default only goes parallel for large
    reads; on a network filesystem, where each read waits on latency, set it to 0.
    ``max_output_bytes``: the most bytes one field's values may take in one read (default
    1 GiB): a fixed field's ``[n, *shape]``, a ragged field's padded ``[n, W]`` (``W`` the widest
    row of its records, or ``width``). A read past it raises
    :class:`~rollfeed.payload.errors.PayloadOutputBoundError` before that output is allocated:
    a few MiB of one file can claim tens of GiB (one row of a million kept ids read over a
    16,384-row window is 61 GiB padded). A ragged form of the output would count its ids and
    row offsets against the same bound.
    """

    def __new__(cls, path: str | os.PathLike[str] | None = None, *args: object, **kwargs: object):
        # "s3://bucket/prefix" is an object-store root: the same seam, read by ranged GETs
        if cls is PayloadRoot and isinstance(path, str) and path.startswith("s3://"):
            from rollfeed.payload.stores.object_root import ObjectRoot

            return super().__new__(ObjectRoot)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_open: int = 256,
        retries: int = 3,
        backoff_s: float = 0.02,
        threads: int = 4,
        parallel_min_bytes: int = 64 << 20,
        verify_checksums: bool = False,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        if max_open < 1 or retries < 0:
            raise PayloadInputError(
                f"PayloadRoot needs max_open >= 1 and retries >= 0, got {max_open}, {retries}"
            )
        self.max_output_bytes = output_bound(max_output_bytes)
        self.path = os.path.abspath(os.fspath(path))
        self.max_open, self.retries, self.backoff_s = max_open, retries, backoff_s
        self.threads, self.parallel_min_bytes = threads, parallel_min_bytes
        self.verify_checksums = bool(verify_checksums)
        self._state: _ProcessState | None = None

    def __getstate__(self) -> dict:
        state = {k: getattr(self, k) for k in ("path", "max_open", "retries", "backoff_s")}
        state.update(threads=self.threads, parallel_min_bytes=self.parallel_min_bytes)
        state.update(verify_checksums=self.verify_checksums)
        state.update(max_output_bytes=self.max_output_bytes)
        return state

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._state = None

    def __repr__(self) -> str:
        return f"PayloadRoot({self.path!r})"

    def __del__(self) -> None:
        state = getattr(self, "_state", None)
        if state is not None and state.pid == os.getpid():
            state.close()

    def close(self) -> None:
        """Close this process's cached files (reads in flight keep theirs until they finish;
        files reopen lazily on the next read)."""
        if self._state is not None and self._state.pid == os.getpid():
            self._state.close()

    def _proc(self) -> _ProcessState:
        state = self._state
        if state is None or state.pid != os.getpid():
            state = self._state = _ProcessState()  # after fork: the parent's fds are not ours
        return state

    def _open(self, rel: str) -> _Entry:
        """A fresh, uncached entry for ``rel``, after the bounded retry for a missing file."""
        for attempt in range(self.retries + 1):
            try:
                fd = open_beneath(self.path, rel)
                break
            except PayloadMissingFileError as err:
                if attempt == self.retries:
                    raise PayloadMissingFileError(
                        f"{err.message} (after {self.retries} retries)", file=rel
                    ) from None
                time.sleep(self.backoff_s * 2**attempt)
        try:
            size = os.fstat(fd).st_size
            head = parse_file_header(os.pread(fd, FILE_HEADER.size, 0))
        except PayloadError as err:
            os.close(fd)
            raise err.with_place(file=rel) from None
        except OSError as err:
            os.close(fd)
            raise PayloadIOError(f"reading the file header: {err}", file=rel, offset=0) from None
        return _Entry(rel, fd, size, head.version, head.file_id or 0, head.size)

    def _acquire(self, files: Sequence[str]) -> list[_Entry]:
        """Entries for ``files`` (opened when not cached), each with one more reference."""
        proc = self._proc()
        with proc.lock:
            held = [proc.files.get(rel) for rel in files]
            # Recency only matters once evictions come near: below that, skip the bookkeeping.
            recent = len(proc.files) + len(files) > self.max_open
            for entry in held:
                if entry is not None:
                    entry.refs += 1
                    if recent:
                        proc.files.move_to_end(entry.rel)
        if None not in held:  # all cached: the common case
            return held  # type: ignore[return-value]
        try:
            for i, rel in enumerate(files):
                if held[i] is not None:
                    continue
                fresh = self._open(rel)  # outside the lock: opening may wait (missing-file retry)
                with proc.lock:
                    entry = proc.files.get(rel)
                    if entry is None:  # else another thread opened it meanwhile: use theirs
                        entry = proc.files[rel] = fresh
                    else:
                        os.close(fresh.fd)
                    entry.refs += 1
                    held[i] = entry
            if len(proc.files) > self.max_open:
                with proc.lock:
                    while len(proc.files) > self.max_open:
                        proc.drop(next(iter(proc.files.values())))
        except BaseException:
            proc.release([e for e in held if e is not None])
            raise
        return held  # type: ignore[return-value]

    def _replace(self, old: _Entry) -> _Entry:
        """A newly opened entry for ``old.rel`` in place of ``old`` (which the caller releases)."""
        fresh = self._open(old.rel)
        proc = self._proc()
        with proc.lock:
            proc.drop(old)
            current = proc.files.get(old.rel)
            if current is None:
                current = proc.files[old.rel] = fresh
            else:  # another thread reopened it meanwhile: use theirs
                os.close(fresh.fd)
            current.refs += 1
        return current

    def lease(self, files: Sequence[str]) -> Lease:
        """Hold ``files`` open for one read (a context manager)."""
        return Lease(self, files)

    def run(self, files: Sequence[str], attempt: Callable[[Lease], T]) -> T:
        """``attempt(lease)`` over ``files``, retried under this root's policy.

        A :class:`PayloadTruncatedError` (a file shorter than a record needs; a short read)
        reopens the file after a backoff, up to ``retries`` times. A
        :class:`PayloadStaleFileError` (the file under the name is not the record's file)
        reopens it once. Other errors, and these once the policy is spent, propagate.
        """
        with self.lease(files) as lease:
            reopened_stale: set[int] = set()
            tries = 0
            while True:
                try:
                    return attempt(lease)
                except PayloadStaleFileError as err:
                    i = lease.index(err.file)
                    if i is None or i in reopened_stale:
                        raise
                    reopened_stale.add(i)
                    lease.reopen(i)
                except PayloadTruncatedError as err:
                    i = lease.index(err.file)
                    if i is None:
                        raise
                    if tries == self.retries:
                        if tries:
                            raise type(err)(
                                f"{err.message}; still so after {tries} retries",
                                file=err.file,
                                field=err.field,
                                offset=err.offset,
                                pos=err.pos,
                            ) from None
                        raise
                    time.sleep(self.backoff_s * 2**tries)
                    tries += 1
                    lease.reopen(i)

    def prune(self, group: str) -> None:
        """Delete a whole group (e.g. one training step's payload directory).

        The group must be a directory beneath the root, reached without following any symlink;
        a missing group is :class:`PayloadMissingFileError`, a symlink or a non-directory
        :class:`PayloadPathError`.
        """
        parent, name = open_parent_beneath(self.path, group)
        try:
            try:
                mode = os.lstat(name, dir_fd=parent).st_mode
            except FileNotFoundError:
                raise PayloadMissingFileError(
                    f"payload group not found under {self.path}; nothing to prune", file=group
                ) from None
            if not stat.S_ISDIR(mode):
                raise PayloadPathError(
                    f"payload group under {self.path} is not a directory (a symlink or a file); "
                    "prune only deletes group directories",
                    file=group,
                )
            try:
                shutil.rmtree(name, dir_fd=parent)
            except OSError as err:
                raise PayloadIOError(f"pruning the group: {err}", file=group) from None
        finally:
            os.close(parent)
        self.close()


def output_bound(value: object) -> int:
    """``max_output_bytes`` checked: an int >= 1 (and below 2**63, the kernel's int64)."""
    if type(value) is not int or not 1 <= value < 1 << 63:
        raise PayloadInputError(
            f"max_output_bytes must be an int in [1, 2**63), got {value!r}; it bounds one "
            "field's values in one read"
        )
    return value


def as_root(root: PayloadRoot | str | os.PathLike[str]) -> PayloadRoot:
    return root if isinstance(root, PayloadRoot) else PayloadRoot(root)
