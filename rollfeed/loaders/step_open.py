"""Opening a step file or its index: the payload Store's open rule, and reads bounded by the file.

A step file and its index are opened as a payload file is, by
:func:`~rollfeed.payload.stores.safe_open.open_beneath` relative to their directory: the name is
opened with ``O_NOFOLLOW | O_NONBLOCK`` and its type checked on the descriptor. So a symlink
(dangling or not), a FIFO (which would block ``open`` until a writer came), a directory or a
device under a step file's name is a :class:`StepFileError` naming the path at once, never a
wait, a bare ``OSError`` or a file read from elsewhere. Reads go through the descriptor and are
bounded by the size ``fstat`` gave at open: a file that grows is not read past it, one that
shrinks while read is a :class:`StepFileError`, and an index above :data:`MAX_INDEX_BYTES` is
refused unread.

Example (``/run/steps`` holds ``step_000003.jsonl`` and a FIFO ``step_000004.jsonl``)::

    open_step("/run/steps/step_000003.jsonl", what="step file")   -> fd
    open_step("/run/steps/step_000005.jsonl", what="step file")   -> None (no such file)
    open_step("/run/steps/step_000004.jsonl", what="step file")
        -> StepFileError: step file is a FIFO, not a regular file ...
           [file=/run/steps/step_000004.jsonl]
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from rollfeed.loaders.errors import StepFileError
from rollfeed.payload.errors import PayloadMissingFileError, PayloadPathError
from rollfeed.payload.stores.object_answer import ANSWER_BYTES
from rollfeed.payload.stores.safe_open import open_beneath

MAX_INDEX_BYTES = ANSWER_BYTES  # the bound a step store's index GET has too
Pread = Callable[[int, int], bytes]  # (n, offset) -> up to n bytes of a file at offset


def open_step(path: str | os.PathLike[str], *, what: str) -> int | None:
    """A read-only descriptor of the regular file ``path`` (``what``: "step file", "step index"
    for the message), or ``None`` when there is none; :class:`StepFileError` for anything else
    under that name. The caller closes the descriptor."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        return open_beneath(directory, name)
    except PayloadMissingFileError:
        return None
    except PayloadPathError:
        raise StepFileError(
            f"{what} is {_kind(path)}, not a regular file: step files and their indexes are "
            "opened without following symlinks and never wait on a FIFO; put the file itself "
            "there (write it with write_step_file)",
            file=os.fspath(path),
        ) from None


def fd_pread(fd: int) -> Pread:
    """``pread(n, offset)`` through descriptor ``fd``."""
    return lambda n, at: os.pread(fd, n, at)


def read_exact(pread: Pread, size: int, *, file: str, at: int = 0) -> bytes:
    """Bytes ``[at, at + size)`` of a file; :class:`StepFileError` when it ends before them (it
    shrank, or was rewritten, while it was read)."""
    parts, got = [], 0
    while got < size:
        data = pread(size - got, at + got)
        if not data:
            raise StepFileError(
                f"the file ended at byte {at + got} while bytes [{at}, {at + size}) were read: it "
                "shrank or was rewritten while read; a written step file must not change",
                file=file,
            )
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def read_index_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """The whole index file ``path`` (at most :data:`MAX_INDEX_BYTES`), or ``None`` when there is
    none."""
    fd = open_step(path, what="step index")
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX_BYTES:
            raise StepFileError(
                f"step index holds {size} bytes, more than the {MAX_INDEX_BYTES} an index may "
                "(about 80 bytes per sample); it is not an index: rebuild it with "
                "build_step_index or delete it",
                file=os.fspath(path),
            )
        return read_exact(fd_pread(fd), size, file=os.fspath(path))
    finally:
        os.close(fd)


def _kind(path: str | os.PathLike[str]) -> str:
    """What is at ``path``, for a message only (the refusal itself was made on the descriptor)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as err:
        return f"not openable ({err.strerror})"
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not openable under the open rule"
