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
from collections.abc import Callable

from rollfeed.payload.format.layout import FILE_HEADER, file_header, new_file_id
from rollfeed.payload.stores.object_client import ObjectClient

log = logging.getLogger(__name__)
MULTIPART_BYTES = 8 << 20  # bodies this large go up in parts


class ObjectSink:
    """One object per write of a writer whose handle is ``file`` (``<group>/<name>.rfp``).
    ``file_id`` is 0 until the first write (each object has its own); ``restarts`` stays 0 (an
    object is never lost under its writer)."""

    def __init__(self, client: ObjectClient, file: str, *, multipart_bytes: int = MULTIPART_BYTES):
        self.client, self.file, self.stem = client, file, file.removesuffix(".rfp")
        self.multipart_bytes = multipart_bytes
        self.count = self.file_id = self.restarts = 0

    def put(self, packed: Callable[[int], tuple[list[memoryview], list[int]]]) -> list[int]:
        """The regions ``packed(file_id)`` lays out, PUT as the next object of this writer
        (``file``, with a fresh ``file_id``; the file header first); their body offsets."""
        self.count += 1
        self.file, self.file_id = f"{self.stem}-{self.count:06d}.rfp", new_file_id()
        bufs, offsets = packed(self.file_id)
        self._put(self.file, [memoryview(file_header(self.file_id)), *bufs])
        return [FILE_HEADER.size + o for o in offsets]

    def close(self) -> None:
        """Nothing held between writes."""

    def _put(self, rel: str, bufs: list[memoryview]) -> None:
        data = b"".join(bufs)
        large = len(data) >= self.multipart_bytes
        self.client.process().obstore.put(
            self.client.url.key(rel), data, multipart=large, where=self.client.where(rel), rel=rel
        )
        log.debug("put %s (%d bytes, multipart=%s)", rel, len(data), large)
