"""Open a regular file beneath a root directory, as one step that no symlink or FIFO can subvert.

Checking a path and then opening it leaves a window in which a component can be swapped for a
symlink that leads out of the root. Instead each component is opened relative to the descriptor of
its parent with ``O_NOFOLLOW``, so the walk itself is the containment check: a symlink anywhere on
the way is refused by the kernel (``ELOOP``/``ENOTDIR``), whatever it pointed to when a caller last
looked. The last component is opened ``O_NONBLOCK`` (a FIFO would otherwise block ``open`` until a
writer appears) and its type is checked on the descriptor (``fstat``), never on the path.

Worked example (root ``/r`` with ``step_1/w0.rfp`` and a symlink ``step_1/evil -> /etc/passwd``)::

    open_beneath("/r", "step_1/w0.rfp")   -> fd of /r/step_1/w0.rfp
    open_beneath("/r", "step_1/evil")     -> PayloadPathError (symlink)
    open_beneath("/r", "../etc/passwd")   -> PayloadPathError (leaves the root)
    open_beneath("/r", "step_1/missing")  -> PayloadMissingFileError
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from rollfeed.payload.errors import PayloadMissingFileError, PayloadPathError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def handle_parts(root: str, rel: str) -> list[str]:
    """The components of handle ``rel``; refuses anything that could name a place outside
    ``root``."""
    if not isinstance(rel, str) or not rel:
        raise PayloadPathError(f"payload handle must be a non-empty string, got {rel!r}", file=None)
    bad = os.path.isabs(rel) or "\\" in rel or "\0" in rel
    parts = rel.split("/")
    if bad or any(p in ("", ".", "..") for p in parts):
        raise PayloadPathError(
            f"payload handle must be a relative path inside the root {root} "
            "(no absolute path, '..', '.', empty component, backslash or NUL)",
            file=rel.replace("\0", "\\0"),
        )
    return parts


def open_parent_beneath(root: str, rel: str, *, make: bool = False) -> tuple[int, str]:
    """``(descriptor of the directory holding rel's last component, that component)``.

    Each directory on the way is opened relative to its parent with ``O_NOFOLLOW``; ``make``
    creates missing ones (a writer's group). The caller closes the descriptor.
    """
    parts = handle_parts(root, rel)
    try:
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except FileNotFoundError:
        raise PayloadMissingFileError(f"payload root {root} does not exist", file=rel) from None
    except OSError as err:
        reason = f"cannot open payload root {root}: {err.strerror}"
        raise PayloadPathError(reason, file=rel) from None
    try:
        for part in parts[:-1]:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=dfd)
            nfd = _open_component(part, _DIR_FLAGS, dfd, root, rel)
            os.close(dfd)
            dfd = nfd
    except BaseException:
        os.close(dfd)
        raise
    return dfd, parts[-1]


def open_beneath(root: str, rel: str) -> int:
    """A read-only descriptor of the regular file ``rel`` under directory ``root``.

    Raises :class:`PayloadMissingFileError` when a component does not exist (callers may retry)
    and :class:`PayloadPathError` for a symlink, a non-regular file (FIFO, device, directory) or
    any other refusal, naming the handle and the reason.
    """
    dfd, name = open_parent_beneath(root, rel)
    try:
        fd = _open_component(name, _FILE_FLAGS, dfd, root, rel)
    finally:
        os.close(dfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise PayloadPathError(
            f"payload handle under {root} is not a regular file ({_kind(mode)})", file=rel
        )
    return fd


def _open_component(part: str, flags: int, dfd: int, root: str, rel: str) -> int:
    try:
        return os.open(part, flags, dir_fd=dfd)
    except FileNotFoundError:
        raise PayloadMissingFileError(f"payload file not found under {root}", file=rel) from None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            reason = f"{part!r} is a symlink or not a directory; handles never follow symlinks"
        else:
            reason = f"{part!r}: {err.strerror}"
        raise PayloadPathError(f"payload handle refused under {root}: {reason}", file=rel) from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return f"mode {oct(mode)}"
