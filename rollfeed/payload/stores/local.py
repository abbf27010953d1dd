"""A directory of payload files: the local :class:`~rollfeed.payload.stores.store.Store`.

Every open goes through :func:`~rollfeed.payload.stores.safe_open.open_beneath`: a handle cannot
leave the root through a symlink (not even one swapped in mid-read), and a FIFO or directory is
refused at once instead of blocking ``open``.

Open files and the thread pool live in a per-process cache, created lazily and dropped after
``fork``, so the store (and its root) can be handed to DataLoader workers and never carries file
descriptors across processes. The cache is shared by threads. A read *leases* the files it needs
(:class:`Lease`): each lease holds a reference on a cache entry, and an entry evicted meanwhile
(beyond ``max_open``, by :meth:`LocalStore.close`, or replaced by a reopen) leaves the cache at
once but closes its descriptor only when the last lease lets go. No read ever uses a closed (or
reused) descriptor, and open descriptors stay at most ``max_open`` plus the files of reads in
flight.

:meth:`Lease.read` takes a batch of byte ranges (:class:`~rollfeed.payload.stores.store.Reads`),
coalesces ranges of a file that touch or lie at most 4 KiB apart into one ``os.preadv`` with
several destination buffers (the bytes between them land in a scratch buffer: one system call
costs more than reading a page), and issues the files concurrently on the store's thread pool
when there is enough to read. Several fields read together share those calls: the regions one
request wrote lie side by side in its file. Planning stays in NumPy so a 64-file window costs
little more than its system calls.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import stat
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from rollfeed.payload.errors import (
    PayloadError,
    PayloadInputError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadTruncatedError,
)
from rollfeed.payload.format.layout import FILE_HEADER, VERSION, parse_file_header
from rollfeed.payload.stores.folder_names import local_names
from rollfeed.payload.stores.safe_open import open_beneath, open_parent_beneath
from rollfeed.payload.stores.store import Listed, PerProcess, Reads, Retry, StoreLease
from rollfeed.payload.write.file_sink import FileSink
from rollfeed.payload.write.whole_file import LocalStaged

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
GAP = 4096  # ranges of a file at most this far apart are read in one call (as the kernel's)


class _Entry:
    """One open payload file: descriptor, size (refreshed on demand), and its file header."""

    __slots__ = ("cached", "columns", "fd", "refs", "rel")

    def __init__(self, rel: str, fd: int, size: int, version: int, file_id: int, header_size: int):
        self.rel, self.fd, self.refs, self.cached = rel, fd, 0, True
        self.columns = (size, version, file_id, header_size)  # as lease columns want them

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


class LocalStore(PerProcess):
    """Payload files under directory ``path``.

    ``max_open``: descriptors kept open between reads (least recently used ones close first).
    ``threads``: reads of different files run concurrently once a read touches at least
    ``parallel_min_bytes``. From the page cache on 2 cores, a 6 MiB window over 64 files took
    0.7 ms inline and 1.1-2.6 ms on 2-4 threads, so the default only goes parallel for large
    reads; on a network filesystem, where each read waits on latency, set it to 0.
    """

    descriptors = True
    backoff_s = 0.02

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_open: int = 256,
        threads: int = 4,
        parallel_min_bytes: int = 64 << 20,
    ) -> None:
        if max_open < 1:
            raise PayloadInputError(f"PayloadRoot needs max_open >= 1, got {max_open}")
        self.path = os.path.abspath(os.fspath(path))
        self.max_open, self.threads, self.parallel_min_bytes = max_open, threads, parallel_min_bytes

    def __del__(self) -> None:
        self.close()  # reads in flight keep their files until they finish

    def where(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def _proc(self) -> _ProcessState:
        return self._here(_ProcessState)  # after fork: the parent's fds are not ours

    def _open(self, rel: str, retry: Retry) -> _Entry:
        """A fresh, uncached entry for ``rel``, after the bounded retry for a missing file."""
        fd = retry.opening(rel, lambda: open_beneath(self.path, rel))
        try:
            size = os.fstat(fd).st_size
            file_id = parse_file_header(os.pread(fd, FILE_HEADER.size, 0))
        except PayloadError as err:
            os.close(fd)
            raise err.with_place(file=rel) from None
        except OSError as err:
            os.close(fd)
            raise PayloadIOError(f"reading the file header: {err}", file=rel, offset=0) from None
        return _Entry(rel, fd, size, VERSION, file_id, FILE_HEADER.size)

    def _acquire(self, files: Sequence[str], retry: Retry) -> list[_Entry]:
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
                fresh = self._open(rel, retry)  # outside the lock: the missing-file retry waits
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

    def _replace(self, old: _Entry, retry: Retry) -> _Entry:
        """A newly opened entry for ``old.rel`` in place of ``old`` (which the caller releases)."""
        fresh = self._open(old.rel, retry)
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

    def lease(self, files: Sequence[str], retry: Retry) -> Lease:
        """Hold ``files`` open for one read (a context manager)."""
        return Lease(self, files, retry)

    def sink(self, file: str, *, fsync: bool) -> FileSink:
        return FileSink(self.path, file, fsync=fsync)

    def listing(self, suffix: str) -> tuple[list[Listed], list[PayloadError]]:
        """Every ``*suffix`` file under the directory (walked without following any symlink),
        and what could not be listed: a symlink anywhere is a finding (readers refuse every
        symlink, so nothing behind it is readable by handle), as is a directory or entry that
        vanished or could not be read."""
        found: list[Listed] = []
        refused: list[PayloadError] = []
        pending = [""]
        while pending:
            rel_dir = pending.pop()
            try:
                with os.scandir(os.path.join(self.path, rel_dir) if rel_dir else self.path) as it:
                    entries = list(it)
            except OSError as err:
                refused.append(_os_finding(err, rel_dir or ".", "directory"))
                continue
            for entry in entries:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                try:
                    if entry.is_symlink():
                        refused.append(
                            PayloadPathError(
                                "symlink, not followed: readers never follow symlinks, so "
                                "nothing behind it is readable by handle; put the file itself "
                                "there",
                                file=rel,
                            )
                        )
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(rel)
                    elif entry.name.endswith(suffix):  # open_file refuses a FIFO by its type
                        found.append(Listed(rel, entry.stat(follow_symlinks=False).st_mtime))
                except OSError as err:
                    refused.append(_os_finding(err, rel, "entry"))
        return sorted(found, key=lambda f: f.rel), refused

    def open_file(self, rel: str) -> LocalFile:
        return LocalFile(open_beneath(self.path, rel))

    def names(self, folder: str, *, after: str = "") -> list[Listed]:
        return local_names(self.path, folder, after)

    def stage(self, rel: str, *, fsync: bool = False) -> LocalStaged:
        return LocalStaged(self.path, rel, fsync=fsync)

    def put_blob(self, rel: str, data: bytes) -> bool:
        """Store ``data`` as file ``rel`` unless one of that name exists (then leave it as it
        is); True when this call wrote it. The bytes go to a temporary file beside it, then are
        linked to the name (``link`` refuses an existing name: nothing is ever rewritten, and a
        reader never sees a partial file), parents made as needed, no symlink followed."""
        try:
            os.makedirs(self.path, exist_ok=True)
            dfd, name = open_parent_beneath(self.path, rel, make=True)
        except OSError as err:
            raise PayloadIOError(
                f"cannot create {rel!r} under {self.path}: {err}", file=rel
            ) from None
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False
            return True
        except OSError as err:
            raise PayloadIOError(f"writing {len(data)} bytes failed: {err}", file=rel) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            os.close(dfd)

    def get_blob(self, rel: str, retry: Retry, *, size: int) -> bytes:
        """The ``size`` bytes of file ``rel`` (after the bounded retry for a missing one); a file
        of another size is :class:`PayloadTruncatedError`, its bytes unread."""
        fd = retry.opening(rel, lambda: open_beneath(self.path, rel))
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise PayloadTruncatedError(
                    f"file holds {have} bytes, its handle says {size}; nothing was read", file=rel
                )
            data = os.pread(fd, size, 0)
        except OSError as err:
            raise PayloadIOError(f"reading {size} bytes: {err}", file=rel, offset=0) from None
        finally:
            os.close(fd)
        if len(data) != size:
            raise PayloadTruncatedError(f"read {len(data)} of {size} bytes", file=rel, offset=0)
        return data

    def delete(self, group: str) -> None:
        """Delete directory ``group``, reached without following any symlink; a missing group is
        :class:`PayloadMissingFileError`, a symlink or a non-directory :class:`PayloadPathError`."""
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


def _os_finding(err: OSError, rel: str, what: str) -> PayloadError:
    if isinstance(err, FileNotFoundError):
        return PayloadMissingFileError(f"{what} vanished during the scan (pruned?)", file=rel)
    return PayloadPathError(f"{what} cannot be read: {err.strerror}", file=rel)


class LocalFile:
    """One file opened for reading (its descriptor; ``size`` and ``stamp`` as of open)."""

    def __init__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.fd, self.size = fd, st.st_size
        self.stamp = f"inode {st.st_ino}, mtime_ns {st.st_mtime_ns}"

    def read(self, at: int, n: int) -> bytes:
        return os.pread(self.fd, n, at)

    def close(self) -> None:
        os.close(self.fd)


class Lease(StoreLease):
    """Files held open for one read; ``entries``: the cache entries (``fd`` and ``columns``),
    which the compiled pass reads."""

    def __init__(self, store: LocalStore, files: Sequence[str], retry: Retry) -> None:
        self.store, self.files, self.retry = store, files, retry
        self.entries = store._acquire(files, retry)

    def __getattr__(self, name: str) -> np.ndarray:
        if name not in ("size", "file_id"):
            raise AttributeError(name)
        self._columns()  # on first use only: the compiled pass reads the entries instead
        return getattr(self, name)

    def __exit__(self, *exc: object) -> None:
        entries, self.entries = self.entries, []
        self.store._proc().release(entries)

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
        self.entries[i] = self.store._replace(old, self.retry)
        self.store._proc().release([old])
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
        cut[1:] = (fi[1:] != fi[:-1]) | (gap[1:] < 0) | (gap[1:] > GAP)
        cut[:: _IOV_MAX // 2] = True  # preadv takes at most IOV_MAX buffers (gaps add one each)
        gap[cut] = 0
        bounds = [*np.flatnonzero(cut).tolist(), len(off)]
        views = [memoryview(d.reshape(-1).view(np.uint8)) for d in reads.dests]
        bufs = [
            views[d][a:b]
            for d, a, b in zip(di.tolist(), do.tolist(), (do + ln).tolist(), strict=True)
        ]
        if gap.any():  # the bytes between two ranges of one call land in a scratch buffer
            scratch = memoryview(bytearray(GAP))
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
        store = self.store
        if len(self.files) < 2 or store.threads < 2 or int(ln.sum()) < store.parallel_min_bytes:
            self._read_runs(runs)
            return
        by_file: dict[int, list] = defaultdict(list)
        for run in runs:
            by_file[run[0]].append(run)
        proc = store._proc()
        with proc.lock:
            if proc.pool is None:
                proc.pool = ThreadPoolExecutor(store.threads, thread_name_prefix="rollfeed-read")
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
