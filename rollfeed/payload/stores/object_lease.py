"""A lease over objects: the objects of one read, and the ranged GETs that read them.

The object-store counterpart of :class:`~rollfeed.payload.stores.lease.Lease`, with the same columns
(``size``, ``version``, ``file_id``, ``header_size`` ``[F]``) and the same
:meth:`ObjectLease.read` of a :class:`~rollfeed.payload.stores.lease.Reads` batch, so every read
plan runs unchanged over it. The ranges of all the fields of a micro batch are grouped per object,
ranges of an object at most ``merge_gap`` bytes apart are merged into one ``[start, end)`` span
(the regions one request wrote lie side by side in its object, so the common case is one GET per
object), and the spans are fetched concurrently (at most ``concurrency`` in flight), each with
``If-Match`` on the ETag seen at open. A span that comes back short is
:class:`PayloadTruncatedError` naming the object's real size.

Worked example: ranges ``(obj 0, 64, 100)``, ``(obj 0, 164, 50)``, ``(obj 1, 64, 10)`` with a
gap of 4096 become two GETs: ``obj 0 [64, 214)`` and ``obj 1 [64, 74)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rollfeed.payload.errors import PayloadStaleFileError, PayloadTruncatedError
from rollfeed.payload.stores.lease import Reads

if TYPE_CHECKING:
    from rollfeed.payload.stores.object_root import ObjectRoot


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectEntry:
    """One opened object: handle, key, ETag and the lease columns
    ``(size, version, file_id, header_size)``."""

    rel: str
    key: str
    etag: str | None
    columns: tuple[int, int, int, int]


def merge_spans(
    file_idx: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, gap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Spans covering ranges ``[K]`` sorted by (file, offset): ``(span_of [K], span_file [P],
    span_start [P], span_end [P])``; a range starts a new span when it is in another file or
    lies more than ``gap`` bytes after the span's end so far."""
    span_of = np.empty(len(offsets), np.int64)
    sfile: list[int] = []
    sstart: list[int] = []
    send: list[int] = []
    for k, (f, a, n) in enumerate(
        zip(file_idx.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ):
        if not sfile or f != sfile[-1] or a > send[-1] + gap:
            sfile.append(f)
            sstart.append(a)
            send.append(a + n)
        else:
            send[-1] = max(send[-1], a + n)
        span_of[k] = len(sfile) - 1
    return span_of, np.array(sfile, np.int64), np.array(sstart, np.int64), np.array(send, np.int64)


class ObjectLease:
    """Objects held for one read (their cached size, ETag and header; no descriptors)."""

    def __init__(self, root: ObjectRoot, files: Sequence[str]) -> None:
        self.root, self.files = root, files
        self.entries, self.first = root.acquire(files)
        self.requests = 0  # GETs issued by read(): what the benchmark counts
        self._columns()

    def _columns(self) -> None:
        cols = np.array([e.columns for e in self.entries], np.int64).reshape(-1, 4).T.copy()
        self.size, self.version, self.file_id, self.header_size = cols

    def __enter__(self) -> ObjectLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.entries, self.first = [], {}

    def index(self, rel: str | None) -> int | None:
        return self.files.index(rel) if rel in self.files else None

    def refresh(self, idx: np.ndarray) -> None:
        """Look objects ``idx`` up again. An object is immutable, so one that now looks
        different (ETag, size or file header) is another object under the key: everything the
        read checked so far (file ids, sizes) was checked against the old one, so it is
        :class:`PayloadStaleFileError` (the root's policy reopens the key once and reads again
        from the start, holding every record to the new object's header)."""
        changed = None
        for i in np.unique(idx).tolist():
            old = self.entries[i]
            self.entries[i], self.first[i] = self.root.replace(old)
            if changed is None and (self.entries[i].etag, self.entries[i].columns) != (
                old.etag,
                old.columns,
            ):
                changed = i
        self._columns()
        if changed is not None:
            entry = self.entries[changed]
            raise PayloadStaleFileError(
                f"object {self.root.where(entry.rel)} changed under its key while it was read "
                "(another ETag, size or file header)",
                file=entry.rel,
            )

    def reopen(self, i: int) -> None:
        self.entries[i], self.first[i] = self.root.replace(self.entries[i])
        self._columns()

    def read(self, reads: Reads) -> None:
        """Fetch every range of ``reads`` into its destination (see the module doc)."""
        order = np.lexsort((reads.offsets, reads.file_idx))
        order = order[reads.lengths[order] > 0]
        if not len(order):
            return
        fi, off, ln, di, do = (
            a[order]
            for a in (
                reads.file_idx,
                reads.offsets,
                reads.lengths,
                reads.dest_idx,
                reads.dest_offsets,
            )
        )
        span_of, sfile, sstart, send = merge_spans(fi, off, ln, self.root.merge_gap)
        proc = self.root._proc()
        results = proc.map(self._fetch, sfile.tolist(), sstart.tolist(), send.tolist())
        views = [memoryview(d.reshape(-1).view(np.uint8)) for d in reads.dests]
        rel_start = (off - sstart[span_of]).tolist()
        for s, d, a, b, n in zip(
            span_of.tolist(), di.tolist(), do.tolist(), rel_start, ln.tolist(), strict=True
        ):
            views[d][a : a + n] = memoryview(results[s])[b : b + n]

    def _fetch(self, f: int, start: int, end: int) -> memoryview:
        first = self.first.get(f)
        if first is not None and end <= len(first):  # fetched with the object's header
            return first[start:end]
        self.requests += 1
        entry = self.entries[f]
        where = self.root.where(entry.rel)
        client = self.root._proc().client
        got = client.get(entry.key, start, end, entry.etag, where=where, rel=entry.rel)
        if len(got.data) != end - start:
            raise PayloadTruncatedError(
                f"object {where} returned {len(got.data)} of bytes [{start}, {end}); it has "
                f"{got.size} bytes",
                file=entry.rel,
                offset=start,
            )
        return got.data
