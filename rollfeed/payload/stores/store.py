"""The seam between a :class:`~rollfeed.payload.PayloadRoot` and where its files live.

A :class:`Store` is a small picklable value (where, and how to reach it); its open files, clients
and threads are per-process state, created on first use and never carried across ``fork`` or a
pickle. Two implement it: :class:`~rollfeed.payload.stores.local.LocalStore` (a directory: a
descriptor cache, ``preadv`` leases, opens held beneath the root) and
:class:`~rollfeed.payload.stores.s3.S3Store` (``s3://bucket/prefix``: ranged GETs, PUTs, listings).
The root above it keeps what does not depend on the store: its retry policy (:class:`Retry`), the
checksum switch, the output bound and prune.

What a store offers:

- ``lease(files, retry)``: the files of one read opened (size, format version, file id and file
  header size per file, as ``[F]`` columns), and ranged reads of them (:class:`Reads`);
- ``sink(file, fsync=...)``: where a writer puts its bytes (an append-only file, or one object
  per write);
- ``listing(suffix)`` and ``open_file(rel)``: every payload file with its modification time, and
  one file's bytes by range, one version of it (its ``stamp`` changes when the file is replaced),
  for the offline scan and for step record files;
- ``names(folder, after=...)``: the entries directly in one folder (a step directory's files;
  those whose names sort after ``after``, a poller's newest), and
  ``stage(rel)``: a whole file written aside and put under its name at once on ``commit`` (a
  step record file), replacing what was there;
- ``put_blob(rel, data)`` and ``get_blob(rel, retry, size=...)``: one whole file written once
  under a name nothing rewrites, and read back whole (content-addressed media,
  :mod:`rollfeed.payload.media.store`);
- ``delete(group)``: a whole group gone; ``close()``: this process's open files let go.

Worked example (the batch a read plan hands a lease: 100 bytes of file 0 at 64 and 10 bytes of
file 1 at 64, into one destination at 0 and 100)::

    Reads(file_idx=[0, 1], offsets=[64, 64], lengths=[100, 10], dests=[buf],
          dest_idx=[0, 0], dest_offsets=[0, 100])
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from rollfeed.payload.errors import PayloadError, PayloadMissingFileError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Retry:
    """A root's retry policy: ``retries`` more tries after a missing or short file, waiting
    ``backoff_s * 2**attempt`` before each (shared filesystems and stores can lag)."""

    retries: int
    backoff_s: float

    def wait(self, attempt: int) -> None:
        time.sleep(self.backoff_s * 2**attempt)

    def opening(self, rel: str, open_once: Callable[[], T]) -> T:
        """``open_once()``, tried again while it raises :class:`PayloadMissingFileError`."""
        attempt = 0
        while True:
            try:
                return open_once()
            except PayloadMissingFileError as err:
                if attempt == self.retries:
                    if self.retries:
                        err = PayloadMissingFileError(
                            f"{err.message} (after {self.retries} retries)", file=rel
                        )
                    raise err from None
            self.wait(attempt)
            attempt += 1


class PerProcess:
    """A picklable value whose open files, clients or threads (``_state``: made by
    :meth:`_here`, with a ``pid`` and a ``close()``) belong to one process: never pickled, and a
    forked child makes its own instead of using its parent's (or, given ``forked``, is refused
    with the error it returns, if any: a client whose runtime does not survive ``fork``)."""

    _state: Any = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "_state"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state, _state=None)

    def _here(
        self, make: Callable[[], T], *, forked: Callable[[], Exception | None] | None = None
    ) -> T:
        if self._state is not None and self._state.pid != os.getpid():
            if forked is not None and (err := forked()) is not None:
                raise err
            self._state = None
        if self._state is None:
            self._state = make()
        return self._state

    def close(self) -> None:
        """Let go of this process's state (it is made again on next use)."""
        if self._state is not None and self._state.pid == os.getpid():
            self._state.close()


