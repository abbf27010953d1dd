"""Attack families against payload files, records and step lines, run in a bounded child process.

``python -m tests.payload.adversary FAMILY WORKDIR SEED`` runs one family and prints one JSON
summary line; :func:`run_family` starts that child under ``RLIMIT_AS`` and a wall-clock bound, so a
hang or a memory bomb fails the calling test instead of the suite.

The oracle is the writer's own arrays: every read that does not raise must equal, row by row, what
the writer was given for the rows its records designate (``(file, offset)`` of a region body the
writer wrote, row ``first + p - pos``), and the field's fill where no record covers a position.
A read that raises must raise a typed error: a ``ValueError`` subclass defined in ``rollfeed``.

Each attack (one read, one parse, one verify) is one case with an outcome:

- ``correct``: returned exactly what the oracle says;
- ``refused``: raised a typed error;
- ``wrong``: returned other data (or handed out a record that does not read back);
- ``hang``: ran past the per-case bound (``signal.setitimer``);
- ``escape``: returned bytes of the canary file outside the root;
- ``untyped``: raised anything else (``OSError``, ``struct.error``, ``KeyError``, ...);
- ``overalloc``: ``MemoryError`` under the address-space limit, or a peak of traced allocations
  (NumPy buffers, via ``tracemalloc``) above ``ALLOC_BOUND`` for files of a few KiB.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
AS_LIMIT = 1 << 30  # the child imports torch in ~650 MiB of address space; measured, it fits
ALLOC_BOUND = 64 << 20
CASE_BOUND_S = 2.0  # one small read takes milliseconds
HANGS_BEFORE_SHORTER = 2  # after two hangs a family waits 0.3 s per case, to stay in budget
OUTCOMES = ("correct", "refused", "wrong", "hang", "escape", "untyped", "overalloc")
FAILURES = ("wrong", "hang", "escape", "untyped", "overalloc")
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


# --------------------------------------------------------------------------- parent side


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run_family(family: str, workdir: Path, *, seed: int = 15, timeout_s: float = 50.0) -> dict:
    """Run one family in a child under ``RLIMIT_AS`` and ``timeout_s``; its summary as a dict.

    A child that runs past ``timeout_s`` or dies reports a hang / crash naming its last case.
    """
    progress = workdir / "progress.txt"
    cmd = [sys.executable, "-m", "tests.payload.adversary", family, os.fspath(workdir), str(seed)]
    try:
        done = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, preexec_fn=_limit
        )
    except subprocess.TimeoutExpired:
        last = progress.read_text().splitlines()[-1:] if progress.exists() else []
        return _broken(family, "hang", f"child ran past {timeout_s} s; last case: {last}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = progress.read_text().splitlines()[-1:] if progress.exists() else []
        why = f"child exited {done.returncode}; last case {last}; stderr: {done.stderr[-3000:]}"
        return _broken(family, "untyped", why)
    return json.loads(lines[-1])


def _broken(family: str, outcome: str, why: str) -> dict:
    summary = {k: 0 for k in OUTCOMES}
    summary.update(family=family, tried=1, examples=[{"outcome": outcome, "case": why}])
    summary[outcome] = 1
    return summary


def format_summary(s: dict) -> str:
    counts = ", ".join(f"{k} {s[k]}" for k in OUTCOMES)
    lines = [f"[adversarial] {s['family']}: tried {s['tried']}: {counts}"]
    lines += [f"    {e['outcome']}: {e['case']}" for e in s["examples"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- child side


class Wrong(Exception):
    """A read returned data other than what the oracle says."""


class Escaped(Exception):
    """A read returned bytes of the canary outside the root."""


class _Hang(BaseException):
    """Raised by SIGALRM when a case runs past its bound (BaseException: nothing swallows it)."""


def _alarm(signum, frame):
    raise _Hang()


def typed(err: BaseException) -> bool:
    return isinstance(err, ValueError) and type(err).__module__.split(".")[0] == "rollfeed"


class Tally:
    """Outcome counts of one family and the first examples of each failure."""

    def __init__(self, family: str, workdir: Path, *, trace: bool) -> None:
        self.family, self.counts = family, dict.fromkeys(OUTCOMES, 0)
        self.examples: list[dict] = []
        self.progress = open(workdir / "progress.txt", "w")  # noqa: SIM115
        signal.signal(signal.SIGALRM, _alarm)
        if trace:  # 2-5x slower reads: only where size claims are the attack
            tracemalloc.start()

    def case(self, desc: str, attack: Callable[[], object], *, refusal_ok: bool = True) -> str:
        """Run one attack; ``refusal_ok=False`` when a typed error is itself a failure."""
        self.progress.write(desc[:300] + "\n")
        self.progress.flush()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        detail = ""
        bound = CASE_BOUND_S if self.counts["hang"] < HANGS_BEFORE_SHORTER else 0.3
        signal.setitimer(signal.ITIMER_REAL, bound)
        try:
            attack()
            outcome = "correct"
        except _Hang:
            outcome = "hang"
        except Wrong as err:
            outcome, detail = "wrong", str(err)
        except Escaped as err:
            outcome, detail = "escape", str(err)
        except MemoryError as err:
            outcome, detail = "overalloc", f"{type(err).__name__}: {err}"
        except BaseException as err:
            outcome = ("refused" if refusal_ok else "wrong") if typed(err) else "untyped"
            detail = f"{type(err).__module__}.{type(err).__name__}: {str(err)[:300]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1] - base
        peak = max(peak, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss)
        if peak > ALLOC_BOUND and outcome in ("correct", "refused"):
            outcome, detail = "overalloc", f"allocated {peak} bytes at peak ({detail})"
        self.counts[outcome] += 1
        if outcome in FAILURES:
            same = sum(e["outcome"] == outcome for e in self.examples)
            if same < 6:
                self.examples.append({"outcome": outcome, "case": f"{desc[:400]} -> {detail}"})
        return outcome

    def record(self, outcome: str, desc: str) -> None:
        """Count an outcome observed outside :meth:`case` (e.g. in a worker thread)."""
        self.counts[outcome] += 1
        if outcome in FAILURES and sum(e["outcome"] == outcome for e in self.examples) < 6:
            self.examples.append({"outcome": outcome, "case": desc[:500]})

    def summary(self) -> dict:
        out = {"family": self.family, "tried": sum(self.counts.values()), **self.counts}
        out["examples"] = self.examples
        return out


# --------------------------------------------------------------------------- corpus and oracle


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
    fill = FILL[name]
    free = flat[owner < 0]
    if free.size and not _same(free, np.full(free.shape, fill)):
        p = int(positions[owner < 0][0])
        raise Wrong(f"{name}: an uncovered position (from {p}) does not hold the fill {fill}")
    for k, s in enumerate(live):
        at = np.flatnonzero(owner == k)
        if len(at):
            _check_rows(flat[at], s, positions[at], regions, name, fill)


def _check_rows(got: np.ndarray, s, positions: np.ndarray, regions: dict, name: str, fill) -> None:
    """Rows ``got`` ``[k, W]`` read at ``positions`` from segment ``s``, against the writer's."""
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


