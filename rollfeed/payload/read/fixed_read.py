"""Reading a fixed-width field: the rows of a window, one range per record piece.

Planned once as NumPy columns (:class:`FixedJob`), then run as steps that hand their reads to
the caller (:mod:`rollfeed.payload.read.reader` batches every field of one read together):

1. the region header of every record read (right before its body, so in the same ``preadv``)
   and the window's rows straight into the output; every record is held to its header;
2. a checking read only (headers first: they say where each region's checksum table lies): the
   whole checksum blocks around the window's rows and their table entries, into a scratch buffer;
   every header and block is checked before the rows are copied out.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from rollfeed.payload.fields import PayloadField
from rollfeed.payload.format.checksum import (
    Entries,
    check_blocks,
    fixed_block_rows,
    no_checksums_error,
    unique_blocks,
)
from rollfeed.payload.format.layout import DTYPE_CODES, REGION_HEADER
from rollfeed.payload.read.checks import RecordTable, check_fill, common_dtype
from rollfeed.payload.read.read_plan import (
    check_output,
    coverage,
    fit,
    header_ranges,
    overlaps,
    slots,
)
from rollfeed.payload.read.regions import check_file_ids, check_regions
from rollfeed.payload.segment import ITEMSIZE
from rollfeed.payload.stores.lease import FieldFiles, Reads


@dataclass(frozen=True, kw_only=True, slots=True)
class _Plan:
    """The reads of same-dtype live records into an ``[n, row]`` output: ``[k]`` file index,
    source offset, length, destination offset and record (``rec``, into the table planned);
    ``segs`` the records read (sorted, unique); ``written`` / ``gaps`` the output row ranges they
    fill / that take the fill."""

    fi: np.ndarray
    src: np.ndarray
    ln: np.ndarray
    dst: np.ndarray
    rec: np.ndarray
    segs: np.ndarray
    written: list[tuple[int, int]]
    gaps: list[tuple[int, int]]


def _plan(t: RecordTable, ranges, row_bytes: int) -> _Plan:
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
        e = np.zeros(0, np.int64)
        return _Plan(fi=e, src=e, ln=e, dst=e, rec=e, segs=e, written=written, gaps=gaps)
    fi, src, ln, dst, rec = (np.concatenate(p) for p in zip(*parts, strict=True))
    segs = np.unique(rec) if len(parts) > 1 else rec  # one window range: increasing already
    return _Plan(fi=fi, src=src, ln=ln, dst=dst, rec=rec, segs=segs, written=written, gaps=gaps)


class FixedJob:
    """One fixed-width field over one window, planned (no I/O): :meth:`steps` runs it."""

    def __init__(
        self, t: RecordTable, ranges, n: int, name: str, spec: PayloadField, bound: int
    ) -> None:
        self.dtype, self.shape = common_dtype(t, name)
        check_fill(self.dtype, spec.fill, t.segs[0], name)
        self.n, self.name, self.fill = n, name, spec.fill
        self.elems, self.key = math.prod(self.shape), name.encode()
        check_output(t, 0, name, n, self.elems, self.dtype.itemsize, bound, int(t.pos[0]))
        live = t.rows > 0
        self.plans = []  # per stored dtype (more than one only when integer ids widen)
        self.coverage = np.zeros(n, bool)
        read = []
        for code in sorted(set(t.dtype[live].tolist())):
            idx = np.flatnonzero(live & (t.dtype == code))
            g = t if len(idx) == len(t.segs) else t.take(idx)
            plan = _plan(g, ranges, ITEMSIZE[DTYPE_CODES[code]] * self.elems)
            self.plans.append((DTYPE_CODES[code], plan, idx))
            self.coverage |= coverage(g, ranges, n)
            read.append(idx[plan.segs])
        # Only records whose bytes are read are held to their headers (a rank's window skips
        # most); when none is, the first one's header still pins the row shape of the fill.
        checked = read[0] if len(read) == 1 else np.unique(np.concatenate(read or [np.zeros(0)]))
        checked = checked.astype(np.int64)
        self.whole = len(checked) == len(t.segs)
        self.checked = checked
        self.c = t if self.whole else t.take(checked if len(checked) else np.zeros(1, np.int64))
        self.reading = len(checked) > 0
        self.file_list = self.c.files
        opened = np.bincount(self.c.file_idx, minlength=len(self.file_list))
        self.files = np.flatnonzero(opened)  # the files opened (indexes into file_list)

    def _fits(self, size: np.ndarray) -> np.ndarray:
        c = self.c
        room = size - c.offset
        return (room >= 0) & (c.first + c.rows <= room // (c.itemsize * self.elems))

    def _needs(self, i: int) -> str:
        s, rb = self.c.segs[i], int(self.c.itemsize[i]) * self.elems
        end = s.offset + (s.first + s.rows) * rb
        return f"rows [{s.first}, {s.first + s.rows}) of {rb}-byte rows end at byte {end}"

    def steps(self, files: FieldFiles, check: bool) -> Generator[Reads, None, np.ndarray]:
        """Yield the batches to read, one at a time; return the rows ``[n, *shape]``."""
        c, n, elems = self.c, self.n, self.elems
        check_file_ids(c, files.file_id[c.file_idx])
        version, hsize, hstart = header_ranges(c, files, self.key)
        if check and (version == 1).any():
            i = int(np.argmax(version == 1))
            raise no_checksums_error(file=c.segs[i].file, field=self.name, region=c.segs[i].offset)
        size = fit(c, files, self._fits, self._needs)  # every record read lies inside its file
        hbuf = np.zeros((len(c.segs), REGION_HEADER.size + len(self.key)), np.uint8)
        parts = [files.reads(c.file_idx, hstart, hsize, [hbuf], 0, slots(hbuf))]
        out = np.empty((n, elems), self.dtype) if self.reading else None
        targets = []
        for stored, plan, _ in self.plans if self.reading else ():
            target = out if len(self.plans) == 1 else np.empty((n, elems), stored)
            for r0, r1 in plan.gaps:
                target[r0:r1] = self.fill
            targets.append(target)
            if not check:
                parts.append(files.reads(plan.fi, plan.src, plan.ln, [target], 0, plan.dst))
        yield Reads.concat(parts)
        file_id = files.file_id[c.file_idx]
        args = dict(name=self.key, size=size, file_id=file_id, shape=self.shape, ragged=None)
        check_regions(c, hbuf, version, **args)
        if check:
            yield from self._checked(files, hbuf, hsize, hstart, targets)
        if out is None:  # no record read: the shape is now the header's own
            return np.full((n, elems), self.fill, self.dtype)
        if len(self.plans) > 1:
            covered = np.zeros(n, bool)
            for target, (_, plan, _) in zip(targets, self.plans, strict=True):
                mask = np.zeros(n, bool)
                for r0, r1 in plan.written:
                    mask[r0:r1] = True
                out[mask] = target[mask]
                covered |= mask
            out[~covered] = self.fill
        return out

    def _checked(self, files: FieldFiles, hbuf, hsize, hstart, targets):
        """Step 2 of a checking read: the whole blocks around every piece and their checksums,
        checked, then the pieces copied into ``targets``."""
        c = self.c
        rb = c.itemsize * self.elems  # [S] row bytes
        block = fixed_block_rows(rb)
        rows = hbuf[:, 12:20].copy().view("<i8")[:, 0]  # the regions' rows (checked: in file)
        pieces = [(np.zeros(0, np.int64),) * 5] + [
            (np.full(len(plan.rec), p), plan.src, plan.ln, plan.dst, idx[plan.rec])
            for p, (_, plan, idx) in enumerate(self.plans)
        ]
        target, src, ln, dst, rec = (np.concatenate(x) for x in zip(*pieces, strict=True))
        if not self.whole:
            rec = np.searchsorted(self.checked, rec)
        r0 = (src - c.offset[rec]) // rb[rec]
        k0, k1 = r0 // block[rec], (r0 + ln // rb[rec] - 1) // block[rec]
        ur, uk, first = unique_blocks(rec, k0, k1)
        row0 = uk * block[ur]
        blen = (np.minimum(row0 + block[ur], rows[ur]) - row0) * rb[ur]
        bsrc = c.offset[ur] + row0 * rb[ur]
        bslot = np.cumsum(blen) - blen
        scratch = np.empty(int(blen.sum()), np.uint8)
        last = np.full(len(c.segs), -1, np.int64)
        np.maximum.at(last, ur, uk)
        entries = Entries.plan(c.offset + rows * rb, last + 2)
        yield Reads.concat(
            [
                files.reads(c.file_idx[ur], bsrc, blen, [scratch], 0, bslot),
                entries.reads(files, c.file_idx),
            ]
        )
        S, J = len(c.segs), len(ur)
        every = np.arange(S)
        check_blocks(
            c.segs,
            self.name,
            [memoryview(hbuf.reshape(-1)), memoryview(scratch)],
            (
                np.repeat([0, 1], [S, J]),
                np.concatenate([slots(hbuf), bslot]),
                np.concatenate([hsize, blen]),
                np.arange(S + J),
            ),
            (
                np.concatenate([every, ur]),
                np.repeat([0, 1], [S, J]),
                np.concatenate([np.zeros(S, np.int64), uk]),
                np.concatenate([hstart, bsrc]),
                np.concatenate([entries.stored(every, 0), entries.stored(ur, 1 + uk)]),
            ),
        )
        at = bslot[first] + src - bsrc[first]  # each piece lies in consecutive blocks
        views = [memoryview(t.reshape(-1).view(np.uint8)) for t in targets]
        whole = memoryview(scratch)
        for p, d, s, m in zip(target.tolist(), dst.tolist(), at.tolist(), ln.tolist(), strict=True):
            views[p][d : d + m] = whole[s : s + m]
