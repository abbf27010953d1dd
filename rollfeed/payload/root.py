"""The payload root: resolves handles safely and reads byte ranges from payload files.

A :class:`PayloadRoot` is a small picklable value (a path and a few settings). Open files and the
thread pool live in a per-process cache that is created lazily and dropped after ``fork``, so the
object can be handed to DataLoader workers and never carries file descriptors across processes.

Reads are described as :class:`ReadOp`\\ s (file, byte offset, destination buffer). :meth:`read`
coalesces ops that are contiguous in a file into one ``os.preadv`` with several destination
buffers, and issues the files concurrently on a thread pool when there is enough to read.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rollfeed.payload.errors import (
    PayloadHeaderError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadTruncatedError,
)
from rollfeed.payload.layout import FILE_HEADER, MAGIC, VERSION

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Read ``len(dest)`` bytes of ``file`` at ``offset`` into ``dest`` (a writable buffer)."""

    file: str
    offset: int
    dest: memoryview


class _ProcessState:
    """Open files and the pool of one process; never pickled."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.files: OrderedDict[str, tuple[int, int]] = OrderedDict()  # rel -> (fd, size)
        self.pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)
        self.files.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None


class PayloadRoot:
    """A directory of payload files, and how to read them.

    ``retries`` / ``backoff_s``: a missing file or a short read reopens the file and retries with
    exponential backoff (shared filesystems can lag), then raises naming file, offset and sizes.
    ``threads``: reads of different files run concurrently once a read touches at least
    ``parallel_min_bytes``; below that the pool's hand-off costs more than it saves.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_open: int = 256,
        retries: int = 3,
        backoff_s: float = 0.02,
        threads: int = 4,
        parallel_min_bytes: int = 4 << 20,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.max_open, self.retries, self.backoff_s = max_open, retries, backoff_s
        self.threads, self.parallel_min_bytes = threads, parallel_min_bytes
        self._state: _ProcessState | None = None

    def __getstate__(self) -> dict:
        state = {k: getattr(self, k) for k in ("path", "max_open", "retries", "backoff_s")}
        state.update(threads=self.threads, parallel_min_bytes=self.parallel_min_bytes)
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
        """Close this process's open files (they reopen lazily on the next read)."""
        if self._state is not None and self._state.pid == os.getpid():
            self._state.close()
        self._state = None

    def _proc(self) -> _ProcessState:
        if self._state is None or self._state.pid != os.getpid():
            self._state = _ProcessState()  # after fork: the parent's fds are not ours to use
        return self._state

    def resolve(self, rel: str) -> str:
        """Absolute path of handle ``rel``; refuses anything that leaves the root."""
        parts = Path(rel).parts
        if not rel or os.path.isabs(rel) or ".." in parts or "\\" in rel:
            raise PayloadPathError(
                f"payload handle must be a relative path inside the root {self.path}", file=rel
            )
        full = os.path.join(self.path, rel)
        real_root = os.path.realpath(self.path)
        if not os.path.realpath(full).startswith(real_root + os.sep):
            raise PayloadPathError(
                f"payload handle resolves outside the root {self.path} (symlink?)", file=rel
            )
        return full

    def _open(self, rel: str) -> tuple[int, int]:
        proc = self._proc()
        with proc.lock:
            hit = proc.files.get(rel)
            if hit is not None:
                proc.files.move_to_end(rel)
                return hit
        full = self.resolve(rel)
        for attempt in range(self.retries + 1):
            try:
                fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                break
            except FileNotFoundError:
                if attempt == self.retries:
                    raise PayloadMissingFileError(
                        f"payload file not found under {self.path} after {self.retries} retries",
                        file=rel,
                    ) from None
                time.sleep(self.backoff_s * 2**attempt)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, FILE_HEADER.size, 0)
            if len(head) < FILE_HEADER.size or FILE_HEADER.unpack(head)[0] != MAGIC:
                raise PayloadHeaderError("not a payload file (bad magic)", file=rel, offset=0)
            version = FILE_HEADER.unpack(head)[1]
            if version != VERSION:
                raise PayloadHeaderError(
                    f"payload format version {version}; this reader reads {VERSION}",
                    file=rel,
                    offset=0,
                )
        except BaseException:
            os.close(fd)
            raise
        with proc.lock:
            proc.files[rel] = (fd, size)
            while len(proc.files) > self.max_open:
                os.close(proc.files.popitem(last=False)[1][0])
        return fd, size

    def _forget(self, rel: str) -> None:
        proc = self._proc()
        with proc.lock:
            hit = proc.files.pop(rel, None)
        if hit is not None:
            os.close(hit[0])

    def _read_file(self, rel: str, ops: list[ReadOp]) -> None:
        ops = sorted(ops, key=lambda op: op.offset)
        runs: list[list[ReadOp]] = []
        for op in ops:  # coalesce ranges that touch into one preadv with several buffers
            if runs and runs[-1][-1].offset + len(runs[-1][-1].dest) == op.offset:
                runs[-1].append(op)
            else:
                runs.append([op])
        for run in runs:
            want = sum(len(op.dest) for op in run)
            for attempt in range(self.retries + 1):
                fd, size = self._open(rel)
                got = os.preadv(fd, [op.dest for op in run], run[0].offset) if want else 0
                if got == want:
                    break
                self._forget(rel)  # the file may have been replaced or still be arriving: reopen
                if attempt == self.retries:
                    raise PayloadTruncatedError(
                        f"short read: wanted {want} bytes, got {got} (file size {size}) "
                        f"after {self.retries} retries",
                        file=rel,
                        offset=run[0].offset,
                    )
                time.sleep(self.backoff_s * 2**attempt)

    def read(self, ops: list[ReadOp]) -> None:
        """Fill every op's destination; files in parallel when the read is large enough."""
        by_file: dict[str, list[ReadOp]] = defaultdict(list)
        for op in ops:
            by_file[op.file].append(op)
        total = sum(len(op.dest) for op in ops)
        if len(by_file) < 2 or self.threads < 2 or total < self.parallel_min_bytes:
            for rel, file_ops in by_file.items():
                self._read_file(rel, file_ops)
            return
        proc = self._proc()
        if proc.pool is None:
            proc.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rollfeed-read")
        for future in [proc.pool.submit(self._read_file, rel, fo) for rel, fo in by_file.items()]:
            future.result()

    def file_size(self, rel: str) -> int:
        return self._open(rel)[1]

    def prune(self, group: str) -> None:
        """Delete a whole group (e.g. one training step's payload directory)."""
        shutil.rmtree(self.resolve(group))
        self.close()


def as_root(root: PayloadRoot | str | os.PathLike[str]) -> PayloadRoot:
    return root if isinstance(root, PayloadRoot) else PayloadRoot(root)
