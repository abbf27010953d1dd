"""A lease: the files of one read held open, and the batched ``preadv`` that reads them.

:meth:`Lease.read` takes a batch of byte ranges as arrays (file, offset, length, destination; a
:class:`Reads`), coalesces ranges of a file that touch or lie at most 4 KiB apart into one
``os.preadv`` with several destination buffers (the bytes between them land in a scratch buffer:
one system call costs more than reading a page), and issues the files concurrently on the root's
thread pool when there is enough to read. Several fields read together (one :class:`Reads` each,
concatenated) share those calls: the regions one request wrote lie side by side in its file.
Planning stays in NumPy so a 64-file window costs little more than its system calls. A lease holds a
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rollfeed.payload.errors import PayloadIOError, PayloadTruncatedError

if TYPE_CHECKING:
    from rollfeed.payload.root import PayloadRoot

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_GAP = 4096  # ranges of a file at most this far apart are read in one call


@dataclass(frozen=True, kw_only=True, slots=True)
class Reads:
    """A batch of byte ranges for :meth:`Lease.read`: ``[K]`` columns ``file_idx`` (into the
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

    def read(self, reads: Reads) -> None:
        """Read every range of ``reads``: ``lengths[i]`` bytes of file ``file_idx[i]`` at
        ``offsets[i]`` into the bytes of ``dests[dest_idx[i]]`` (contiguous arrays) at
        ``dest_offsets[i]``.

        Ranges of a file that touch, or lie at most 4 KiB apart, become one ``os.preadv`` with
        several destinations. A short read is :class:`PayloadTruncatedError` naming the file's
        real size.
        """
        order = np.lexsort((reads.offsets, reads.file_idx))
        order = order[reads.lengths[order] > 0]
        if not len(order):
            return
        cols = (reads.file_idx, reads.offsets, reads.lengths, reads.dest_idx, reads.dest_offsets)
        fi, off, ln, di, do = (a[order] for a in cols)
        gap = np.zeros(len(off), np.int64)
        gap[1:] = off[1:] - off[:-1] - ln[:-1]
        cut = np.ones(len(off), bool)
        cut[1:] = (fi[1:] != fi[:-1]) | (gap[1:] < 0) | (gap[1:] > _GAP)
        cut[:: _IOV_MAX // 2] = True  # preadv takes at most IOV_MAX buffers (gaps add one each)
        gap[cut] = 0
        bounds = [*np.flatnonzero(cut).tolist(), len(off)]
        views = [memoryview(d.reshape(-1).view(np.uint8)) for d in reads.dests]
        bufs = [
            views[d][a:b]
            for d, a, b in zip(di.tolist(), do.tolist(), (do + ln).tolist(), strict=True)
        ]
        if gap.any():  # the bytes between two ranges of one call land in a scratch buffer
            scratch = memoryview(bytearray(_GAP))
            at = np.flatnonzero(gap)
            for j, g in zip(at[::-1].tolist(), gap[at[::-1]].tolist(), strict=True):
                bufs.insert(j, scratch[:g])
            bounds = (np.array(bounds) + np.searchsorted(at, bounds, side="left")).tolist()
        fi_l, off_l = fi.tolist(), off.tolist()
        firsts = np.flatnonzero(cut).tolist()
        runs = [
            (fi_l[f], off_l[f], bufs[s:e])
            for f, (s, e) in zip(firsts, itertools.pairwise(bounds), strict=True)
        ]
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


class FieldFiles:
    """One field's files inside a lease that several fields share: the lease's columns, and
    batches of ranges, indexed by the field's own file numbers (``fmap [F]``: lease index of
    each; the field's records never point at an unmapped one)."""

    def __init__(self, lease: Lease | None, fmap: np.ndarray) -> None:
        self.lease, self.fmap = lease, fmap
        same = lease is not None and len(fmap) == len(lease.files)
        self._same = same and bool((fmap == np.arange(len(fmap))).all())  # no mapping needed

    def _column(self, name: str) -> np.ndarray:
        col = getattr(self.lease, name)
        return col if self._same else col[self.fmap]

    @property
    def size(self) -> np.ndarray:
        return self._column("size")

    @property
    def version(self) -> np.ndarray:
        return self._column("version")

    @property
    def file_id(self) -> np.ndarray:
        return self._column("file_id")

    @property
    def header_size(self) -> np.ndarray:
        return self._column("header_size")

    def refresh(self, idx: np.ndarray) -> None:
        self.lease.refresh(self.fmap[idx])  # type: ignore[union-attr]

    def reads(
        self,
        file_idx: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        dests: list[np.ndarray],
        dest_idx: np.ndarray | int,
        dest_offsets: np.ndarray,
    ) -> Reads:
        """A batch of this field's ranges (``file_idx`` in its own numbering; ``[K]`` columns)."""
        return Reads(
            file_idx=file_idx if self._same else self.fmap[file_idx],
            offsets=offsets,
            lengths=lengths,
            dests=dests,
            dest_idx=np.full(offsets.shape, dest_idx, np.int64),
            dest_offsets=dest_offsets,
        )
