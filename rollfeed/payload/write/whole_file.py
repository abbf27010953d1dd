"""A whole file written aside and put under its name at once: ``Store.stage(rel)``.

A step record file appears whole or not at all, and a file written again under its name replaces
the old one at once (a reader that opened the old one keeps reading it):

- local (:class:`LocalStaged`): the bytes go to a temporary file beside the name,
  ``.<name>.<pid>-<random>.tmp``, created ``O_EXCL`` beneath the root without following a
  symlink (the directory is made when missing), so two writers of one name never write into one
  file; ``commit`` (``fsync`` first when asked) renames it over the name and ``abort`` removes
  it. A name that does not match the reader's pattern is never read, so a writer killed midway
  leaves only a temporary file;
- an object store (:class:`ObjectStaged`): the bytes are held in memory and ``commit`` is one PUT
  (atomic: a reader sees the old object or the new one).

A failed write, ``fsync`` or rename is :class:`~rollfeed.payload.errors.PayloadIOError` naming the
file, after the temporary file is removed.

Example::

    staged = store.stage("step_000003.rfs")
    staged.write(header); staged.write(record)   # .step_000003.rfs.4242-9f3a1c2b.tmp
    staged.commit()                              # step_000003.rfs, whole
"""

from __future__ import annotations

import contextlib
import os
import secrets

from rollfeed.payload.errors import PayloadIOError
from rollfeed.payload.stores.object_client import ObjectClient
from rollfeed.payload.stores.safe_open import open_parent_beneath

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalStaged:
    """``rel`` under the directory ``root``, written aside (see the module doc)."""

    def __init__(self, root: str, rel: str, *, fsync: bool) -> None:
        self.rel, self.fsync = rel, fsync
        self.fd = self.dfd = -1
        try:
            os.makedirs(root, exist_ok=True)
            self.dfd, self.name = open_parent_beneath(root, rel, make=True)
            self.tmp = f".{self.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
            self.fd = os.open(self.tmp, _CREATE, 0o644, dir_fd=self.dfd)
        except OSError as err:
            self._fail(err, "creating")

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as err:
            self._fail(err, "writing")

    def commit(self) -> None:
        try:
            if self.fsync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.rename(self.tmp, self.name, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            if self.fsync:
                os.fsync(self.dfd)
        except OSError as err:
            self._fail(err, "committing")
        os.close(self.dfd)
        self.dfd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dfd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dfd)
            os.close(self.dfd)
            self.dfd = -1

    def _fail(self, err: OSError, what: str) -> None:
        self.abort()
        raise PayloadIOError(
            f"{what} the file failed ({type(err).__name__}: {err.strerror or err}); nothing of it "
            "was left behind",
            file=self.rel,
        ) from err


class ObjectStaged:
    """Object ``rel`` of ``client``'s prefix, held in memory until ``commit`` PUTs it."""

    def __init__(self, client: ObjectClient, rel: str) -> None:
        self.client, self.rel = client, rel
        self.parts: list[bytes] = []

    def write(self, data: bytes | memoryview) -> None:
        self.parts.append(bytes(data))

    def commit(self) -> None:
        data, self.parts = b"".join(self.parts), []
        rel, client = self.rel, self.client
        client.process().obstore.overwrite(
            client.url.key(rel), data, where=client.where(rel), rel=rel
        )

    def abort(self) -> None:
        self.parts = []