@dataclass(frozen=True, kw_only=True, slots=True)
class Reads:
    """A batch of byte ranges for a lease's ``read``: ``[K]`` columns ``file_idx`` (into the
    lease's files), ``offsets``, ``lengths``, ``dest_idx`` (into ``dests``) and ``dest_offsets``
    (bytes into that destination)."""

    file_idx: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    dests: list[np.ndarray]
    dest_idx: np.ndarray
    dest_offsets: np.ndarray

    @staticmethod
    def concat(parts: Sequence[Reads]) -> Reads:
        """One batch holding every range of ``parts``, in order."""
        if len(parts) == 1:
            return parts[0]
        base = np.cumsum([0] + [len(p.dests) for p in parts])
        cols = [
            np.concatenate([getattr(p, k) for p in parts])
            for k in ("file_idx", "offsets", "lengths", "dest_offsets")
        ]
        return Reads(
            file_idx=cols[0],
            offsets=cols[1],
            lengths=cols[2],
            dests=[d for p in parts for d in p.dests],
            dest_idx=np.concatenate([p.dest_idx + b for p, b in zip(parts, base, strict=False)]),
            dest_offsets=cols[3],
        )


class StoreLease(Protocol):
    """The files of one read, held (a context manager; a store's lease subclasses this):
    ``entries``, one per file, each with ``columns`` ``(size, format version, file id, file
    header size)``, and ``[F]`` columns over ``files`` (:meth:`_columns` makes them)."""

    files: Sequence[str]
    entries: list
    size: np.ndarray  # bytes, as of open or the last refresh
    file_id: np.ndarray

    def _columns(self) -> None:
        cols = np.array([e.columns for e in self.entries], np.int64).reshape(-1, 4).T.copy()
        self.size, _, self.file_id, _ = cols  # (version and file header size: the kernel's)

    def __enter__(self) -> StoreLease:
        return self

    def index(self, rel: str | None) -> int | None:
        """Position of ``rel`` in ``files`` (``None`` when this lease does not hold it)."""
        return self.files.index(rel) if rel in self.files else None

    def __exit__(self, *exc: object) -> None: ...
    def refresh(self, idx: np.ndarray) -> None: ...
    def reopen(self, i: int) -> None: ...
    def read(self, reads: Reads) -> None: ...


class Sink(Protocol):
    """Where one writer's bytes go: ``put(packed)`` writes the regions ``packed(file_id)`` lays
    out to ``file`` and returns each region body's offset."""

    file: str
    file_id: int
    restarts: int

    def put(self, packed: Callable[[int], tuple[list[memoryview], list[int]]]) -> list[int]: ...
    def close(self) -> None: ...


class StoreFile(Protocol):
    """One file opened for reading: its ``size`` and ``stamp`` (which version of the file this
    is: ``"inode 12, mtime_ns 17..."`` of a local file, ``'ETag "9b2c"'`` of an object); every
    ``read(at, n)`` reads that version and gives fewer bytes only if it shrank."""

    size: int
    stamp: str

    def read(self, at: int, n: int) -> bytes: ...
    def close(self) -> None: ...


class Staged(Protocol):
    """A file being written whole (:meth:`Store.stage`): ``write`` appends, ``commit`` puts it
    under its name at once (replacing any file there), ``abort`` leaves nothing behind. A failure
    is :class:`~rollfeed.payload.errors.PayloadIOError` naming the file, after an ``abort``."""

    def write(self, data: bytes | memoryview) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Listed:
    """One entry a listing found: its handle, modification time (seconds; 0 for a folder of an
    object store) and whether it is a folder (:meth:`Store.names` only)."""

    rel: str
    mtime: float
    folder: bool = False


class Store(Protocol):
    """Where a root's files live (see the module doc)."""

    path: str  # the directory, or the s3:// URL
    descriptors: bool  # its leases hold entries with an fd and columns: the compiled pass's
    threads: int  # files read concurrently
    backoff_s: float  # the default wait of a root's retry policy on this store

    def where(self, rel: str) -> str: ...
    def lease(self, files: Sequence[str], retry: Retry) -> StoreLease: ...
    def sink(self, file: str, *, fsync: bool) -> Sink: ...
    def listing(self, suffix: str) -> tuple[list[Listed], list[PayloadError]]: ...
    def open_file(self, rel: str) -> StoreFile: ...
    def names(self, folder: str, *, after: str = "") -> list[Listed]: ...
    def stage(self, rel: str, *, fsync: bool = False) -> Staged: ...
    def put_blob(self, rel: str, data: bytes) -> bool: ...
    def get_blob(self, rel: str, retry: Retry, *, size: int) -> bytes: ...
    def delete(self, group: str) -> None: ...
    def close(self) -> None: ...
