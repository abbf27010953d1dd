"""What the adversarial families attack: payload files written by real writers (a corpus with
a canary beside its root, or one small file), and maps of their bytes (every header field, and
the boundary values to put there).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.payload.adversary_oracle import (
    CANARY,
    MASK_HI,
    MASK_LO,
    SAMPLED,
    _same,
    fields_of,
    write_request,
)


def struct_fields(st: struct.Struct) -> list[tuple[int, str]]:
    """``(byte offset, format code)`` of every field of a little-endian struct format."""
    fmt, out, prefix = st.format.lstrip("<>=!@"), [], "<"
    i = 0
    while i < len(fmt):
        j = i
        while fmt[j].isdigit():
            j += 1
        code, count = fmt[j], int(fmt[i:j] or 1)
        if code == "s":  # "8s" is one field of 8 bytes
            out.append((struct.calcsize(prefix), fmt[i : j + 1]))
            prefix += fmt[i : j + 1]
        elif code == "x":
            prefix += fmt[i : j + 1]
        else:  # "4I" is four fields
            for _ in range(count):
                out.append((struct.calcsize(prefix), code))
                prefix += code
        i = j + 1
    return out


def boundary_values(code: str, old: bytes) -> list[bytes]:
    """Boundary replacements for one packed field (``code`` its struct code)."""
    size = len(old)
    if code[-1] == "s":
        return [bytes(size), b"\xff" * size, old[::-1], bytes([old[0] ^ 1]) + old[1:]]
    signed = code[-1].islower()
    v = struct.unpack("<" + code, old)[0]
    top = (1 << (8 * size - (1 if signed else 0))) - 1
    cands = {0, 1, 2, top, v + 1, v - 1, v * 2, v ^ (1 << (8 * size - 2))}
    if size >= 8:
        cands |= {1 << 31, (1 << 62) - 1, 1 << 40}
    lo = -(top + 1) if signed else 0
    return [struct.pack("<" + code, c) for c in sorted(cands) if lo <= c <= top and c != v]


def canary_of(arrays: dict) -> dict:
    """The same shapes, row counts and stored widths as ``arrays``, holding canary values only
    (each kept set ``987654 + [0, 1, ..]``, sampled 987654)."""
    counts = arrays["sampling_mask"][0]
    n, rows = int(counts.sum()), len(counts)
    ids = CANARY["sampling_mask"] + np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    return {
        SAMPLED: np.full(rows, CANARY["sampling_mask"]),
        "routed_experts": np.broadcast_to(CANARY["routed_experts"], (rows, 2, 3)).copy(),
        "routed_expert_weights": np.broadcast_to(
            CANARY["routed_expert_weights"], (rows, 2, 3)
        ).astype(arrays["routed_expert_weights"].dtype),
        "sampling_mask": (counts, ids),
        "sampling_mask_logprobs": (
            counts,
            np.full(n, CANARY["sampling_mask_logprobs"], np.float32),
        ),
    }


@dataclass
class Corpus:
    root: Path
    outside: Path  # the canary's directory, beside the root
    regions: dict
    requests: list  # per request: its segments
    rows: list  # per request: its row count


def build_corpus(workdir: Path, rng: np.random.Generator, sizes=(5, 300, 0, 129, 1)) -> Corpus:
    """Writers ``g/a`` and ``g/b`` inside ``root``; the canary ``outside/g/a.rfp`` (same layout as
    ``g/a.rfp``, canary values) beside it; symlinks, a FIFO and a directory inside the root."""
    from rollfeed.payload import PayloadWriter

    root, outside = workdir / "root", workdir / "outside"
    regions: dict = {}
    requests, rows = [], []
    with (
        PayloadWriter(root, group="g", name="a") as a,
        PayloadWriter(outside, group="g", name="a") as c,
        PayloadWriter(root, group="g", name="b") as b,
    ):
        for i, n in enumerate(sizes):
            arrays = request_arrays(rng, n, wide=(i == 3))
            requests.append(write_request(a, arrays, regions))
            canary = canary_of(arrays)
            c.write(fields_of(canary), pos=0, sampled=canary[SAMPLED])
            rows.append(n)
        for n in (7, 200, 2):
            requests.append(write_request(b, request_arrays(rng, n), regions))
            rows.append(n)
    (root / "g" / "link.rfp").symlink_to(outside / "g" / "a.rfp")
    (root / "lnk").symlink_to(outside / "g", target_is_directory=True)
    (root / "g" / "up.rfp").symlink_to("../../outside/g/a.rfp")
    os.mkfifo(root / "g" / "fifo.rfp")
    (root / "g" / "dir.rfp").mkdir()
    return Corpus(root, outside, regions, requests, rows)


def kept_sets(rng: np.random.Generator, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kept sets of ``counts`` ids each (>= 1), in canonical order: ``(ids, sampled)``, each row
    its sampled token then distinct other ids ascending, all in ``[MASK_LO, MASK_HI)``."""
    rows = []
    for c in counts.tolist():
        row = rng.choice(MASK_HI - MASK_LO, c, replace=False) + MASK_LO
        rows.append(np.concatenate([row[:1], np.sort(row[1:])]))
    ids = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    return ids, ids[np.cumsum(counts) - counts] if len(counts) else np.zeros(0, np.int64)


