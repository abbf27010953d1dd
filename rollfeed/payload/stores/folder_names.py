"""The entries directly in one folder of a store: ``Store.names(folder, after=...)``.

A step directory is one folder of files; a reader polls it for new steps and, when it holds none,
looks into its subfolders for the ones a user meant. So a listing is one folder deep, never a walk
of the tree beneath it:

- a local directory is opened beneath the root without following a symlink (``O_NOFOLLOW``, and
  ``O_DIRECTORY``, which a FIFO fails at once), and read with one ``scandir``: each entry with its
  own modification time (``lstat``) and whether it is a directory (a symlink is a file here, which
  the open rule refuses when it is read);
- an object-store prefix is listed with ``ListObjectsV2`` and the delimiter ``/``, page after page,
  each answer bounded (:mod:`~rollfeed.payload.stores.object_botocore`): the keys directly under
  it, and its common prefixes as folders.

``after`` keeps the names that sort after it (bytewise), all of them for ``""``: an object-store
listing starts there (``start-after``: the pages before it are never sent), a local one skips the
others before it reads their times. A reader polling for the steps from ``s`` on lists the few
newest files, not all the steps of a long run (3,000 files: 70-90 ms a listing on SeaweedFS).

A local root that does not exist is :class:`~rollfeed.payload.errors.PayloadMissingFileError`,
one that is not a directory :class:`~rollfeed.payload.errors.PayloadPathError`; an object prefix
always exists (it may hold nothing).

Example (``/run/steps`` holds ``step_000001.rfs`` and a folder ``old/``)::

    local_names("/run/steps", "")  -> [Listed("old", 1.7e9, folder=True),
                                       Listed("step_000001.rfs", 1.7e9)]
"""

from __future__ import annotations

import calendar
import errno
import os
import time

from rollfeed.payload.errors import PayloadMissingFileError, PayloadPathError
from rollfeed.payload.stores.object_client import ObjectClient
from rollfeed.payload.stores.safe_open import open_parent_beneath
from rollfeed.payload.stores.store import Listed

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def local_names(root: str, folder: str, after: str = "") -> list[Listed]:
    """The entries of folder ``folder`` (``""``: the root itself) of the directory ``root``
    whose names sort after ``after``, sorted by name."""
    where = os.path.join(root, folder) if folder else root
    try:
        if folder:
            parent, name = open_parent_beneath(root, folder)
            try:
                fd = os.open(name, _DIR, dir_fd=parent)
            finally:
                os.close(parent)
        else:
            fd = os.open(root, _DIR & ~os.O_NOFOLLOW)
    except FileNotFoundError:
        raise PayloadMissingFileError(f"directory {where} does not exist", file=folder) from None
    except OSError as err:
        what = "a symlink or not a directory" if err.errno in (errno.ELOOP, errno.ENOTDIR) else ""
        raise PayloadPathError(
            f"{where} cannot be listed: {what or err.strerror}", file=folder or "."
        ) from None
    found = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.name <= after:  # "" sorts before every name
                    continue
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                    is_dir = entry.is_dir(follow_symlinks=False)
                except FileNotFoundError:  # removed while listed
                    continue
                rel = f"{folder}/{entry.name}" if folder else entry.name
                found.append(Listed(rel, mtime, is_dir))
    finally:
        os.close(fd)
    return sorted(found, key=lambda e: e.rel)


def object_names(client: ObjectClient, folder: str, after: str = "") -> list[Listed]:
    """The keys directly under ``folder`` of the client's prefix, and its common prefixes (as
    folders), whose names sort after ``after``, sorted by name; every page of a bounded
    listing."""
    url = client.url
    base = "/".join(p for p in (url.prefix, folder) if p)
    prefix = f"{base}/" if base else ""
    signed = client.process().obstore.signed()
    where = client.where(folder) if folder else client.path
    found, token = [], None
    while True:
        query = {"list-type": "2", "prefix": prefix, "delimiter": "/"}
        if after:
            query["start-after"] = prefix + after
        if token:
            query["continuation-token"] = token
        tree = signed.xml("GET", "", what="LIST", where=where, query=query)
        for el in tree.iter(f"{_NS}Contents"):
            name = (el.findtext(f"{_NS}Key") or "")[len(prefix) :]
            if name:
                found.append(Listed(_rel(folder, name), _mtime(el.findtext(f"{_NS}LastModified"))))
        for el in tree.iter(f"{_NS}CommonPrefixes"):
            name = (el.findtext(f"{_NS}Prefix") or "")[len(prefix) :].rstrip("/")
            if name:
                found.append(Listed(_rel(folder, name), 0.0, True))
        token = tree.findtext(f"{_NS}NextContinuationToken")
        if tree.findtext(f"{_NS}IsTruncated") != "true" or not token:
            return sorted(found, key=lambda e: e.rel)


def _rel(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _mtime(text: str | None) -> float:
    """Seconds since the epoch of an S3 ``LastModified`` (``2025-01-02T03:04:05.000Z``)."""
    try:
        return float(calendar.timegm(time.strptime((text or "")[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return 0.0
