"""Media by handle: encoded bytes written once under the payload root, named by their SHA-256.

:class:`MediaWriter` stores bytes at ``media/<sha256>`` (:class:`~rollfeed.payload.media.records.
MediaRef`) and returns the handle. Content addressing makes the bytes count once:

- within a writer: bytes it stored or found before are not looked up or sent again (a GRPO
  group of 16 samples of one prompt image costs one write and 15 digests);
- across writers and steps: the name is the digest, so a second writer finds the file there
  and leaves it (``link``/conditional PUT: a name is never written twice; the losing writer of a
  race counts the image as present).

:func:`read_media` reads a handle's bytes back whole, bounded before anything is read (a file
whose size is not the handle's is :class:`~rollfeed.payload.errors.PayloadTruncatedError`, a
handle above the root's ``max_output_bytes`` :class:`~rollfeed.payload.errors.
PayloadOutputBoundError`), and checks their digest
(:class:`~rollfeed.payload.errors.PayloadMediaError`): a flipped byte never reaches a processor.

Worked example (16 samples of one group share an image of 5,310 bytes)::

    writer = MediaWriter(root)
    refs = [writer.put(png) for _ in range(16)]       # 16 equal handles
    writer.metrics -> {"media_puts": 16, "media_stored": 1, "media_present": 0,
                       "media_repeated": 15, "media_bytes_stored": 5310}

Media files outlive any one step: pruning a step's group leaves them (another step may name
them).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter

from rollfeed.payload.errors import PayloadMediaError, PayloadOutputBoundError
from rollfeed.payload.media.records import MediaRef
from rollfeed.payload.root import PayloadRoot, as_root

_METRICS = ("media_puts", "media_stored", "media_present", "media_repeated", "media_bytes_stored")


class MediaWriter:
    """Writes media bytes once under ``root``; see the module doc. Thread-safe and picklable
    (a pickled writer starts with no memory of what its original stored)."""

    def __init__(self, root: PayloadRoot | str | os.PathLike[str]) -> None:
        self.root = as_root(root)
        self._known: set[str] = set()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"root": self.root}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"])  # type: ignore[misc]

    def put(self, data: bytes | bytearray | memoryview) -> MediaRef:
        """The handle of ``data``, stored under the root unless it is there already."""
        data = bytes(data)
        ref = MediaRef.of(data)
        with self._lock:
            self._counts["media_puts"] += 1
            if ref.sha256 in self._known:
                self._counts["media_repeated"] += 1
                return ref
        wrote = self.root.store.put_blob(ref.file, data)
        with self._lock:
            self._known.add(ref.sha256)
            if wrote:
                self._counts["media_stored"] += 1
                self._counts["media_bytes_stored"] += ref.size
            else:
                self._counts["media_present"] += 1
        return ref

    @property
    def metrics(self) -> dict[str, int]:
        """``media_puts`` (calls), ``media_stored`` (files this writer wrote),
        ``media_present`` (found stored by another writer), ``media_repeated`` (already stored
        or found by this writer) and ``media_bytes_stored``."""
        with self._lock:
            return {k: self._counts[k] for k in _METRICS}


def read_media(root: PayloadRoot | str | os.PathLike[str], ref: MediaRef) -> bytes:
    """The bytes of ``ref``, read whole and checked against its size and digest (see the module
    doc for the errors)."""
    root = as_root(root)
    if ref.size > root.max_output_bytes:
        raise PayloadOutputBoundError(
            f"media of {ref.size} bytes exceeds max_output_bytes={root.max_output_bytes}; "
            "nothing was read",
            file=ref.file,
        )
    data = root.store.get_blob(ref.file, root.retry, size=ref.size)
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise PayloadMediaError(
            f"media bytes hash to {digest}, not the handle's digest: the file was altered after "
            "it was written",
            file=ref.file,
        )
    return data