def request_arrays(rng: np.random.Generator, rows: int, *, wide: bool = False) -> dict:
    """The four fields of one request of ``rows`` tokens (ids < 200, mask ids in
    ``[MASK_LO, MASK_HI)``), and its sampled tokens (key :data:`SAMPLED`)."""
    counts = rng.integers(1, 6, rows)
    if wide and rows:
        counts[rows // 2] = 300  # a row wider than 256 ids: 2-byte row lengths
    n = int(counts.sum())
    ids, sampled = kept_sets(rng, counts)
    return {
        "routed_experts": rng.integers(1, 200, (rows, 2, 3)),
        "routed_expert_weights": rng.normal(size=(rows, 2, 3)).astype(
            str(rng.choice(["float32", "float16", "float64"]))
        ),
        "sampling_mask": (counts, ids),
        "sampling_mask_logprobs": (counts, (-9 * rng.random(n)).astype(np.float32)),
        SAMPLED: sampled,
    }


def packed(corpus: Corpus, picks, gap: int = 2) -> tuple[list, int]:
    """The segments of requests ``picks`` packed one after another (``gap`` free positions)."""
    from rollfeed.payload import shift_segments

    segs, at = [], 0
    for i in picks:
        segs += shift_segments(corpus.requests[i], at)
        at += corpus.rows[i] + gap
    return segs, at


def small_file(workdir: Path, rng: np.random.Generator, sizes, name: str = "f"):
    """One payload file holding ``sizes`` requests packed one after another: (segs, regions,
    total positions, raw bytes, byte classes: per byte "structure", "value" or "checksum")."""
    from rollfeed.payload import PayloadWriter

    regions: dict = {}
    segs, at = [], 0
    with PayloadWriter(workdir, name=name) as w:
        for n in sizes:
            segs += write_request(w, request_arrays(rng, n), regions, pos=at)
            at += n
    raw = (workdir / f"{name}.rfp").read_bytes()
    kind = np.zeros(len(raw), "U9")
    kind[:] = "structure"
    for r in regions.values():
        start = r.offset + (r.values_at if r.data is None else 0)
        kind[start : r.offset + r.body_bytes] = "value"
        kind[r.offset + r.body_bytes : r.end] = "checksum"
        assert _same(
            r.decoded_from(raw).row(r.rows - 1) if r.rows else np.zeros(0),
            r.row(r.rows - 1) if r.rows else np.zeros(0),
        )
    return segs, regions, at, raw, kind


def byte_mutations(raw: bytes, regions: dict, rng: np.random.Generator):
    """``(description, offset, new bytes)``: boundary values in every header field and CSR block
    offset/length, then random single-bit flips anywhere."""
    from rollfeed.payload.format import layout

    muts = []
    ends = sorted((r.offset, r) for r in regions.values())
    heads = [(0, layout.FILE_HEADER, "file header")]
    prev = layout.FILE_HEADER.size
    for off, r in ends:
        heads.append((prev, layout.REGION_HEADER, f"region header of {r.field}@{off}"))
        name_at = prev + layout.REGION_HEADER.size
        muts.append((f"{r.field}@{off} name byte", name_at, bytes([raw[name_at] ^ 0x20])))
        prev = r.end
    for at, st, what in heads:
        for rel, code in struct_fields(st):
            size = struct.calcsize("<" + code)
            old = raw[at + rel : at + rel + size]
            for new in boundary_values(code, old):
                muts.append((f"{what} +{rel} ({code}) {old.hex()}->{new.hex()}", at + rel, new))
    for off, r in ends:
        if r.data is not None or not r.rows:
            continue
        per = 8 + r.block_rows * r.count_bytes
        for k in range(-(-r.rows // r.block_rows)):
            at = off + k * per
            v = struct.unpack("<Q", raw[at : at + 8])[0]
            for new in (0, v + 1, v - 1, len(r.values), len(r.values) + 1, 2**63, 2**64 - 1):
                if 0 <= new < 2**64 and new != v:
                    muts.append(
                        (f"{r.field}@{off} block {k} offset {v}->{new}", at, struct.pack("<Q", new))
                    )
            for j in (0, 1, min(r.block_rows, r.rows - k * r.block_rows) - 1):
                at2 = at + 8 + j * r.count_bytes
                old = raw[at2 : at2 + r.count_bytes]
                for new in (bytes(r.count_bytes), b"\xff" * r.count_bytes):
                    if new != old:
                        muts.append(
                            (
                                f"{r.field}@{off} block {k} length {j} {old.hex()}->{new.hex()}",
                                at2,
                                new,
                            )
                        )
    for _ in range(160):
        at, bit = int(rng.integers(len(raw))), int(rng.integers(8))
        muts.append((f"bit {bit} of byte {at}", at, bytes([raw[at] ^ (1 << bit)])))
    return muts
