"""The writer: inference writes each request's side channels once and gets segment records back.

Each :class:`PayloadWriter` owns one file, ``<root>/<group>/<name>.rfp``, appended to region by
region; several writers (threads, processes, hosts) never share a file. Files of one group (e.g.
one training step, ``group="step_000042"``) are pruned together with ``PayloadRoot.prune(group)``.

A segment is returned only after its bytes are written (visible to every process through the page
cache) and, with ``fsync="always"``, durable. Readers therefore never see a segment whose bytes are
incomplete: the record does not exist before its bytes do.

Example::

    with PayloadWriter(root, group="step_000001") as w:
        segs = w.write({"routed_experts": experts,            # [T - 1, layers, top_k], ids < 256
                        "sampling_mask": (counts, ids)},       # counts [C], ids [sum(counts)]
                       pos={"routed_experts": 0, "sampling_mask": prompt_len})
    # routed_experts is stored as uint8; sampling_mask as a CSR region (layout.py)
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from typing import Literal

import numpy as np

from rollfeed.payload.errors import PayloadInputError, PayloadPathError
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.layout import (
    BLOCK_ROWS,
    KIND_FIXED,
    KIND_RAGGED,
    RegionHeader,
    file_header,
    ragged_bytes,
    values_start,
)
from rollfeed.payload.root import PayloadRoot, as_root
from rollfeed.payload.segment import PayloadSegment, RaggedLayout

FieldArray = np.ndarray | tuple[np.ndarray, np.ndarray]
_INT_STORAGE = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64")


def compact_int_dtype(lo: int, hi: int) -> np.dtype:
    """The smallest integer dtype that holds ``[lo, hi]`` (routing ids < 256 with fill 0: uint8)."""
    for name in _INT_STORAGE:
        info = np.iinfo(name)
        if info.min <= lo and hi <= info.max:
            return np.dtype(name)
    raise PayloadInputError(f"integer values in [{lo}, {hi}] do not fit int64")


class PayloadWriter:
    """Appends regions to its own payload file and returns their segment records.

    ``fsync``: ``"always"`` makes each write durable before its segments are returned; ``"never"``
    leaves durability to the OS (bytes are still visible to readers at once).
    ``dtypes``: per-field stored dtype for fixed-width fields, overriding the compact choice (e.g.
    ``{"routed_experts": "uint16"}`` for a model with more than 256 experts, so every request of a
    run stores the same dtype).
    """

    def __init__(
        self,
        root: PayloadRoot | str | os.PathLike[str],
        *,
        group: str = "",
        name: str | None = None,
        fsync: Literal["always", "never"] = "never",
        fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
        dtypes: Mapping[str, str] | None = None,
    ) -> None:
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', got {fsync!r}")
        self.root = as_root(root)
        self.file = (
            os.path.join(group, f"{name or uuid.uuid4().hex}.rfp")
            if group
            else f"{name or uuid.uuid4().hex}.rfp"
        )
        self.root.resolve(self.file)  # refuse a group or name that escapes the root, up front
        self.fsync, self.fields, self.dtypes = fsync, fields, dict(dtypes or {})
        self._fd: int | None = None
        self._pid: int | None = None
        self._size = 0
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> PayloadWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None
            self._closed = True

    def _append(self, blob: bytes) -> int:
        """Append ``blob``; return its file offset. Caller holds the lock."""
        if self._fd is None or self._pid != os.getpid():
            full = self.root.resolve(self.file)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            if self._closed:
                raise ValueError(f"PayloadWriter for {self.file} is closed")
            # O_EXCL: a second writer (or a forked child) never appends to someone else's file.
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            try:
                self._fd = os.open(full, flags, 0o644)
            except FileExistsError:
                raise PayloadPathError(
                    "payload file already exists: each writer (and process) needs its own name",
                    file=self.file,
                ) from None
            self._pid = os.getpid()
            head = file_header()
            os.write(self._fd, head)
            self._size = len(head)
        offset, view = self._size, memoryview(blob)
        while view:
            view = view[os.pwrite(self._fd, view, offset + len(blob) - len(view)) :]
        self._size += len(blob)
        return offset

    def write(
        self, arrays: Mapping[str, FieldArray], pos: int | Mapping[str, int]
    ) -> list[PayloadSegment]:
        """Write one region per field and return one segment per field, in ``arrays`` order.

        ``arrays[name]``: fixed width ``[rows, *shape]`` or ragged ``(counts[rows], values[sum])``.
        ``pos``: first token position of every field, or one per field.
        """
        regions = []
        for name, arr in arrays.items():
            field = lookup_field(name, self.fields)
            first = pos if isinstance(pos, int) else pos.get(name)
            if first is None or first < 0:
                raise PayloadInputError(
                    f"write needs a position >= 0 for field {name!r}, got {first}", field=name
                )
            encode = self._encode_ragged if field.ragged else self._encode_fixed
            regions.append((name, first, *encode(name, field, arr)))
        segments = []
        with self._lock:
            for name, first, header, body, shape in regions:
                offset = self._append(header.pack() + body) + header.size
                layout = None
                if header.kind == KIND_RAGGED:
                    layout = RaggedLayout(
                        rows=header.rows,
                        values=header.values,
                        count_bytes=header.count_bytes,
                        block_rows=header.block_rows,
                    )
                segments.append(
                    PayloadSegment(
                        field=name,
                        file=self.file,
                        offset=offset,
                        pos=first,
                        rows=header.rows,
                        dtype=header.dtype,
                        shape=shape,
                        ragged=layout,
                    )
                )
            if self.fsync == "always" and self._fd is not None:
                os.fsync(self._fd)
        return segments

    def _encode_fixed(
        self, name: str, field: PayloadField, arr: FieldArray
    ) -> tuple[RegionHeader, bytes, tuple]:
        if isinstance(arr, tuple) or not isinstance(arr, np.ndarray) or arr.ndim < 1:
            raise PayloadInputError(
                f"fixed-width field {name!r} needs an ndarray [rows, *shape]", field=name
            )
        if field.is_int != (arr.dtype.kind in "iu") or arr.dtype.kind not in "iuf":
            kind = "integer" if field.is_int else "float"
            raise PayloadInputError(
                f"field {name!r} holds {kind} values, got dtype {arr.dtype}", field=name
            )
        if name in self.dtypes:
            dtype = np.dtype(self.dtypes[name])
            if (
                arr.size
                and field.is_int
                and not (np.iinfo(dtype).min <= arr.min() and arr.max() <= np.iinfo(dtype).max)
            ):
                raise PayloadInputError(
                    f"field {name!r} values [{arr.min()}, {arr.max()}] do not fit {dtype}",
                    field=name,
                )
        elif field.is_int:
            lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (field.fill, field.fill)
            dtype = compact_int_dtype(min(lo, int(field.fill)), max(hi, int(field.fill)))
        else:
            dtype = arr.dtype
        body = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<")).tobytes()
        header = RegionHeader(
            field=name,
            kind=KIND_FIXED,
            count_bytes=0,
            dtype=dtype.name,
            block_rows=0,
            rows=len(arr),
            values=arr.size,
            body_bytes=len(body),
        )
        return header, body, tuple(int(d) for d in arr.shape[1:])

    def _encode_ragged(
        self, name: str, field: PayloadField, arr: FieldArray
    ) -> tuple[RegionHeader, bytes, tuple]:
        if not (isinstance(arr, tuple) and len(arr) == 2):
            raise PayloadInputError(
                f"ragged field {name!r} needs a (counts, values) pair", field=name
            )
        counts, values = (np.asarray(a) for a in arr)
        if values.size and field.is_int != (values.dtype.kind in "iu"):
            kind = "integer" if field.is_int else "float"
            raise PayloadInputError(
                f"field {name!r} holds {kind} values, got dtype {values.dtype}", field=name
            )
        try:
            body, count_bytes = ragged_bytes(
                counts, values, dtype=field.ragged_dtype, block_rows=BLOCK_ROWS
            )
        except PayloadInputError as err:
            raise err.with_place(field=name) from None
        assert len(body) == values_start(counts.size, count_bytes, BLOCK_ROWS) + values.size * 4
        header = RegionHeader(
            field=name,
            kind=KIND_RAGGED,
            count_bytes=count_bytes,
            dtype=field.ragged_dtype.name,
            block_rows=BLOCK_ROWS,
            rows=counts.size,
            values=values.size,
            body_bytes=len(body),
        )
        return header, body, ()
