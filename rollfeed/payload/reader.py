"""The reader: a trainer rank reads back only its window of a field.

``read_field(segments, field, window, root=...)`` turns the segments of one micro batch into one
tensor over the window's positions. It checks every record before touching a byte
(:mod:`rollfeed.payload.checks`) and every byte range a record claims against the real file size
before allocating anything (:mod:`rollfeed.payload.regions`), then reads one range per fixed-width
segment, one per ragged segment that spans its whole region (index and values together: the
common case), and two small ones per clipped ragged segment (its index blocks, then the window's
values; :mod:`rollfeed.payload.ragged_read`), planned as NumPy columns
(:mod:`rollfeed.payload.read_plan`), coalesced per file and issued concurrently
(:class:`~rollfeed.payload.lease.Lease`). The region header right before each body is read in the
same batch (adjacent to the body, so in the same ``preadv``) and every record read is held to it
before any byte is handed out.

Worked example (routing ids, rows ``[T, 2]``; a segment covers positions 2..5)::

    read_field(segs, "routed_experts", (0, 4), root=r)       -> uint8 [4, 2]:
        [[0, 0], [0, 0], [a2, b2], [a3, b3]]                  (positions 0, 1 read as fill 0)
    read_field(segs, "routed_experts", [(0, 1), (4, 6)], root=r) -> rows of positions 0, 4, 5

Ragged fields come back as ``[n, W]`` padded with the fill, where ``W = max(1, widest row among
all rows of the given segments)`` (not only the window), so every CP rank passing the same
micro batch's segments gets the same ``W``; or ``width`` for static shapes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollfeed.payload.checks import RecordTable, check_fill, common_dtype, field_segments
from rollfeed.payload.errors import PayloadError
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.layout import DTYPE_CODES, REGION_HEADER
from rollfeed.payload.lease import Lease
from rollfeed.payload.ragged_read import read_ragged
from rollfeed.payload.read_plan import fit, header_ranges, overlaps, slots
from rollfeed.payload.regions import check_file_ids, check_regions
from rollfeed.payload.root import PayloadRoot, as_root
from rollfeed.payload.segment import ITEMSIZE, PayloadSegment

Window = tuple[int, int] | Sequence[tuple[int, int]]


def _ranges(window: Window) -> list[tuple[int, int]]:
    ranges = (
        [window]
        if len(window) == 2 and all(isinstance(x, int | np.integer) for x in window)
        else window
    )
    out = [(int(lo), int(hi)) for lo, hi in ranges]  # type: ignore[misc]
    for lo, hi in out:
        if lo < 0 or hi < lo:
            raise ValueError(f"read_field window ranges need 0 <= lo <= hi, got ({lo}, {hi})")
    return out


def read_field(
    segments: Sequence[PayloadSegment],
    field: str,
    window: Window,
    *,
    root: PayloadRoot | str | os.PathLike[str],
    width: int | None = None,
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Read ``field`` over ``window`` from ``segments``.

    window: ``(lo, hi)`` or a list of ``(lo, hi)`` ranges, read in order (n = total length).
    Returns fixed width ``[n, *shape]`` at the stored dtype (or ``dtype``); ragged ``[n, W]`` int32
    / float32 padded with fill; ``None`` when no segment carries the field.
    """
    spec = lookup_field(field, fields)
    t = field_segments(segments, field, spec)
    if t is None:
        return None
    ranges = _ranges(window)
    n = sum(hi - lo for lo, hi in ranges)
    if width is not None and width < 1:
        raise ValueError(f"read_field width must be >= 1, got {width}")
    proot = as_root(root)
    try:
        if spec.ragged:
            out = read_ragged(t, ranges, n, field, spec, proot, width)
        else:
            out = _read_fixed(t, ranges, n, field, spec, proot)
    except PayloadError as err:
        raise err.with_place(field=field) from None  # the I/O layer knows files, not fields
    return out if dtype is None else out.to(dtype)


