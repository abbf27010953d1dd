"""The writer: inference writes each request's side channels once and gets segment records back.

Each :class:`PayloadWriter` owns one file, ``<root>/<group>/<name>.rfp``, appended to region by
region; several writers (threads, processes, hosts) never share a file. Files of one group (e.g.
one training step, ``group="step_000042"``) are pruned together with ``PayloadRoot.prune(group)``.

A segment is returned only after its bytes are written (visible to every process through the page
cache) and, with ``fsync="always"``, durable. Readers therefore never see a segment whose bytes are
incomplete: the record does not exist before its bytes do. One ``write`` is one ``pwritev`` of all
its regions (the file header too, on the first); when it fails (disk full, I/O error) the file is
cut back to its last complete write, no record is returned, the error
(:class:`~rollfeed.payload.errors.PayloadIOError`) names the file, and the next ``write`` starts
again from there, file header included when nothing was written yet.

The file is created beneath the root without following any symlink, with a random file id that
its header, every region header and every record carry (:mod:`rollfeed.payload.format.layout`). A
record never names bytes nobody can read: when the writer's file was unlinked (its group pruned)
or replaced at its path, the write goes to a fresh file ``<name>-<k>.rfp`` instead
(:mod:`rollfeed.payload.write.file_sink`; counted in :attr:`PayloadWriter.restarts`, logged as a
warning). On an object store each write is an object of its own
(:mod:`rollfeed.payload.write.object_writer`). Each region body is followed by its checksum table
(CRC-32C per block, :mod:`rollfeed.payload.format.checksum`), computed here from the bytes about to
be written.

Kept-set fields (``PayloadField.label``) are written in their canonical order, the sampled token
first then the other ids ascending (:mod:`rollfeed.payload.format.label_rows`); the writer is given
the sampled tokens (``sampled=``), checks that each row holds its own, and stores a
``label="omitted"`` field without it.

Example::

    with PayloadWriter(root, group="step_000001") as w:
        segs = w.write({"routed_experts": experts,            # [T - 1, layers, top_k], ids < 256
                        "sampling_mask": (counts, ids)},       # counts [C], ids [sum(counts)]
                       pos={"routed_experts": 0, "sampling_mask": prompt_len},
                       sampled=completion_ids)                 # [C], each in its kept set
    # routed_experts is stored as uint8; sampling_mask as a CSR region of the ids other than
    # the sampled one, at 3 bytes an id for a vocabulary below 2**24 (layout.py)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np

from rollfeed.payload.errors import PayloadDtypeError, PayloadInputError, PayloadIOError
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.format.checksum import fixed_block_rows, fixed_table, ragged_table
from rollfeed.payload.format.label_rows import canonical_arrays
from rollfeed.payload.format.layout import (
    BLOCK_ROWS,
    DTYPE_SIZES,
    KIND_FIXED,
    KIND_RAGGED,
    LABEL_OMITTED,
    MAX_NDIM,
    RegionHeader,
    file_header,
    ragged_bytes,
    values_start,
)
from rollfeed.payload.format.values import value_dtype
from rollfeed.payload.read.checks import stored_kinds
from rollfeed.payload.root import PayloadRoot, as_root
from rollfeed.payload.segment import STORED_DTYPES, PayloadSegment, RaggedLayout
from rollfeed.payload.stores.safe_open import handle_parts
from rollfeed.payload.write.file_sink import FileSink
from rollfeed.payload.write.object_writer import object_sink

FieldArray = np.ndarray | tuple[np.ndarray, np.ndarray]
TableFn = Callable[[bytes, memoryview], bytes]  # checksum table from header+name and body
_INT_STORAGE = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64")
_MAX_ROW = 1 << 24  # elements in one fixed-width row (what a reader accepts)
# Fresh files one write may start because its file went while it wrote (a prune running
# on a live group) before it gives up.
_FRESH_FILES = 3
log = logging.getLogger(__name__)


def compact_int_dtype(lo: int, hi: int) -> np.dtype:
    """The smallest integer dtype that holds ``[lo, hi]`` (routing ids < 256 with fill 0: uint8)."""
    for name in _INT_STORAGE:
        info = np.iinfo(name)
        if info.min <= lo and hi <= info.max:
            return np.dtype(name)
    raise PayloadInputError(f"integer values in [{lo}, {hi}] do not fit int64")


def _stored_dtypes(dtypes: Mapping[str, str], fields: Mapping[str, PayloadField]) -> dict[str, str]:
    """Check a ``dtypes=`` override: each a stored dtype its (fixed-width) field reads back."""
    out = {}
    for name, want in dtypes.items():
        field = lookup_field(name, fields)
        try:
            dtype = np.dtype(want)
        except TypeError:
            dtype = None
        kinds = sorted(stored_kinds(field))
        problem = None
        if field.ragged:
            problem = f"ragged fields store {kinds[0]} values; drop the override"
        elif dtype is None or dtype.name not in kinds:
            problem = f"a {type(field.fill).__name__}-fill field stores one of {kinds}"
        elif dtype.kind in "iu" and not np.iinfo(dtype).min <= field.fill <= np.iinfo(dtype).max:
            problem = (
                f"it cannot hold the field's fill {field.fill}, which reads back uncovered rows"
            )
        if problem:
            raise PayloadDtypeError(
                f"PayloadWriter dtypes={{{name!r}: {want!r}}} cannot be read back: {problem}",
                field=name,
            )
        out[name] = dtype.name
    return out


def _byte_view(body: np.ndarray | bytes) -> memoryview:
    """The bytes of a region body, without a copy (an empty array included)."""
    if isinstance(body, np.ndarray):
        return memoryview(body.reshape(-1).view(np.uint8))
    return memoryview(body)


class PayloadWriter:
    """Appends regions to its own payload file and returns their segment records.

    ``fsync``: ``"always"`` makes each write durable before its segments are returned; ``"never"``
    leaves durability to the OS (bytes are still visible to readers at once).
    ``dtypes``: per-field stored dtype for fixed-width fields, overriding the compact choice (e.g.
    ``{"routed_experts": "uint16"}`` for a model with more than 256 experts, so every request of a
    run stores the same dtype). Checked here: it must be a dtype the field reads back (integer
    for an int fill, float for a float fill, holding the fill); else :class:`PayloadDtypeError`.
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
            raise PayloadInputError(f"fsync must be 'always' or 'never', got {fsync!r}")
        self.root = as_root(root)
        self.file = (
            os.path.join(group, f"{name or uuid.uuid4().hex}.rfp")
            if group
            else f"{name or uuid.uuid4().hex}.rfp"
        )
        handle_parts(self.root.path, self.file)  # refuse a group or name that escapes the root
        self.fsync, self.fields = fsync, fields
        self.dtypes = _stored_dtypes(dtypes or {}, fields)
        self._objects = object_sink(self.root, self.file)  # an object store: one object per write
        self._local = (
            FileSink(self.root.path, self.file, fsync=fsync == "always")
            if self._objects is None
            else None
        )
        self.file_id = self._local.file_id if self._local is not None else 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def restarts(self) -> int:
        """Fresh files this writer started because its file was unlinked or replaced (a local
        root; 0 on an object store, where every write is an object of its own)."""
        return self._local.restarts if self._local is not None else 0

    def __enter__(self) -> PayloadWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._local is not None:
                self._local.close()
            self._closed = True

    def _put(self, packed: Callable[[int], tuple[list[memoryview], list[int]]]) -> list[int]:
        """Write the regions ``packed(file_id)`` lays out; the offset of each region body.

        Sets ``file`` and ``file_id`` to where they went. Caller holds the lock.
        """
        if self._closed:
            raise PayloadInputError(f"PayloadWriter for {self.file} is closed", file=self.file)
        if self._objects is not None:
            self.file, self.file_id = self._objects.next_object()
            bufs, offsets = packed(self.file_id)
            base = self._objects.put(self.file, [memoryview(file_header(self.file_id)), *bufs])
            return [base + o for o in offsets]
        local = self._local
        for _ in range(_FRESH_FILES):
            bufs, offsets = packed(local.file_id)
            base = local.append(bufs)
            if local.still_named():
                self.file, self.file_id = local.file, local.file_id
                return [base + o for o in offsets]
            gone = local.file
            local.start_fresh_file()
            log.warning(
                "payload file %s under %s was unlinked or replaced (its group pruned?); writing "
                "to a fresh file %s",
                gone,
                self.root.path,
                local.file,
            )
        self.file, self.file_id = local.file, local.file_id
        raise PayloadIOError(
            f"the payload file was removed while it was written, {_FRESH_FILES} times in a row; "
            "no record was returned (prune a group only after its last write)",
            file=gone,
        )

    def write(
        self,
        arrays: Mapping[str, FieldArray],
        pos: int | Mapping[str, int],
        *,
        sampled: np.ndarray | None = None,
    ) -> list[PayloadSegment]:
        """Write one region per field and return one segment per field, in ``arrays`` order.

        ``arrays[name]``: fixed width ``[rows, *shape]`` or ragged ``(counts[rows], values[sum])``.
        ``pos``: first token position of every field, or one per field.
        ``sampled``: ``[rows]`` the sampled token of each row of the kept-set fields
        (``PayloadField.label``; needed when one is written), each a member of its row's ids.
        """
        arrays = canonical_arrays(arrays, sampled, self.fields)
        regions = []
        for name, arr in arrays.items():
            field = lookup_field(name, self.fields)
            first = pos if isinstance(pos, int | np.integer) else pos.get(name)
            if isinstance(first, bool) or not isinstance(first, int | np.integer) or first < 0:
                raise PayloadInputError(
                    f"write needs an integer position >= 0 for field {name!r}, got {first!r}",
                    field=name,
                )
            encode = self._encode_ragged if field.ragged else self._encode_fixed
            regions.append((name, int(first), *encode(name, field, arr)))
        segments: list[PayloadSegment] = []
        if not regions:
            return segments

        def packed(file_id: int) -> tuple[list[memoryview], list[int]]:
            bufs, offsets, at = [], [], 0
            for _, _, header, body, _, table in regions:
                head = dataclasses.replace(header, file_id=file_id).pack()
                view = _byte_view(body)
                bufs += [memoryview(head), view, memoryview(table(head, view))]
                offsets.append(at + len(head))
                at += sum(len(b) for b in bufs[-3:])
            return bufs, offsets

        with self._lock:
            offsets = self._put(packed)
            for (name, first, header, _, shape, _), offset in zip(regions, offsets, strict=True):
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
                        file_id=self.file_id,
                    )
                )
        return segments

    def _encode_fixed(
        self, name: str, field: PayloadField, arr: FieldArray
    ) -> tuple[RegionHeader, np.ndarray, tuple, TableFn]:
        if isinstance(arr, tuple) or not isinstance(arr, np.ndarray) or arr.ndim < 1:
            raise PayloadInputError(
                f"fixed-width field {name!r} needs an ndarray [rows, *shape]", field=name
            )
        if field.is_int != (arr.dtype.kind in "iu") or arr.dtype.kind not in "iuf":
            kind = "integer" if field.is_int else "float"
            raise PayloadInputError(
                f"field {name!r} holds {kind} values, got dtype {arr.dtype}", field=name
            )
        shape = tuple(int(d) for d in arr.shape[1:])
        if len(shape) > MAX_NDIM or min(shape, default=1) < 1 or np.prod(shape) >= _MAX_ROW:
            raise PayloadInputError(
                f"field {name!r} rows of shape {shape}: a row needs at most {MAX_NDIM} dims, "
                f"each >= 1, and fewer than {_MAX_ROW} elements",
                field=name,
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
        elif arr.dtype.name in STORED_DTYPES:
            dtype = arr.dtype
        else:
            raise PayloadInputError(
                f"field {name!r}: dtype {arr.dtype} is not a stored dtype "
                f"({sorted(stored_kinds(field))}); cast it first",
                field=name,
            )
        body = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<"))
        row_bytes = dtype.itemsize * math.prod(shape)
        header = RegionHeader(
            field=name,
            kind=KIND_FIXED,
            count_bytes=0,
            dtype=dtype.name,
            block_rows=fixed_block_rows(row_bytes),
            rows=len(arr),
            values=arr.size,
            body_bytes=body.nbytes,
            shape=shape,
        )
        return header, body, shape, lambda head, view: fixed_table(head, view, len(arr), row_bytes)

    def _encode_ragged(
        self, name: str, field: PayloadField, arr: FieldArray
    ) -> tuple[RegionHeader, bytes, tuple, TableFn]:
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
        dtype = value_dtype(values, field.is_int)
        try:
            body, count_bytes = ragged_bytes(counts, values, dtype=dtype, block_rows=BLOCK_ROWS)
        except PayloadInputError as err:
            raise err.with_place(field=name) from None
        size = DTYPE_SIZES[dtype]
        assert len(body) == values_start(counts.size, count_bytes, BLOCK_ROWS) + values.size * size
        header = RegionHeader(
            field=name,
            kind=KIND_RAGGED,
            count_bytes=count_bytes,
            dtype=dtype,
            block_rows=BLOCK_ROWS,
            rows=counts.size,
            values=values.size,
            body_bytes=len(body),
            shape=(),
            flags=LABEL_OMITTED if field.label == "omitted" else 0,
        )
        return (
            header,
            body,
            (),
            lambda head, view: ragged_table(head, view, counts, count_bytes, BLOCK_ROWS, size),
        )
