"""Where a :class:`~rollfeed.payload.write.writer.PayloadWriter` puts its bytes on an object store.

On a local root a writer appends each ``write()`` to its one file. An object cannot be appended
to, and a PUT is atomic, so on an object store each ``write()`` (one request's arrays) is one new
object, ``<group>/<name>-<n>.rfp`` (``n`` counting that writer's writes from 1), with its own file
header and its own random file id; the writer returns its records only after the PUT returns, so
a crashed writer leaves nothing visible and nothing half-written. A body of ``multipart_bytes``
or more is uploaded in parts (several in flight); a writer killed mid-upload leaves an
*incomplete multipart upload*, invisible to readers, which ``prune`` aborts. The PUT is
preceded by a lookup of the key and, for a single PUT, conditional too (``If-None-Match: *``,
which closes the race on stores that honour it, as S3 and SeaweedFS 4.48 do: 412 for the second
of two writers, measured here with one winner in each of 70 races; a multipart upload is not
conditional, so the lookup alone guards it): a second writer with the same name (or a forked
child still counting from its parent's number) does not overwrite an object that records
already point at.

Example (names of one writer of group ``step_000001`` named ``w0``)::

    w.write(...)  -> records of step_000001/w0-000001.rfp
    w.write(...)  -> records of step_000001/w0-000002.rfp
"""

from __future__ import annotations

import logging

from rollfeed.payload.format.layout import FILE_HEADER, new_file_id
from rollfeed.payload.stores.object_root import ObjectRoot

log = logging.getLogger(__name__)
MULTIPART_BYTES = 8 << 20  # bodies this large go up in parts


class ObjectSink:
    """One object per write of a writer whose handle is ``file`` (``<group>/<name>.rfp``)."""

    def __init__(self, root: ObjectRoot, file: str, *, multipart_bytes: int = MULTIPART_BYTES):
        self.root, self.stem = root, file.removesuffix(".rfp")
        self.multipart_bytes = multipart_bytes
        self.count = 0

    def next_object(self) -> tuple[str, int]:
        """Handle and file id of the next write's object."""
        self.count += 1
        return f"{self.stem}-{self.count:06d}.rfp", new_file_id()

    def put(self, rel: str, bufs: list[memoryview]) -> int:
        """PUT ``bufs`` (file header first) as object ``rel``; returns the offset of the first
        region (the file header's size), as an append at the start of a file does."""
        data = b"".join(bufs)
        large = len(data) >= self.multipart_bytes
        client = self.root._proc().client
        client.put(
            self.root.url.key(rel), data, multipart=large, where=self.root.where(rel), rel=rel
        )
        log.debug("put %s (%d bytes, multipart=%s)", rel, len(data), large)
        return FILE_HEADER.size


def object_sink(root: object, file: str) -> ObjectSink | None:
    """The sink of a writer on ``root``: ``None`` for a local root (the writer appends)."""
    return ObjectSink(root, file) if isinstance(root, ObjectRoot) else None
