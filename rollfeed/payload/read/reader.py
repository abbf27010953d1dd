"""The reader: a trainer rank reads back only its window of each field.

``read_fields(segments, {field: window, ...}, root=...)`` reads several fields of one micro batch
in one go and returns, per field, its values over the window and which window rows came from data
(:class:`FieldRead`). It checks every record before touching a byte
(:mod:`rollfeed.payload.read.checks`) and every byte range a record claims against the real file
size before allocating anything (:mod:`rollfeed.payload.read.regions`). Each field is planned as
NumPy columns (:mod:`rollfeed.payload.read.fixed_read`, :mod:`rollfeed.payload.read.ragged_read`)
and runs in steps; the ranges every field needs at a step (its bodies and, right before each body,
its region header) are read together: grouped per file, one ``preadv`` per contiguous range, files
issued concurrently (:class:`~rollfeed.payload.stores.local.Lease`). Every record read is held to
its region header before any byte is handed out. A fixed-width field takes one step (two when
checking); a ragged one two (index, then the values of clipped regions).

The common case (a local root, files of the current format, no checksum check) first goes to the
compiled read (:mod:`rollfeed.payload.read.compiled_read`), which makes the same checks in one
native pass and returns the same bytes, or declines; the planned read above is the fallback and the
authority: it reads what the compiled read declines and raises every typed error.

With ``PayloadRoot(..., verify_checksums=True)`` a read also checks the CRC-32C of every block it
reads (:mod:`rollfeed.payload.format.checksum`): the whole blocks around a window, nothing else; a
mismatch is :class:`~rollfeed.payload.errors.PayloadChecksumError` naming the file, the field, the
region and the block.

Worked example (routing ids, rows ``[T, 2]``; a segment covers positions 2..5; a mask segment
covers positions 1..3)::

    read_field(segs, "routed_experts", (0, 4), root=r)       -> uint8 [4, 2]:
        [[0, 0], [0, 0], [a2, b2], [a3, b3]]                  (positions 0, 1 read as fill 0)
    read_field(segs, "routed_experts", [(0, 1), (4, 6)], root=r) -> rows of positions 0, 4, 5
    got = read_fields(segs, {"routed_experts": (0, 4), "sampling_mask": (1, 5)}, root=r)
    got["routed_experts"].coverage -> [False, False, True, True]
    got["sampling_mask"].coverage  -> [True, True, False, False]   (positions 1, 2 of 1..4)

Ragged fields come back as :class:`~rollfeed.payload.RaggedRows` (``offsets [n + 1]``, ``values
[nnz]``): a covered row holds its stored values, an uncovered row is empty. A ``label="omitted"``
field (the sampling mask) holds each covered row's label slot first: the token ``labels=`` gives
for that row, or the fill. With ``width=`` they come back as ``[n, width]`` padded with the fill
instead, and a row of any record wider than ``width`` (the window's or not: every CP rank given
the same segments decides alike) is a :class:`~rollfeed.payload.PayloadWidthError`::

    got = read_fields(segs, {"sampling_mask": (1, 4)}, root=r, labels={"sampling_mask": tok})
    got["sampling_mask"].values   -> RaggedRows  offsets [0, 3, 4, 4]  values [t1, 3, 9, t2]
    got["sampling_mask"].widest   -> 3   (the records' widest row, its label slot included)
    read_field(segs, "sampling_mask", (1, 4), root=r, width=4)
        -> [[-1, 3, 9, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]]
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollfeed.payload.errors import PayloadError, PayloadInputError
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.ragged_rows import RaggedRows
from rollfeed.payload.read.checks import field_segments
from rollfeed.payload.read.compiled_read import read_compiled
from rollfeed.payload.read.fixed_read import FixedJob
from rollfeed.payload.read.ragged_read import RaggedJob
from rollfeed.payload.read.read_plan import FieldFiles
from rollfeed.payload.root import PayloadRoot, as_root
from rollfeed.payload.segment import PayloadSegment
from rollfeed.payload.stores.store import Reads, StoreLease

Window = tuple[int, int] | Sequence[tuple[int, int]]
_LABEL_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldRead:
    """One field over a window of ``n`` rows.

    ``values``: fixed width ``[n, *shape]`` at the stored dtype; ragged
    :class:`~rollfeed.payload.RaggedRows` of int32 / float32 values, or ``[n, width]`` when a
    width was given (module doc); ``coverage``: bool ``[n]``, True where a record's row was read,
    False where the field's fill stands (no record covers the position). Inline fields build the
    same coverage from the rows each sample carries
    (:func:`rollfeed.collate.to_tensor_micro_batch`). ``widest``: a ragged field's widest row
    among every row of its records (not only the window's), its label slot included; 0 for a
    fixed field.
    """

    values: torch.Tensor | RaggedRows
    coverage: torch.Tensor
    widest: int = 0


def _ranges(window: Window, field: str) -> list[tuple[int, int]]:
    ranges = (
        [window]
        if len(window) == 2 and all(isinstance(x, int | np.integer) for x in window)
        else window
    )
    out = [(int(lo), int(hi)) for lo, hi in ranges]  # type: ignore[misc]
    for lo, hi in out:
        if lo < 0 or hi < lo:
            raise PayloadInputError(
                f"window ranges need 0 <= lo <= hi, got ({lo}, {hi})", field=field
            )
    return out


def read_fields(
    segments: Sequence[PayloadSegment],
    windows: Mapping[str, Window],
    *,
    root: PayloadRoot | str | os.PathLike[str],
    width: int | None = None,
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
    labels: Mapping[str, np.ndarray | torch.Tensor] | None = None,
) -> dict[str, FieldRead]:
    """Read every field of ``windows`` over its own window from ``segments`` in one go.

    Args:
        segments: the records of any fields (a micro batch's, in micro-batch positions); each
            field reads those that carry it.
        windows: field name -> ``(lo, hi)`` or a list of ``(lo, hi)`` ranges, read in order
            (``n`` = total length); e.g. a CP rank's ``inputs`` window for routing and its
            ``labels`` window for the mask.
        root: the payload root (a path, or a :class:`PayloadRoot` for its read policy: retries,
            descriptor cache, threads, ``verify_checksums``).
        width: read every ragged field as ``[n, width]`` padded with its fill (default: as
            :class:`~rollfeed.payload.RaggedRows`).
        fields: the field registry.
        labels: ``label="omitted"`` field -> ``[n]`` integer tokens, one per window row: each
            covered row's label slot holds it (default: the fill).

    Returns ``{field: FieldRead}`` for each field of ``windows`` that some segment carries (a
    field no segment carries is left out). Errors are typed :class:`PayloadError`\\ s naming the
    file, field, byte offset and position.
    """
    if width is not None and (isinstance(width, bool) or width < 1):
        raise PayloadInputError(f"width must be >= 1 (or None), got {width}")
    proot = as_root(root)
    tokens = _labels(labels or {}, windows, fields)
    fast = _compiled(segments, windows, proot, width, fields, tokens)
    if fast is not None:
        return {
            name: FieldRead(
                values=_values(values, width, fields[name]),
                coverage=torch.from_numpy(covered),
                widest=widest,
            )
            for name, (values, covered, widest) in fast.items()
        }
    jobs: dict[str, FixedJob | RaggedJob] = {}
    for name, window in windows.items():
        spec = lookup_field(name, fields)
        t = field_segments(segments, name, spec)
        if t is None:
            continue
        ranges = _ranges(window, name)
        n = sum(hi - lo for lo, hi in ranges)
        try:
            bound = proot.max_output_bytes
            jobs[name] = (
                RaggedJob(t, ranges, n, name, spec, width, bound, tokens.get(name))
                if spec.ragged
                else FixedJob(t, ranges, n, name, spec, bound)
            )
        except PayloadError as err:
            raise err.with_place(field=name) from None
    files = list(dict.fromkeys(f for job in jobs.values() for f in _needed(job)))
    try:
        if files:
            out = proot.run(files, lambda lease: _drive(lease, jobs, proot.verify_checksums))
        else:  # only placeholders: nothing to open
            out = _drive(None, jobs, proot.verify_checksums)
    except PayloadError as err:
        if err.field is not None or err.file is None:
            raise
        owner = next((n for n, job in jobs.items() if err.file in _needed(job)), None)
        raise err.with_place(field=owner) from None
    reads = {}
    for name, job in jobs.items():
        if isinstance(job, FixedJob):
            values, widest = torch.from_numpy(out[name].reshape(job.n, *job.shape)), 0
        else:
            rows, widest = out[name]
            values = _values(rows, width, job.spec)
        reads[name] = FieldRead(
            values=values, coverage=torch.from_numpy(job.coverage), widest=widest
        )
    return reads


def read_field(
    segments: Sequence[PayloadSegment],
    field: str,
    window: Window,
    *,
    root: PayloadRoot | str | os.PathLike[str],
    width: int | None = None,
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
    dtype: torch.dtype | None = None,
    labels: np.ndarray | torch.Tensor | None = None,
) -> torch.Tensor | RaggedRows | None:
    """Read ``field`` over ``window`` from ``segments``: :func:`read_fields` for one field.

    window: ``(lo, hi)`` or a list of ``(lo, hi)`` ranges, read in order (n = total length).
    Returns fixed width ``[n, *shape]`` at the stored dtype (or ``dtype``); ragged
    :class:`~rollfeed.payload.RaggedRows` of int32 / float32 values (or ``dtype``), or ``[n,
    width]`` padded with fill; ``None`` when no segment carries the field. ``labels``: a
    ``label="omitted"`` field's token per window row, for each covered row's label slot.
    """
    got = read_fields(
        segments,
        {field: window},
        root=root,
        width=width,
        fields=fields,
        labels=None if labels is None else {field: labels},
    )
    if field not in got:
        return None
    values = got[field].values
    if dtype is None:
        return values
    if isinstance(values, RaggedRows):
        return values.with_values(values.values.to(dtype))
    return values.to(dtype)


def _compiled(segments, windows, root: PayloadRoot, width, fields, tokens):
    """The compiled read of the common case (:mod:`rollfeed.payload.read.compiled_read`), or
    ``None``: the planned read below then does it, and raises whatever is wrong."""
    try:
        ranges = {name: _ranges(window, name) for name, window in windows.items()}
    except PayloadError:
        return None
    return read_compiled(segments, ranges, root, width, fields, tokens)


def _labels(labels, windows, fields) -> dict[str, np.ndarray]:
    """``labels`` as int32 / int64 arrays, each ``[n]`` tokens for the ``n`` window rows of a
    ``label="omitted"`` field of ``windows`` (the readers refuse a covered row's label that does
    not fit the ids' int32)."""
    out = {}
    for name, tokens in labels.items():
        if name not in windows or lookup_field(name, fields).label != "omitted":
            raise PayloadInputError(
                "labels= gives the label slot of a label='omitted' field read here",
                field=name,
            )
        array = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise PayloadInputError(
                f"labels must be [n] integer tokens, got {array.dtype}{list(array.shape)}",
                field=name,
            )
        n = sum(hi - lo for lo, hi in _ranges(windows[name], name))
        if len(array) != n:
            raise PayloadInputError(
                f"labels holds {len(array)} tokens for {n} window rows", field=name
            )
        if array.dtype not in _LABEL_DTYPES:  # the readers take these as they are
            array = array.astype(np.int64)
        out[name] = np.ascontiguousarray(array)
    return out


def _values(values, width: int | None, spec: PayloadField) -> torch.Tensor | RaggedRows:
    """A read's values as handed out: fixed rows as they are, ragged ``(offsets, values)`` as
    RaggedRows (made sound by the reader: not checked again), padded to ``[n, width]`` when
    a width is given (every row already held to it)."""
    if not spec.ragged:
        return torch.from_numpy(values)
    rows = RaggedRows.trusted(torch.from_numpy(values[0]), torch.from_numpy(values[1]))
    return rows if width is None else rows.padded(width, fill=spec.fill)


def _needed(job: FixedJob | RaggedJob) -> list[str]:
    return [job.file_list[i] for i in job.files.tolist()]


def _drive(
    lease: StoreLease | None, jobs: Mapping[str, FixedJob | RaggedJob], check: bool
) -> dict[str, np.ndarray]:
    """Run every job's steps in lockstep: the reads all of them need at a step are one batch."""
    index = {f: i for i, f in enumerate(lease.files)} if lease is not None else {}
    running: dict[str, Generator[Reads, None, np.ndarray]] = {}
    for name, job in jobs.items():
        fmap = np.array([index.get(f, -1) for f in job.file_list], np.int64)
        running[name] = job.steps(FieldFiles(lease, fmap), check)
    results: dict[str, np.ndarray] = {}
    pending: dict[str, Reads] = {}

    def advance(name: str) -> None:
        try:
            pending[name] = next(running[name])
        except StopIteration as stop:
            results[name] = stop.value
        except PayloadError as err:
            raise err.with_place(field=name) from None

    for name in running:
        advance(name)
    while pending:
        batch = dict(pending)
        pending.clear()
        try:
            lease.read(Reads.concat(list(batch.values())))  # type: ignore[union-attr]
        except PayloadError as err:  # a failed run: name the field whose range starts it
            i = lease.index(err.file)  # type: ignore[union-attr]
            owner = next(
                (
                    n
                    for n, r in batch.items()
                    if ((r.file_idx == i) & (r.offsets == err.offset)).any()
                ),
                None,
            )
            raise err.with_place(field=owner) from None
        for name in batch:
            advance(name)
    return results