# --------------------------------------------------------------------------- byte maps


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


# --------------------------------------------------------------------------- the corpus


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


# --------------------------------------------------------------------------- (a) records

INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62 - 1, 2**62, 2**63 - 1, -(2**63)]
INTS += [2**64, 10**30]
JSON_ODD = [True, False, 1.0, 1.5, "1", None, [], {}, float("nan"), float("inf")]
ODD_FILES = [
    "", ".", "..", "/", "g", "g/", "g/a.rfp/", "g/a.rfp/x", "g//a.rfp", "g/./a.rfp",
    "g/../g/a.rfp", "../outside/g/a.rfp", "g\\a.rfp", "g/a.rfp\0", "g/a\0.rfp", "G/a.rfp",
    "g/missing.rfp", "g/b.rfp", "g/link.rfp", "g/up.rfp", "lnk/a.rfp", "g/fifo.rfp",
    "g/dir.rfp", "a" * 5000, "g/" + "b" * 300 + ".rfp", "~/g/a.rfp",
]  # fmt: skip
ODD_DTYPES = [
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "float16", "float32",
    "float64", "bool", "complex64", "object", "<u1", ">i4", "int32\0", "", "V8", "U4", "f8",
    "uint24", "uint24\0", "int24",  # the 3-byte ragged value width, and near misses
]  # fmt: skip
ODD_SHAPES = [
    [], [0], [-1], [1], [6], [2, 3], [3, 2], [12], [2, 2], [2, 3, 1], [2**31], [2**24 - 1],
    [2**23], [2**62, 2**62], [1] * 64, [2**31, 2**31], [-2, -3], [1.5], [True, True],
]  # fmt: skip
INT_ATTRS = ("offset", "pos", "rows", "first")
LAYOUT_ATTRS = ("rows", "values", "count_bytes", "block_rows")


def record_mutations(seg, corpus: Corpus, canary: str):
    """``(level, description, mutate)``: ``mutate(dict)`` edits a record's JSON dict in place."""
    from rollfeed.payload import PayloadSegment

    others = sorted({off for (f, off) in corpus.regions if f == seg.file} - {seg.offset})
    muts = []

    def put(key, value, sub=None):
        def edit(d):
            if sub is None:
                d[key] = value
            elif d.get("ragged") is not None:
                d["ragged"][sub] = value

        return edit

    for attr in INT_ATTRS:
        v = getattr(seg, attr)
        vals = [*INTS, v - 1, v + 1, 2 * v]
        if attr == "offset":
            vals += [*others, v - 40 - len(seg.field), v + 8]
        for x in vals:
            muts.append(("py", f"{attr}={x}", put(attr, x)))
            muts.append(("json", f"{attr}={x}", put(attr, x)))
        for x in JSON_ODD:
            muts.append(("json", f"{attr}={x!r}", put(attr, x)))
    for x in [*ODD_FILES, canary]:
        muts.append(("json", f"file={x[:60]!r}", put("file", x)))
    for x in ODD_DTYPES:
        muts.append(("json", f"dtype={x!r}", put("dtype", x)))
    for x in [*FIELDS, "", "unknown", "sampling_mask\0", 5]:
        muts.append(("json", f"field={x!r}", put("field", x)))
    for x in [*ODD_SHAPES, "x", None, 6]:
        muts.append(("json", f"shape={x!r}", put("shape", x)))
    lay = {"rows": 3, "values": 4, "count_bytes": 1, "block_rows": 128}
    for x in [None, {}, lay, {**lay, "extra": 1}, [], 5]:
        muts.append(("json", f"ragged={x!r}", put("ragged", x)))
    if seg.ragged is not None:
        for sub in LAYOUT_ATTRS:
            v = getattr(seg.ragged, sub)
            for x in [*INTS, v - 1, v + 1, 3, 4, 8, 127, 129]:
                muts.append(("py", f"ragged.{sub}={x}", put(None, x, sub)))
                muts.append(("json", f"ragged.{sub}={x}", put(None, x, sub)))
            for x in JSON_ODD[:5]:
                muts.append(("json", f"ragged.{sub}={x!r}", put(None, x, sub)))
    known = {*INT_ATTRS, "field", "file", "dtype", "shape", "ragged"}
    for attr in set(PayloadSegment.model_fields) - known:  # e.g. a file id
        v = getattr(seg, attr)
        for x in [None, 0, -1, 1, 2**63 - 1, 2**64, "", "0" * 32, "x", True, 1.5, v]:
            muts.append(("json", f"{attr}={x!r}", put(attr, x)))
    return muts


