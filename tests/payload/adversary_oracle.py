"""The oracle of the adversarial families: what a writer was given (:class:`Region`), and
:func:`check_read`, which holds a read to it.

Every read that does not raise must equal, row by row, what the writer was given for the rows
its records designate (``(file, offset)`` of a region body the writer wrote, row ``first + p -
pos``), and the field's fill where no record covers a position; a canary value (written only
outside the root) in any output is an escape.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.payload.adversary_tally import Escaped, Tally, Wrong

FIELDS = ("routed_experts", "routed_expert_weights", "sampling_mask", "sampling_mask_logprobs")
RAGGED = {"sampling_mask", "sampling_mask_logprobs"}
FILL = {"routed_experts": 0, "routed_expert_weights": 0.0, "sampling_mask": -1}
FILL["sampling_mask_logprobs"] = -math.inf
SAMPLED = "sampled"  # the key of a request's sampled tokens (one per row), beside its fields
# Mask ids the in-root writers use: [MASK_LO, MASK_HI), three bytes each when stored.
MASK_LO, MASK_HI = 70_000, 900_000
# Canary rows: values the in-root writers never write (ids < 200, |weights| < 10, mask ids below
# MASK_HI; the canary's kept sets are 987654 + j).
CANARY = {
    "routed_experts": np.array([255, 254, 253, 252, 251, 250], np.uint8).reshape(2, 3),
    "routed_expert_weights": np.full((2, 3), 7777.0, np.float32),
    "sampling_mask": 987654,
    "sampling_mask_logprobs": -4242.0,
}


@dataclass(frozen=True)
class Region:
    """What a writer was given for one region, and where its body lies."""

    field: str
    file: str
    offset: int  # body offset
    rows: int
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | None  # fixed [rows, *shape]
    counts: np.ndarray | None  # ragged [rows], as stored
    values: np.ndarray | None  # ragged [sum(counts)], as stored
    count_bytes: int = 0
    block_rows: int = 0
    lead: int = 0  # 1: the rows omit their sampled token, read back at column 0 as the fill

    @property
    def value_bytes(self) -> int:
        return VALUE_BYTES[self.dtype]

    @property
    def values_at(self) -> int:
        """Offset of the values inside a ragged body (index padded to 4 bytes)."""
        blocks = -(-self.rows // self.block_rows)
        return -(-(blocks * 8 + self.rows * self.count_bytes) // 4) * 4

    @property
    def body_bytes(self) -> int:
        if self.data is not None:
            return self.data.size * self.data.itemsize
        return self.values_at + self.value_bytes * len(self.values)

    @property
    def end(self) -> int:
        """Where the region ends: its body, then its checksum table (one CRC for the header,
        then one per block: rows of about 64 KiB, or an index and a values block per 128 rows)."""
        if self.data is not None:
            row = self.data[0].nbytes if self.rows else 1
            blocks = -(-self.rows // max(1, 65536 // row))
        else:
            blocks = 2 * -(-self.rows // self.block_rows)
        return self.offset + self.body_bytes + 4 * (1 + blocks)

    def row(self, r: int) -> np.ndarray:
        if self.data is not None:
            return self.data[r].reshape(-1)
        start = int(self.counts[:r].sum())
        return self.values[start : start + int(self.counts[r])]

    def decoded_from(self, raw: bytes) -> Region:
        """The same region with its values taken from ``raw`` (the file's bytes), structure kept."""
        if self.data is not None:
            body = raw[self.offset : self.offset + self.body_bytes]
            data = np.frombuffer(body, np.dtype(self.dtype).newbyteorder("<"))
            return _replace(self, data=data.reshape(self.data.shape))
        at = self.offset + self.values_at
        k = self.value_bytes
        body = np.frombuffer(raw[at : at + k * len(self.values)], np.uint8).reshape(-1, k)
        if self.dtype == "float32":
            vals = body.copy().view("<f4").reshape(-1)
        else:  # little-endian unsigned of k bytes (int32 values of the corpus are >= 0)
            vals = (body.astype(np.int64) << (8 * np.arange(k))).sum(axis=1)
        return _replace(self, values=vals)


VALUE_BYTES = {"uint8": 1, "uint16": 2, "uint24": 3, "int32": 4, "float32": 4}


def region_of(s, arrays: dict) -> Region:
    """The region a writer made of ``arrays[s.field]`` (the corpus writes kept sets in canonical
    order: the sampled token first, so the mask's stored rows are the others, in order)."""
    a = arrays[s.field]
    if s.ragged is None:
        data = np.asarray(a).astype(s.dtype)
        return Region(s.field, s.file, s.offset, s.rows, s.dtype, s.shape, data, None, None)
    counts, values = (np.asarray(x) for x in a)
    lead = int(s.field == "sampling_mask")
    if lead:
        firsts = np.cumsum(counts) - counts
        values = np.delete(values, firsts)
        counts = counts - 1
    stored = values.astype(np.float32 if s.dtype == "float32" else np.int64)
    lay = s.ragged
    return Region(
        s.field,
        s.file,
        s.offset,
        s.rows,
        s.dtype,
        (),
        None,
        counts,
        stored,
        lay.count_bytes,
        lay.block_rows,
        lead,
    )


def _replace(r: Region, **kw) -> Region:
    d = {k: getattr(r, k) for k in Region.__dataclass_fields__}
    d.update(kw)
    return Region(**d)


def write_request(writer, arrays: dict, regions: dict, pos: int = 0) -> list:
    """Write one request; add its regions to ``regions`` keyed by ``(file, offset)``."""
    segs = writer.write(fields_of(arrays), pos=pos, sampled=arrays[SAMPLED])
    for s in segs:
        regions[(s.file, s.offset)] = region_of(s, arrays)
    return segs


def fields_of(arrays: dict) -> dict:
    return {k: v for k, v in arrays.items() if k != SAMPLED}


def check_read(out, segs, name: str, ranges, regions: dict) -> None:
    """Raise :class:`Escaped` / :class:`Wrong` unless ``out`` is what the oracle says."""
    n = sum(hi - lo for lo, hi in ranges)
    if out is None:
        if any(s.field == name for s in segs):
            raise Wrong(f"{name}: read returned None although segments carry the field")
        return
    from rollfeed.payload import RaggedRows

    lengths = None
    if isinstance(out, RaggedRows):  # compared padded (NumPy: no torch threads under the limits)
        offsets, values = out.offsets.numpy(), out.values.numpy()
        lengths = np.diff(offsets)
        got = np.full((len(lengths), max(1, lengths.max(initial=0))), FILL[name], values.dtype)
        row = np.repeat(np.arange(len(lengths)), lengths)
        got[row, np.arange(len(values)) - offsets[row]] = values
    else:
        got = out.numpy()
    flat = got.reshape(len(got), -1) if got.ndim else got.reshape(1, 1)
    canary = CANARY[name]
    if name == "sampling_mask":
        if (flat >= canary).any():
            raise Escaped(f"{name}: a canary id (>= {canary}) in the output")
    elif name in RAGGED:
        if np.isin(flat, [canary]).any():
            raise Escaped(f"{name}: canary value {canary} in the output")
    elif flat.shape[1:] == (canary.size,) and (flat == canary.reshape(1, -1)).all(axis=1).any():
        raise Escaped(f"{name}: a canary row in the output")
    if got.shape[0] != n:
        raise Wrong(f"{name}: {got.shape[0]} rows for a window of {n}")
    positions = np.concatenate([np.arange(lo, hi) for lo, hi in ranges] or [np.zeros(0, int)])
    owner, cover = np.full(n, -1), np.zeros(n, int)
    live = [s for s in segs if s.field == name and s.rows > 0]
    for k, s in enumerate(live):
        inside = (positions >= s.pos) & (positions < s.pos + s.rows)
        owner[inside], cover[inside] = k, cover[inside] + 1
    if (cover > 1).any():
        p = int(positions[np.argmax(cover > 1)])
        raise Wrong(f"{name}: overlapping segments at position {p} were not refused")
    if lengths is not None and lengths[owner < 0].any():
        p = int(positions[owner < 0][np.argmax(lengths[owner < 0] > 0)])
        raise Wrong(f"{name}: an uncovered position ({p}) holds values")
    fill = FILL[name]
    free = flat[owner < 0]
    if free.size and not _same(free, np.full(free.shape, fill)):
        p = int(positions[owner < 0][0])
        raise Wrong(f"{name}: an uncovered position (from {p}) does not hold the fill {fill}")
    for k, s in enumerate(live):
        at = np.flatnonzero(owner == k)
        if len(at):
            held = None if lengths is None else lengths[at]
            _check_rows(flat[at], s, positions[at], regions, name, fill, held)


def _check_rows(got: np.ndarray, s, positions, regions: dict, name: str, fill, lengths) -> None:
    """Rows ``got`` ``[k, W]`` read at ``positions`` from segment ``s``, against the writer's;
    ``lengths``: each ragged row's length as read (``None``: read padded)."""
    reg = regions.get((s.file, s.offset))
    r = s.first + positions - s.pos
    if reg is None or reg.field != name or r.min() < 0 or r.max() >= reg.rows:
        raise Wrong(
            f"{name}: read returned data for positions {positions[0]}.. from a record that "
            f"designates no written row (file={s.file!r}, offset={s.offset}, first={s.first})"
        )
    if reg.data is not None:
        want = reg.data.reshape(reg.rows, -1)[r]
        if got.shape != want.shape or not _same(got, want):
            bad = (
                int(positions[np.argmax((got != want).any(axis=1))])
                if got.shape == want.shape
                else -1
            )
            raise Wrong(
                f"{name}: rows at positions {positions[0]}.. (first bad {bad}) differ from "
                f"the writer's (shape {got.shape} vs {want.shape})"
            )
        return
    counts, lead = reg.counts[r], reg.lead
    if lengths is not None and (lengths != counts + lead).any():
        bad = int(positions[np.argmax(lengths != counts + lead)])
        raise Wrong(f"{name}: the row at position {bad} holds a length the writer did not give")
    if counts.max(initial=0) + lead > got.shape[1]:
        raise Wrong(f"{name}: width {got.shape[1]} < the widest written row {counts.max()}")
    starts = (np.cumsum(reg.counts) - reg.counts)[r]
    want = np.full(got.shape, fill, got.dtype)
    cols = np.arange(got.shape[1] - lead)
    keep = cols[None, :] < counts[:, None]
    take = (starts[:, None] + cols[None, :])[keep]
    want[:, lead:][keep] = reg.values[take]
    if not _same(got, want):
        bad = int(positions[np.argmax((got != want).any(axis=1))])
        raise Wrong(
            f"{name}: position {bad} holds {got[positions == bad][0][:8]}, the writer gave "
            f"{want[positions == bad][0][:8]}"
        )


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind in "iub" and b.dtype.kind in "iub":
        return np.array_equal(a.astype(np.int64), b.astype(np.int64))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return bool(
        a64.shape == b64.shape
        and np.array_equal(a64, b64)
        and (np.signbit(a64) == np.signbit(b64)).all()
    )


def read_case(tally: Tally, desc: str, segs, name: str, ranges, root, regions: dict, **kw) -> str:
    from rollfeed.payload import read_field

    def attack():
        out = read_field(segs, name, ranges, root=root)
        check_read(out, segs, name, ranges, regions)

    return tally.case(desc, attack, **kw)


def verify_case(tally: Tally, desc: str, root: Path, *, flag: str | None, command: str = "verify"):
    """``python -m rollfeed verify ROOT`` in process: never crashes; with ``flag`` (a file name),
    must return non-zero and name the file."""
    from rollfeed import cli

    def attack():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = getattr(cli, command)(os.fspath(root))
        if flag is not None and (rc == 0 or flag not in buf.getvalue()):
            raise Wrong(f"{command} returned {rc} without naming {flag}: {buf.getvalue()[:300]!r}")

    return tally.case(desc, attack)
