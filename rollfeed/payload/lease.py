"""A lease: the files of one read held open, and the batched ``preadv`` that reads them.

:meth:`Lease.read` takes a batch of byte ranges as arrays (file, offset, length, destination),
coalesces ranges that touch within a file into one ``os.preadv`` with several destination buffers,
and issues the files concurrently on the root's thread pool when there is enough to read. Planning
stays in NumPy so a 64-file window costs little more than its system calls. A lease holds a
reference on each file's cache entry (:mod:`rollfeed.payload.root`), so no descriptor it uses is
closed or reused before it lets go.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np

from rollfeed.payload.errors import PayloadIOError, PayloadTruncatedError

if TYPE_CHECKING:
    from rollfeed.payload.root import PayloadRoot

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class Lease:
    """Files held open for one read. Columns ``[F]`` over ``files``: ``size`` (bytes, as of open
    or the last :meth:`refresh`), ``version``, ``file_id`` (0 in version 1) and ``header_size``.
    """

    def __init__(self, root: PayloadRoot, files: Sequence[str]) -> None:
        self.root, self.files = root, files
        self.entries = root._acquire(files)
        self._columns()

    def _columns(self) -> None:
        cols = np.array([e.columns for e in self.entries], np.int64).reshape(-1, 4).T.copy()
        self.size, self.version, self.file_id, self.header_size = cols

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        entries, self.entries = self.entries, []
        self.root._proc().release(entries)

    def index(self, rel: str | None) -> int | None:
        """Position of ``rel`` in ``files`` (``None`` when this lease does not hold it)."""
        return self.files.index(rel) if rel in self.files else None

    def refresh(self, idx: np.ndarray) -> None:
        """Re-read the sizes of files ``idx`` (one ``fstat`` each: a file may have grown)."""
        for i in np.unique(idx).tolist():
            entry = self.entries[i]
            try:
                entry.grow(os.fstat(entry.fd).st_size)
            except OSError as err:
                raise PayloadIOError(f"fstat: {err}", file=entry.rel) from None
            self.size[i] = entry.size

    def reopen(self, i: int) -> None:
        """Drop the cached descriptor of file ``i`` and open the name again."""
        old = self.entries[i]
        self.entries[i] = self.root._replace(old)
        self.root._proc().release([old])
        self._columns()

    def read(
        self,
        file_idx: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        dests: Sequence[np.ndarray],
        dest_idx: np.ndarray | int,
        dest_offsets: np.ndarray,
    ) -> None:
        """Read ``lengths[i]`` bytes of file ``file_idx[i]`` at ``offsets[i]`` into the bytes of
        ``dests[dest_idx[i]]`` (contiguous arrays) at ``dest_offsets[i]``; index arrays ``[K]``.

        Ranges that touch within a file become one ``os.preadv`` with several destinations. A
        short read is :class:`PayloadTruncatedError` naming the file's real size.
        """
        dest_idx = np.broadcast_to(np.asarray(dest_idx, np.int64), offsets.shape)
        keep = lengths > 0
        if not keep.all():
            file_idx, offsets, lengths, dest_idx, dest_offsets = (
                a[keep] for a in (file_idx, offsets, lengths, dest_idx, dest_offsets)
            )
        if not len(offsets):
            return
        order = np.lexsort((offsets, file_idx))
        cols = (file_idx, offsets, lengths, dest_idx, dest_offsets)
        fi, off, ln, di, do = (a[order] for a in cols)
        cut = np.ones(len(off), bool)
        cut[1:] = (fi[1:] != fi[:-1]) | (off[1:] != off[:-1] + ln[:-1])
        cut[::_IOV_MAX] = True  # preadv takes at most IOV_MAX buffers
        bounds = [*np.flatnonzero(cut).tolist(), len(off)]
        views = [memoryview(d.reshape(-1).view(np.uint8)) for d in dests]
        bufs = [
            views[d][a:b]
            for d, a, b in zip(di.tolist(), do.tolist(), (do + ln).tolist(), strict=True)
        ]
        fi_l, off_l = fi.tolist(), off.tolist()
        runs = [(fi_l[s], off_l[s], bufs[s:e]) for s, e in itertools.pairwise(bounds)]
        root = self.root
        if len(self.files) < 2 or root.threads < 2 or int(ln.sum()) < root.parallel_min_bytes:
            self._read_runs(runs)
            return
        by_file: dict[int, list] = defaultdict(list)
        for run in runs:
            by_file[run[0]].append(run)
        proc = root._proc()
        with proc.lock:
            if proc.pool is None:
                proc.pool = ThreadPoolExecutor(root.threads, thread_name_prefix="rollfeed-read")
            pool = proc.pool
        jobs = []
        try:
            for rs in by_file.values():
                try:
                    jobs.append(pool.submit(self._read_runs, rs))
                except RuntimeError:  # close() shut the pool down meanwhile: read these here
                    self._read_runs(rs)
        finally:
            wait(jobs)  # all done before any error leaves: no thread still uses these fds
        for future in jobs:
            future.result()

    def _read_runs(self, runs: list) -> None:
        """Issue ``runs`` (file index, offset, buffers)."""
        for f, offset, bufs in runs:
            entry = self.entries[f]
            want = sum(map(len, bufs))
            try:
                got = os.preadv(entry.fd, bufs, offset)
            except OSError as err:
                raise PayloadIOError(
                    f"reading {want} bytes: {errno.errorcode.get(err.errno, err.errno)} "
                    f"{err.strerror}",
                    file=entry.rel,
                    offset=offset,
                ) from None
            if got != want:
                size = os.fstat(entry.fd).st_size
                raise PayloadTruncatedError(
                    f"short read: wanted {want} bytes, got {got}; the file has {size} bytes",
                    file=entry.rel,
                    offset=offset,
                )