def mutated_segment(victim, level: str, edit):
    """``victim`` (a PayloadSegment) with ``edit`` applied to its JSON: built past validation
    (``"py"``: what code handing the reader a constructed record could do) or parsed from the
    edited JSON (what an orchestrator's wire could carry), where a JSON bool accepted as an
    integer is a finding."""
    from rollfeed.payload import PayloadSegment, RaggedLayout

    d = json.loads(victim.model_dump_json())
    edit(d)
    if level == "py":
        lay = d.pop("ragged")
        upd = {k: v for k, v in d.items() if v != getattr(victim, k)}
        if lay is not None and victim.ragged is not None:
            upd["ragged"] = RaggedLayout.model_construct(**lay)
        return victim.model_copy(update=upd)
    seg = PayloadSegment.from_json(json.dumps(d))
    if _json_bool_in_int(d, victim):
        raise Wrong(f"from_json accepted a JSON bool as an integer: {seg}")
    return seg


def _json_bool_in_int(d: dict, seg) -> bool:
    ints = [d.get(a) for a in INT_ATTRS]
    if isinstance(d.get("ragged"), dict):
        ints += [d["ragged"].get(a) for a in LAYOUT_ATTRS]
    return any(isinstance(x, bool) for x in ints)


def family_records(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    from rollfeed.payload import (
        PayloadRoot,
        clip_segments,
        read_field,
    )

    corpus = build_corpus(workdir, rng)
    root = PayloadRoot(corpus.root, retries=0)
    canary = os.fspath(corpus.outside / "g" / "a.rfp")
    batches = [packed(corpus, [0, 1]), packed(corpus, [5, 3, 4, 6])]
    segs, total = packed(corpus, [1, 7])
    batches.append((clip_segments(segs, 50, 260), total))
    for segs, total in batches:
        windows = [[(0, total + 3)], [(3, min(total, 140)), (total // 2, total)]]
        for name in FIELDS:
            for w in windows:
                read_case(
                    tally, f"records: unmodified {name} {w}", segs, name, w, root, corpus.regions
                )
    for b, (segs, total) in enumerate(batches):
        windows = [[(0, total + 3)], [(3, min(total, 140)), (total // 2, total)]]
        live = [s for s in segs if s.rows]
        picks = [
            rng.choice([s for s in live if s.ragged is None]),
            rng.choice([s for s in live if s.ragged is not None]),
        ]
        for k, victim in enumerate(picks):
            at = segs.index(victim)
            for j, (level, what, edit) in enumerate(record_mutations(victim, corpus, canary)):
                w = windows[(j + k) % 2]
                desc = f"records[{b}] {level} {what} on {victim.model_dump_json()} window {w}"

                def attack(level=level, edit=edit, w=w, victim=victim, at=at, segs=segs):
                    seg = mutated_segment(victim, level, edit)
                    mutated = [*segs[:at], seg, *segs[at + 1 :]]
                    for name in {victim.field, seg.field} & set(FIELDS):
                        out = read_field(mutated, name, w, root=root)
                        check_read(out, mutated, name, w, corpus.regions)

                tally.case(desc, attack)


# --------------------------------------------------------------------------- (b) file bytes


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
    from rollfeed.payload import layout

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


def family_bytes(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Every checking read (``verify_checksums=True``) of a mutated file is a typed error or the
    writer's exact arrays, whichever bytes changed (headers, CSR index, padding, values, checksum
    tables): a flipped value byte the read covers is a ``PayloadChecksumError``, never new data.
    ``verify`` names the file for every one of them."""
    from rollfeed.payload import PayloadRoot, read_field

    base = workdir / "base"
    segs, regions, total, raw, kind = small_file(base, rng, (5, 140, 0, 3))
    windows = [[(0, total + 2)], [(60, 150)], [(130, 134), (0, 2)]]
    for j, (what, at, new) in enumerate(byte_mutations(raw, regions, rng)):
        mutated = bytearray(raw)
        mutated[at : at + len(new)] = new
        d = workdir / f"c{j}"
        d.mkdir()
        (d / "f.rfp").write_bytes(bytes(mutated))
        changed = sorted({str(kind[i]) for i in range(at, at + len(new)) if raw[i] != mutated[i]})
        root = PayloadRoot(d, retries=0, verify_checksums=True)
        for name in FIELDS:
            w = windows[(j + FIELDS.index(name)) % len(windows)]

            def attack(name=name, w=w, root=root):
                check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

            tally.case(f"bytes: {what} ({'/'.join(changed)}), read {name} {w}", attack)
        verify_case(tally, f"bytes: {what}, verify", d, flag="f.rfp")
        root.close()


# --------------------------------------------------------------------------- (c) truncation


def family_truncation(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """A file cut at every byte: reads are exact or typed; verify and inspect flag every cut
    that is not a region boundary."""
    from rollfeed.payload import PayloadRoot, layout, read_field

    base = workdir / "base"
    segs, regions, total, raw, _ = small_file(base, rng, (3, 2))
    bounds = {len(raw), layout.FILE_HEADER.size} | {r.end for r in regions.values()}
    for cut in range(len(raw)):
        d = workdir / f"c{cut}"
        d.mkdir()
        (d / "f.rfp").write_bytes(raw[:cut])
        root = PayloadRoot(d, retries=0)
        for name in FIELDS:
            w = [(0, total + 1)]

            def attack(name=name, w=w, root=root):
                check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

            tally.case(f"truncation: cut at {cut} of {len(raw)}, read {name}", attack)
        flag = None if cut in bounds else "f.rfp"
        verify_case(tally, f"truncation: cut at {cut}, verify", d, flag=flag)
        verify_case(tally, f"truncation: cut at {cut}, inspect", d, flag=flag, command="inspect")
        root.close()


# --------------------------------------------------------------------------- (d) writer kill


def _killed_writer(root: Path, k: int, seed: int, fd: int) -> None:
    """Grandchild: write requests forever, print each one's records once ``write`` returned."""
    from rollfeed.payload import PayloadWriter

    with PayloadWriter(root, group="live", name=f"w{k}") as w:
        for i in range(10**6):
            arrays = request_arrays(np.random.default_rng([seed, k, i]), 1 + (i * 7919) % 30000)
            segs = w.write(fields_of(arrays), pos=0, sampled=arrays[SAMPLED])
            line = json.dumps({"i": i, "segs": [s.model_dump_json() for s in segs]}) + "\n"
            os.write(fd, line.encode())


def family_kill(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """SIGKILL a writing process at random points: every record it handed out reads back exactly;
    ``verify`` passes or names the file the kill left incomplete."""
    from rollfeed.payload import PayloadRoot, PayloadSegment, read_field

    root = workdir / "root"
    seed = int(rng.integers(1 << 30))
    handed_end: dict[str, int] = {}  # killed writer's file -> body offset of its last record
    for k in range(8):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the grandchild
            try:
                tracemalloc.stop()
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                os.close(rfd)
                _killed_writer(root, k, seed, wfd)
            finally:
                os._exit(0)
        os.close(wfd)
        wait_lines = int(rng.integers(0, 4))
        buf = b""
        with os.fdopen(rfd, "rb", buffering=0) as pipe:
            while buf.count(b"\n") < wait_lines:
                chunk = pipe.read(1 << 16)
                if not chunk:
                    break
                buf += chunk
            if rng.random() < 0.7:
                signal.setitimer(signal.ITIMER_REAL, 0)
                import time

                time.sleep(float(rng.random()) * 0.004)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            buf += pipe.read()
        lines = buf.split(b"\n")[:-1]  # the last, partial line was never handed out
        reader = PayloadRoot(root, retries=0)
        for line in lines:
            item = json.loads(line)
            i = item["i"]
            arrays = request_arrays(np.random.default_rng([seed, k, i]), 1 + (i * 7919) % 30000)
            segs = [PayloadSegment.from_json(t) for t in item["segs"]]
            regions = {(s.file, s.offset): region_of(s, arrays) for s in segs}
            rows = segs[0].rows
            for name in FIELDS:

                def attack(name=name, segs=segs, rows=rows, regions=regions, reader=reader):
                    out = read_field(segs, name, (0, rows), root=reader)
                    check_read(out, segs, name, [(0, rows)], regions)

                tally.case(f"kill {k}: handed-out request {i} {name}", attack, refusal_ok=False)
        reader.close()
        records = [PayloadSegment.from_json(t) for line in lines for t in json.loads(line)["segs"]]
        handed_end[f"w{k}.rfp"] = max((s.offset for s in records), default=-1)
        from rollfeed import cli

        def check_verify(k=k):
            """Findings may name only killed writers' files, and only past their last handed-out
            record: the bytes of every record a writer handed out stay sound."""
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = cli.verify(os.fspath(root))
            text = out.getvalue()
            bad = [ln for ln in text.splitlines() if "BAD" in ln.upper() and ".rfp" in ln]
            for ln in bad:
                name = next((f for f in handed_end if f in ln), None)
                at = re.search(r"offset=(\d+)", ln)
                past = name is not None and at is not None and int(at[1]) > handed_end[name]
                if name is None or (handed_end[name] >= 0 and not past):
                    raise Wrong(f"verify after killing writer {k} returned {rc}: {text!r}")
            if rc != 0 and not bad:
                raise Wrong(f"verify after killing writer {k} returned {rc}: {text!r}")

        if root.exists():
            tally.case(f"kill {k}: verify", check_verify)
        tally.case(f"kill {k}: lines handed out {len(lines)}", lambda: None)


# --------------------------------------------------------------------------- (e) races


def _version(root: Path, v: int, counts: np.ndarray) -> tuple[list, dict]:
    """Group ``step``, writer ``w``, version ``v``: the same layout every version, new values."""
    from rollfeed.payload import PayloadWriter

    rng = np.random.default_rng(v)
    rows = len(counts)
    ids, sampled = kept_sets(rng, counts)
    arrays = {
        "routed_experts": rng.integers(1, 200, (rows, 2, 3)),
        "routed_expert_weights": rng.normal(size=(rows, 2, 3)).astype(np.float32),
        "sampling_mask": (counts, ids),
        "sampling_mask_logprobs": (counts, -rng.random(int(counts.sum())).astype(np.float32)),
        SAMPLED: sampled,
    }
    regions: dict = {}
    with PayloadWriter(root, group="step", name="w") as w:
        segs = write_request(w, arrays, regions)
    return segs, regions


def family_races(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Prune and rewrite under the same writer name while one long-lived PayloadRoot reads; many
    threads over a small descriptor cache; a symlink swapped in and out of the root."""
    import threading
    import time

    from rollfeed.payload import PayloadRoot

    root = workdir / "root"
    counts = rng.integers(1, 5, 300)
    reader = PayloadRoot(root, retries=1, backoff_s=0.001)
    orchestrator = PayloadRoot(root)
    old = _version(root, 0, counts)
    for v in range(1, 25):  # sequential: the reader holds the old file open
        for name in FIELDS:
            tally.case(
                f"races: version {v - 1} before prune, {name}",
                lambda name=name, o=old: _read_exact(reader, o, name),
            )
        orchestrator.prune("step")
        new = _version(root, v, counts)
        for name in FIELDS:
            tally.case(
                f"races: version {v} after prune and rewrite, {name}",
                lambda name=name, n=new: _read_exact(reader, n, name),
                refusal_ok=False,
            )
            tally.case(
                f"races: version {v - 1} records after the rewrite, {name}",
                lambda name=name, o=old: _read_exact(reader, o, name),
            )
        old = new
    published = [old]
    stop = threading.Event()

    def rewrite():
        v = 100
        while not stop.is_set():
            orchestrator.prune("step")
            published.append(_version(root, v, counts))
            v += 1

    t = threading.Thread(target=rewrite)
    t.start()
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            for name in FIELDS:
                tally.case(
                    f"races: concurrent prune/rewrite, {name}",
                    lambda name=name, snap=published[-1]: _read_exact(reader, snap, name),
                )
    finally:
        stop.set()
        t.join()
    _threads_over_a_small_cache(tally, workdir, rng)
    _symlink_swap(tally, workdir, rng)


def _read_exact(root, version: tuple[list, dict], name: str) -> None:
    from rollfeed.payload import read_field

    segs, regions = version
    rows = segs[0].rows
    check_read(read_field(segs, name, (0, rows), root=root), segs, name, [(0, rows)], regions)


def _threads_over_a_small_cache(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Four threads share one PayloadRoot (max_open=3) over 12 files: every read is exact."""
    import threading

    from rollfeed.payload import PayloadRoot, PayloadWriter

    base = workdir / "many"
    versions = []
    for i in range(12):
        regions: dict = {}
        with PayloadWriter(base, name=f"f{i}") as w:
            segs = write_request(w, request_arrays(rng, 40 + i), regions)
        versions.append((segs, regions))
    shared = PayloadRoot(base, max_open=3, retries=0)
    results: list[tuple[str, str]] = []

    def worker(seed: int) -> None:
        r = np.random.default_rng(seed)
        for _ in range(150):
            i, name = int(r.integers(12)), FIELDS[int(r.integers(4))]
            try:
                _read_exact(shared, versions[i], name)
                results.append(("correct", ""))
            except Wrong as err:
                results.append(("wrong", f"file f{i} {name}: {err}"))
            except BaseException as err:
                results.append(("untyped" if not typed(err) else "wrong", f"f{i} {name}: {err!r}"))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if any(t.is_alive() for t in threads):
        tally.record("hang", "races: threads over a small descriptor cache did not finish in 20 s")
    for outcome, detail in results:
        tally.record(outcome, f"races: 4 threads, max_open=3, 12 files: {detail}")


def _symlink_swap(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """A thread swaps ``g/swap.rfp`` (and directory ``sw``) between a file inside the root and
    the canary outside: reads are exact or typed, never the canary's bytes."""
    import threading
    import time

    from rollfeed.payload import PayloadRoot

    corpus = build_corpus(workdir / "swap", rng)
    inside, outside = corpus.root / "g" / "a.rfp", corpus.outside / "g" / "a.rfp"
    link, dlink = corpus.root / "g" / "swap.rfp", corpus.root / "sw"
    stop = threading.Event()

    def swap():
        k = 0
        while not stop.is_set():
            for path, target in (
                (link, [inside, outside][k % 2]),
                (dlink, [inside.parent, outside.parent][k % 2]),
            ):
                tmp = path.with_name(path.name + ".tmp")
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                tmp.symlink_to(target)
                os.replace(tmp, path)
            k += 1

    t = threading.Thread(target=swap)
    t.start()
    root = PayloadRoot(corpus.root, retries=0)
    segs, total = packed(corpus, [0, 1])
    deadline = time.monotonic() + 0.6
    try:
        while time.monotonic() < deadline:
            for alias in ("g/swap.rfp", "sw/a.rfp"):
                moved = [s.model_copy(update={"file": alias}) for s in segs]
                for name in FIELDS:
                    # the canary check runs first; the regions of the alias are unknown, so an
                    # exact read of the inside file through the symlink still counts as wrong
                    tally.case(
                        f"races: symlink swap {alias}, {name}",
                        lambda name=name, m=moved: check_read(
                            _read(m, name, total, root), m, name, [(0, total)], corpus.regions
                        ),
                    )
    finally:
        stop.set()
        t.join()


def _read(segs, name, total, root):
    from rollfeed.payload import read_field

    return read_field(segs, name, (0, total), root=root)


# --------------------------------------------------------------------------- (f) step lines

GOOD = {
    "token_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "advantages": [0.0, 0.5, 0.5],
    "inference_logprobs": [0.0, -0.7, -0.1],
}


def crafted_lines() -> list[tuple[str, bytes]]:
    """``(description, line)``: step-file lines an orchestrator bug or an attacker could write."""

    def rec(**kw):
        return json.dumps({**GOOD, **kw}).encode()

    deep = 100_000
    lines = [
        ("list instead of object", b"[1, 2, 3]"),
        ("string", b'"sample"'),
        ("number", b"7"),
        ("null", b"null"),
        ("empty object", b"{}"),
        ("deep list nesting", b"[" * deep + b"]" * deep),
        ("deep object nesting", b'{"a":' * deep + b"1" + b"}" * deep),
        ("deep nesting in token_ids", rec()[:-1] + b', "uid": ' + b"[" * deep + b"]" * deep + b"}"),
        ("not JSON", b"token_ids=1,2,3"),
        ("invalid UTF-8", b'{"token_ids": [1], "\xff\xfe": 1}'),
        ("NUL bytes", b'{"token_ids\x00": [1]}'),
        ("truncated", rec()[:-7]),
        ("fields as a list", rec(fields=[1, 2])),
        ("fields entry as a list", rec(fields={"sampling_mask": [[0, 1, 1], [5, 6]]})),
        ("fields entry as a string", rec(fields={"sampling_mask": "x"})),
        ("payload as a string", rec(payload="abc")),
        ("payload as an object", rec(payload={"field": "x"})),
        ("payload entry as a list", rec(payload=[[1, 2]])),
        ("uid as a list", rec(uid=[1])),
        ("duplicate keys", b'{"token_ids": [1], "token_ids": [1, 2, 3], ' + rec()[1:]),
    ]
    for key in ("token_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures"):
        for what, value in [
            ("2**63", [1, 2**63, 3]), ("2**64", [1, 2**64, 3]), ("10**400", [1, 10**400, 3]),
            ("-2**63-1", [1, -(2**63) - 1, 3]), ("1e400", [1, 1e400, 3]), ("string", "abc"),
            ("object", {"a": 1}), ("nested lists", [[1, 2], [3]]), ("bools", [True, False, True]),
            ("nulls", [None, None, None]), ("too short", [1]), ("empty", []),
            ("mixed", [1, "a", 2.5]), ("float 1.5", [1, 1.5, 2]),
        ]:  # fmt: skip
            lines.append((f"{key} {what}", rec(**{key: value})))
    for key in ("advantages", "inference_logprobs", "temperatures"):
        for bad in ("NaN", "Infinity", "-Infinity"):
            line = json.dumps({**GOOD, key: [0.0, 0.0, 0.0]}).encode()
            lines.append(
                (f"{key} {bad} on a loss token", line.replace(b"0.0]", bad.encode() + b"]"))
            )
    fixed = {"dtype": "uint8", "shape": [3, 2], "data": [1, 2, 3, 4, 5, 6]}
    for what, edit in [
        ("huge shape", {"shape": [3, 2**40]}), ("negative shape", {"shape": [-1, 2]}),
        ("shape string", {"shape": "x"}), ("dtype object", {"dtype": "object"}),
        ("dtype V8", {"dtype": "V8"}), ("dtype U3", {"dtype": "U3"}), ("dtype 5", {"dtype": 5}),
        ("dtype M8", {"dtype": "datetime64[s]"}), ("data nested", {"data": [[[1]] * 6]}),
        ("data strings", {"data": ["a"] * 6}), ("data 2**70", {"data": [2**70] * 6}),
        ("no data", {"data": None}), ("shape of 40 dims", {"shape": [1] * 40, "data": [1]}),
        ("wide shape", {"shape": [3, 2**20], "data": [1, 2, 3, 4, 5, 6]}),
    ]:  # fmt: skip
        lines.append(
            (f"inline routed_experts {what}", rec(fields={"routed_experts": {**fixed, **edit}}))
        )
    ragged = {"counts": [0, 1, 1], "values": [5, 6]}
    for what, edit in [
        ("counts 2**40", {"counts": [0, 2**40, 1]}), ("counts 2**63", {"counts": [0, 2**63, 1]}),
        ("negative counts", {"counts": [0, -1, 1]}), ("counts floats", {"counts": [0, 1.5, 1]}),
        ("values 2**40", {"values": [5, 2**40]}), ("values strings", {"values": ["a", "b"]}),
        ("values nested", {"values": [[5], [6]]}), ("no values", {"values": None}),
        ("counts object", {"counts": {"a": 1}}),
    ]:  # fmt: skip
        lines.append(
            (f"inline sampling_mask {what}", rec(fields={"sampling_mask": {**ragged, **edit}}))
        )
    seg = {
        "field": "routed_experts",
        "file": "g/a.rfp",
        "offset": 70,
        "pos": 0,
        "rows": 0,
        "dtype": "float64",
        "shape": [2**24 - 1],
    }
    for what, edit in [
        ("zero rows, huge row shape", {}), ("rows 2**62", {"rows": 2**62, "shape": [2, 3]}),
        ("first 2**62-1", {"rows": 3, "first": 2**62 - 1, "dtype": "uint8", "shape": [2, 3]}),
        ("shape [2**31, 2**31]", {"shape": [2**31, 2**31]}), ("offset true", {"offset": True}),
        ("file ../x", {"file": "../outside/g/a.rfp", "rows": 3, "dtype": "uint8", "shape": [2, 3]}),
    ]:  # fmt: skip
        lines.append((f"payload segment {what}", rec(payload=[{**seg, **edit}])))
    return lines


def _loss_bearing_nonfinite(data) -> bool:
    if not isinstance(data, dict):
        return False
    mask = data.get("loss_mask")
    for key in ("advantages", "inference_logprobs"):
        vals = data.get(key)
        if isinstance(vals, list) and isinstance(mask, list) and len(vals) == len(mask):
            for t in range(1, len(vals)):
                if mask[t] == 1 and isinstance(vals[t], float) and not math.isfinite(vals[t]):
                    return True
    return False


def family_steps(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Crafted lines: ``Sample.from_json``, ``parse_sample``, whole step files and step indexes
    raise typed errors; an accepted line holds exactly its JSON values, and goes through
    ``prepare_batch`` and ``to_tensor_micro_batch`` with typed errors only (non-finite
    advantages or logprobs on loss-bearing tokens must be refused on the way)."""
    from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
    from rollfeed.loaders.step_files import read_step_file
    from rollfeed.loaders.step_index import build_step_index, parse_sample, read_step_index

    corpus = build_corpus(workdir, rng)
    good = json.dumps(GOOD).encode()
    for j, (what, line) in enumerate(crafted_lines()):
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            data = None

        def through(sample, data=data):
            """Accepted: holds its JSON values exactly, then the collate pipeline."""
            ids = data.get("token_ids") if isinstance(data, dict) else None
            if isinstance(ids, list) and sample.token_ids.tolist() != ids:
                raise Wrong(f"token_ids {data['token_ids']} became {sample.token_ids.tolist()}")
            plan = prepare_batch([sample], PlanConfig(seq_len=64), dp_size=1)
            for mb in plan[0]:
                to_tensor_micro_batch(mb, cp_rank=0, root=corpus.root)
            if _loss_bearing_nonfinite(data):
                raise Wrong("a non-finite advantage or logprob on a loss-bearing token passed")

        if data is not None:
            tally.case(
                f"steps: Sample.from_json {what}",
                lambda line=line, f=through: f(Sample.from_json(line)),
            )
        tally.case(
            f"steps: parse_sample {what}",
            lambda line=line, f=through: f(parse_sample(line, file="s.jsonl", line_number=3)),
        )
        path = workdir / f"s{j}" / "step_000001.jsonl"
        path.parent.mkdir()
        path.write_bytes(b"\n".join([good, good, line, good]) + b"\n")

        def whole(path=path, what=what):
            from rollfeed.loaders.errors import StepFileError

            try:
                samples = read_step_file(path)
            except StepFileError as err:
                if err.line != 3:
                    raise Wrong(f"the error names line {err.line}, the crafted line is 3") from None
                raise
            if len(samples) != 4:
                raise Wrong(f"{len(samples)} samples from a file of 4 lines ({what})")

        tally.case(f"steps: read_step_file with {what} at line 3", whole)
        tally.case(
            f"steps: build_step_index with {what} at line 3",
            lambda path=path: build_step_index(path),
        )
    step = workdir / "idx" / "step_000001.jsonl"
    step.parent.mkdir()
    step.write_bytes(b"\n".join([good] * 3) + b"\n")
    size = step.stat().st_size
    ok = {
        "format": "rollfeed.step_index",
        "version": 1,
        "file_bytes": size,
        "lengths": [3] * 3,
        "offsets": [0, size // 3, 2 * size // 3],
        "sizes": [size // 3] * 3,
        "lines": [1, 2, 3],
    }
    for what, text in [
        ("list", b"[1, 2]"), ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
        ("huge ints", json.dumps({**ok, "lengths": [2**70] * 3}).encode()),
        ("floats", json.dumps({**ok, "offsets": [0.5, 1.5, 2.5]}).encode()),
        ("nested arrays", json.dumps({**ok, "lines": [[1], [2], [3]]}).encode()),
        ("strings", json.dumps({**ok, "sizes": "abc"}).encode()),
        ("file_bytes 1e400", json.dumps({**ok, "file_bytes": 1e400}).encode()),
        ("file_bytes NaN", json.dumps({**ok, "file_bytes": float("nan")}).encode()),
        ("null arrays", json.dumps({**ok, "lengths": None}).encode()),
        ("invalid UTF-8", b'{"format": "\xff"}'),
    ]:  # fmt: skip
        ipath = step.with_name("step_000001.index.json")
        ipath.write_bytes(text)
        tally.case(f"steps: step index {what}", lambda: read_step_index(step))


# --------------------------------------------------------------------------- (g) memory claims


def family_memory(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Records and headers claiming sizes beyond a file of a few KiB: typed refusals, never an
    allocation beyond ``ALLOC_BOUND``; ``verify`` of such files too."""
    from rollfeed.payload import PayloadRoot, layout, read_field

    base = workdir / "base"
    segs, regions, _, raw, _ = small_file(base, rng, (3, 130))
    root = PayloadRoot(base, retries=0)
    fixed = next(s for s in segs if s.field == "routed_experts" and s.rows)
    weights = next(s for s in segs if s.field == "routed_expert_weights" and s.rows)
    ragged = next(s for s in segs if s.field == "sampling_mask" and s.rows == 130)
    claims = []
    for shape in ([2**24 - 1], [2**23], [2**20], [2**16, 2**7], [2**12] * 2, [1 << 22, 1]):
        for rows in (0, 1):
            claims.append(
                (
                    f"fixed rows={rows} shape={shape} float64",
                    [
                        weights.model_copy(
                            update={"rows": rows, "shape": tuple(shape), "dtype": "float64"}
                        )
                    ],
                )
            )
            claims.append(
                (
                    f"fixed rows={rows} shape={shape} uint8",
                    [fixed.model_copy(update={"rows": rows, "shape": tuple(shape)})],
                )
            )
    for rows in (2**20, 2**26, 2**31, 2**40, 2**62 - 1):
        claims.append((f"fixed rows={rows}", [fixed.model_copy(update={"rows": rows})]))
    for sub, values in (("values", (2**20, 2**26, 2**28, 2**31)), ("rows", (2**20, 2**26, 2**31))):
        for x in values:
            lay = ragged.ragged.model_copy(update={sub: x})
            upd = {"ragged": lay}
            if sub == "rows":
                upd["rows"] = x
            claims.append((f"ragged layout {sub}={x}", [ragged.model_copy(update=upd)]))
    lay = ragged.ragged.model_copy(update={"block_rows": 1 << 30})
    claims.append(("ragged block_rows=2**30", [ragged.model_copy(update={"ragged": lay})]))
    for what, claim in claims:
        for w in ([(0, 64)], [(0, 3)]):
            name = claim[0].field
            tally.case(
                f"memory: {what} window {w}",
                lambda c=claim, name=name, w=w: check_read(
                    read_field(c, name, w, root=root), c, name, w, regions
                ),
            )
    # headers that claim as much as the records do, so a record-vs-header check alone passes
    rh = dict(struct_fields(layout.REGION_HEADER))
    names = [
        "magic",
        "kind",
        "count_bytes",
        "dtype",
        "name_len",
        "block_rows",
        "rows",
        "values",
        "body_bytes",
    ]
    at = dict(zip(names, sorted(rh), strict=False))
    head = ragged.offset - layout.REGION_HEADER.size - len(ragged.field)
    for rows, values, block in ((1, 2**28, 128), (2**26, 0, 128), (130, 2**31, 128), (130, 4, 1)):
        blob = bytearray(raw)
        for key, x in (("rows", rows), ("values", values), ("block_rows", block)):
            code = rh[at[key]]
            blob[head + at[key] : head + at[key] + struct.calcsize("<" + code)] = struct.pack(
                "<" + code, x
            )
        d = workdir / f"h{rows}_{values}_{block}"
        d.mkdir()
        (d / "f.rfp").write_bytes(bytes(blob))
        lay = ragged.ragged.model_copy(update={"rows": rows, "values": values, "block_rows": block})
        claim = [ragged.model_copy(update={"rows": min(rows, 130), "ragged": lay})]
        r = PayloadRoot(d, retries=0)
        tally.case(
            f"memory: header and record claim rows={rows} values={values} block={block}",
            lambda c=claim, r=r: check_read(
                read_field(c, "sampling_mask", (0, 64), root=r),
                c,
                "sampling_mask",
                [(0, 64)],
                regions,
            ),
        )
        verify_case(
            tally,
            f"memory: verify header rows={rows} values={values} block={block}",
            d,
            flag="f.rfp",
        )


TRACED = ("memory", "steps")
FAMILIES = {
    "records": family_records,
    "bytes": family_bytes,
    "truncation": family_truncation,
    "kill": family_kill,
    "races": family_races,
    "steps": family_steps,
    "memory": family_memory,
    "step_replace": lambda *a: __import__("tests.loaders.step_attacks", fromlist=["_"]).family(*a),
}


def main(argv: list[str]) -> None:
    family, workdir, seed = argv[0], Path(argv[1]), int(argv[2])
    rng = np.random.default_rng([seed, *family.encode()])
    import rollfeed.cli
    import rollfeed.loaders  # noqa: F401  (imported before tracemalloc starts: imports are slow under it)

    tally = Tally(family, workdir, trace=family in TRACED)
    FAMILIES[family](tally, workdir, rng)
    print(json.dumps(tally.summary()))


if __name__ == "__main__":
    main(sys.argv[1:])
