"""Where a :class:`~rollfeed.payload.write.writer.PayloadWriter` puts its bytes on a local root.

A writer on a local root owns one file, ``<root>/<group>/<name>.rfp``, and appends each
``write()`` to it. The file is created lazily, beneath the root without following any symlink
(``O_NOFOLLOW`` relative to each parent directory's descriptor, ``O_EXCL`` on the file), by the
process that writes (a forked child never appends to its parent's descriptor). One append is one
``pwritev`` of all its buffers (the file header too, first, when nothing was written yet); when it
fails (disk full, I/O error) the file is cut back to its last complete write and
:class:`~rollfeed.payload.errors.PayloadIOError` names the file.

**A file that is gone.** An open descriptor keeps writing into a file that was unlinked (its
group pruned) or renamed away and replaced at its path, and no reader can ever reach those bytes.
So after each append the sink checks that the path still names the inode it wrote
(:meth:`FileSink.still_named`: the path's device and inode against the descriptor's, two system
calls; a component swapped for a symlink is left to the reader, which refuses it with a typed
error). When it does not, the writer starts a fresh file
(:meth:`FileSink.start_fresh_file`: ``<name>-<k>.rfp``, ``k`` counting this writer's fresh files,
with a new file id; the group directory is made again) and writes there. The records of earlier
writes stay what they were: their file is gone, which is what the prune asked for.

Example (a writer named ``w0`` of group ``step_000001`` whose group is pruned between writes)::

    write(...)   -> records of step_000001/w0.rfp
    prune("step_000001")
    write(...)   -> records of step_000001/w0-1.rfp   (w0.rfp is gone; restarts == 1)
"""

from __future__ import annotations

import contextlib
import errno
import os

from rollfeed.payload.errors import PayloadIOError, PayloadPathError
from rollfeed.payload.format.layout import FILE_HEADER, file_header, new_file_id
from rollfeed.payload.stores.safe_open import open_parent_beneath

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _create_beneath(root: str, rel: str) -> int:
    """A new file ``rel`` under ``root`` (parents made as needed), reached through no symlink."""
    try:
        os.makedirs(root, exist_ok=True)
        dfd, name = open_parent_beneath(root, rel, make=True)
    except OSError as err:  # makedirs, or a mkdir of the group (disk full, permissions)
        raise PayloadIOError(f"cannot create {rel!r} under {root}: {err}", file=rel) from None
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, 0o644, dir_fd=dfd)
    except FileExistsError:
        # O_EXCL: a second writer (or a forked child) never appends to someone else's file.
        raise PayloadPathError(
            "payload file already exists: each writer (and process) needs its own name", file=rel
        ) from None
    except OSError as err:
        raise PayloadIOError(
            f"cannot create the payload file under {root}: {err}", file=rel
        ) from None
    finally:
        os.close(dfd)


def _write_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Write ``bufs`` back to back at ``offset``, resuming after partial writes."""
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], offset)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:], *bufs[1:]]


class FileSink:
    """The local file of one writer: ``file`` (a handle under ``root``) with id ``file_id``.

    ``restarts``: fresh files started because the previous one was gone (see module doc).
    Not thread-safe: the writer calls it under its lock.
    """

    def __init__(self, root: str, file: str, *, fsync: bool) -> None:
        self.root, self.file, self.fsync = root, file, fsync
        self.file_id = new_file_id()
        self.restarts = 0
        self._stem = file.removesuffix(".rfp")
        self._fd: int | None = None
        self._pid: int | None = None
        self._size = 0  # bytes of complete writes: the next write starts here

    def append(self, bufs: list[memoryview]) -> int:
        """Write ``bufs`` after the last complete write; return the offset of ``bufs[0]``.

        All or nothing: on failure the file is cut back and nothing counts as written.
        """
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid, self._size = _create_beneath(self.root, self.file), os.getpid(), 0
        at = self._size
        if at == 0:
            bufs = [memoryview(file_header(self.file_id)), *bufs]
        total = sum(len(b) for b in bufs)
        try:
            _write_all(self._fd, bufs, at)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, at)  # no half-written region stays behind
            raise PayloadIOError(
                f"writing {total} bytes failed ({errno.errorcode.get(err.errno, err.errno)}: "
                f"{err.strerror}); no record was returned for them, and the next write starts "
                f"again at byte {at}",
                file=self.file,
                offset=at,
            ) from err
        self._size = at + total
        return at if at else FILE_HEADER.size

    def still_named(self) -> bool:
        """Whether ``file`` under the root names the inode this sink wrote (one ``stat`` of the
        path, not following a final symlink, against ``fstat`` of the descriptor)."""
        if self._fd is None:
            return False
        try:
            there = os.stat(os.path.join(self.root, self.file), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        mine = os.fstat(self._fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def start_fresh_file(self) -> None:
        """Leave the current file (gone) for ``<name>-<k>.rfp`` with a new id, created on the
        next append."""
        self.close()
        self.restarts += 1
        self.file = f"{self._stem}-{self.restarts}.rfp"
        self.file_id = new_file_id()
        self._size = 0

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None