def _read_fixed(t: RecordTable, ranges, n, name, spec, root) -> torch.Tensor:
    dtype, shape = common_dtype(t, name)
    check_fill(dtype, spec.fill, t.segs[0], name)
    elems, key = math.prod(shape), name.encode()
    live = t.rows > 0
    plans, read = [], []  # per stored dtype (more than one only when integer ids widen)
    for code in sorted(set(t.dtype[live].tolist())):
        idx = np.flatnonzero(live & (t.dtype == code))
        g = t if len(idx) == len(t.segs) else t.take(idx)
        plan = _plan_fixed(g, ranges, ITEMSIZE[DTYPE_CODES[code]] * elems)
        plans.append((DTYPE_CODES[code], plan))
        read.append(idx[plan.segs])
    # Only records whose bytes are read are held to their headers (a rank's window skips most);
    # when none is, the first one's header still pins the row shape of the fill.
    checked = read[0] if len(read) == 1 else np.unique(np.concatenate(read or [np.zeros(0, int)]))
    c = t if len(checked) == len(t.segs) else t.take(checked if len(checked) else np.zeros(1, int))
    row_bytes = c.itemsize * elems
    reading = len(checked) > 0

    def fits(size: np.ndarray) -> np.ndarray:
        room = size - c.offset
        return (room >= 0) & (c.first + c.rows <= room // row_bytes)

    def needs(i: int) -> str:
        s, rb = c.segs[i], int(row_bytes[i])
        end = s.offset + (s.first + s.rows) * rb
        return f"rows [{s.first}, {s.first + s.rows}) of {rb}-byte rows end at byte {end}"

    def attempt(lease: Lease) -> np.ndarray:
        check_file_ids(c, lease.file_id[c.file_idx])
        version, hsize, hstart = header_ranges(c, lease, key)
        size = fit(c, lease, fits, needs)  # every record read lies inside its file
        hbuf = np.zeros((len(c.segs), REGION_HEADER.size + len(key)), np.uint8)
        dests = [hbuf]
        parts = [(c.file_idx, hstart, hsize, np.zeros(len(c.segs), np.int64), slots(hbuf))]
        out = np.empty((n, elems), dtype) if reading else None
        for stored, plan in plans if reading else ():
            target = out if len(plans) == 1 else np.empty((n, elems), stored)
            for r0, r1 in plan.gaps:
                target[r0:r1] = spec.fill
            parts.append((plan.fi, plan.src, plan.ln, np.full(len(plan.fi), len(dests)), plan.dst))
            dests.append(target)
        fi, src, ln, di, dst = (np.concatenate(p) for p in zip(*parts, strict=True))
        lease.read(fi, src, ln, dests, di, dst)
        check_regions(
            c,
            hbuf,
            version,
            name=key,
            size=size,
            file_id=lease.file_id[c.file_idx],
            shape=shape,
            ragged=None,
        )
        if out is None:  # no record read: the shape is now the header's own
            return np.full((n, elems), spec.fill, dtype)
        if len(plans) > 1:
            covered = np.zeros(n, bool)
            for target, (_, plan) in zip(dests[1:], plans, strict=True):
                mask = np.zeros(n, bool)
                for r0, r1 in plan.written:
                    mask[r0:r1] = True
                out[mask] = target[mask]
                covered |= mask
            out[~covered] = spec.fill
        return out

    out = root.run(c.files, attempt)
    return torch.from_numpy(out.reshape(n, *shape))


@dataclass(frozen=True, kw_only=True, slots=True)
class _FixedPlan:
    """The reads of same-dtype live records into an ``[n, row]`` output: ``[k]`` file index,
    source offset, length and destination offset; ``segs`` the records read (sorted, unique);
    ``written`` / ``gaps`` the output row ranges they fill / that take the fill."""

    fi: np.ndarray
    src: np.ndarray
    ln: np.ndarray
    dst: np.ndarray
    segs: np.ndarray
    written: list[tuple[int, int]]
    gaps: list[tuple[int, int]]


def _plan_fixed(t: RecordTable, ranges, row_bytes: int) -> _FixedPlan:
    parts, written, gaps = [], [], []
    for at, lo, hi, seg, a, b in overlaps(t, ranges):
        prev = np.concatenate([[lo], b[:-1]])
        gaps += zip(
            (at + prev[a > prev] - lo).tolist(), (at + a[a > prev] - lo).tolist(), strict=True
        )
        gaps.append((at + (int(b[-1]) if len(b) else lo) - lo, at + hi - lo))
        src = t.offset[seg] + (t.first[seg] + a - t.pos[seg]) * row_bytes
        parts.append((t.file_idx[seg], src, (b - a) * row_bytes, (at + a - lo) * row_bytes, seg))
        written += zip((at + a - lo).tolist(), (at + b - lo).tolist(), strict=True)
    if not parts:
        empty = np.zeros(0, np.int64)
        return _FixedPlan(
            fi=empty, src=empty, ln=empty, dst=empty, segs=empty, written=written, gaps=gaps
        )
    fi, src, ln, dst, segs = (np.concatenate(p) for p in zip(*parts, strict=True))
    if len(parts) > 1:  # one window range gives increasing records already
        segs = np.unique(segs)
    return _FixedPlan(fi=fi, src=src, ln=ln, dst=dst, segs=segs, written=written, gaps=gaps)
