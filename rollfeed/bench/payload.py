"""``python -m rollfeed.bench payload``: payload bytes per token, window read cost vs raw preadv,
and what checksums cost.

Prints:
- mask bytes per completion token (as written to disk: file and region headers, bodies and
  checksum tables) for kept sets of a mean of 1.7 ids (60% singletons), of 8, and a heavy-tailed
  distribution (45% singletons, p99 about 80 ids), against a padded ``[T, W]`` int32 layout
  (``W`` the widest row) and against the format-2 CSR layout (whole rows, 4-byte ids);
- routing bytes per token for 48 layers x top-8 of 128 experts (uint8) against int32 / int64;
- the time to read one micro batch's window (16,384 tokens; routing ``[T, 48, 8]`` uint8 plus the
  mask at a mean of 1.7 kept ids, spread over 64 request files) with one ``read_fields`` call
  (headers and file ids checked, kept sets ragged with each row's label put in its slot; the
  compiled window read where it is built, which the heading says,
  :mod:`rollfeed.payload.read.compiled_read`), as ``raw / ours`` where raw is ``os.preadv`` of
  exactly the byte ranges ours asks for (each record's region header and body), one call per
  range, into one preallocated buffer with the files already open (goal >= 0.84); routing alone,
  masks alone (goal >= 0.8), and masks alone at the heavy-tailed distribution (goal >= 0.8);
- the heavy-tailed micro batch's mask field in bytes, against ``4·nnz + 8·(n + 1)`` (its ids,
  each row's label counted, and its offsets; goal <= 1.2x) and the padded ``[n, W]`` int32;
- contention: the masks' window (mean 1.7) read ragged and padded to a static ``width=``, with
  every core free and with one core held busy by another process (``while 1: pass``), rounds
  interleaved: each busy/free ratio (the padded form is made on one thread,
  :mod:`rollfeed.payload.ragged_pad`: torch's fan-out to a thread on the busy core made it 15x
  slower);
- the same read checking every block's CRC-32C (``PayloadRoot(verify_checksums=True)``), against
  the plain read (the two interleaved in a round of their own), and the share of the checksum
  tables in the time to write those requests.

Both sides run interleaved in one process on the page cache, median of ``--reps`` runs; the CPU
time of each side (kernel time included) is printed too, a steadier figure on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict

import numpy as np

from rollfeed.bench._process import busy_core
from rollfeed.payload import PayloadRoot, PayloadWriter, read_fields
from rollfeed.payload.format.checksum import (
    fixed_block_rows,
    fixed_table,
    ragged_table,
    table_entries,
)
from rollfeed.payload.format.layout import (
    BLOCK_ROWS,
    DTYPE_SIZES,
    FILE_HEADER,
    REGION_HEADER,
    ragged_bytes,
    values_start,
)
from rollfeed.payload.read.compiled_read import COMPILED

VOCAB = 151_936  # Qwen's vocabulary: ids take 3 bytes


def kept_counts(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """Kept-set sizes: ``"1.7"`` / ``"8"`` a geometric law of that mean (60% / 12% singletons);
    ``"heavy"`` 45% singletons, the rest ``2 + floor(lognormal)`` (p99 about 80 ids)."""
    if kind == "heavy":
        tail = 2 + np.floor(np.exp(rng.normal(1.3, 1.45, n)))
        return np.where(rng.random(n) < 0.45, 1, np.minimum(tail, 1024)).astype(np.int64)
    return rng.geometric(1.0 / float(kind), n).astype(np.int64)


def request_arrays(rng: np.random.Generator, per: int, kind: str, routing: bool):
    """One request of ``per`` completion tokens: its fields and its sampled tokens."""
    counts = kept_counts(rng, per, kind)
    ids = rng.integers(0, VOCAB, counts.sum()).astype(np.int32)
    sampled = ids[np.cumsum(counts) - counts]  # a kept set holds the token sampled from it
    arrays = {"sampling_mask": (counts, ids)}
    if routing:
        arrays["routed_experts"] = rng.integers(0, 128, (per, 48, 8)).astype(np.uint8)
    return arrays, sampled


def write_requests(root: str, requests: list, tag: str):
    """One file per request; returns (segments at consecutive positions, per field the bytes on
    disk per token (region headers, bodies and checksum tables) and the checksum tables' share,
    write seconds)."""
    segs, tokens, spent = [], 0, 0.0
    on_disk: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    for i, (arrays, sampled) in enumerate(requests):
        t0 = time.perf_counter()
        with PayloadWriter(root, group="bench", name=f"{tag}-{i}") as w:
            written = w.write(arrays, pos=0, sampled=sampled)
        spent += time.perf_counter() - t0
        for s in written:
            segs.append(s.model_copy(update={"pos": tokens}))
            if s.ragged is None:
                body = s.rows * s.row_bytes
                entries = table_entries(False, s.rows, fixed_block_rows(s.row_bytes))
            else:
                lay = s.ragged
                body = values_start(lay.rows, lay.count_bytes, lay.block_rows)
                body += DTYPE_SIZES[s.dtype] * lay.values
                entries = table_entries(True, s.rows, lay.block_rows)
            head = REGION_HEADER.size + len(s.field.encode()) + FILE_HEADER.size / len(written)
            on_disk[s.field][0] += head + body + 4 * entries
            on_disk[s.field][1] += 4 * entries
        tokens += len(arrays["sampling_mask"][0])
    per_token = {k: (total / tokens, sums / tokens) for k, (total, sums) in on_disk.items()}
    return segs, per_token, spent


def format_2_bytes(requests: list) -> float:
    """Mask bytes per token in the format-2 CSR layout (whole rows, 4-byte values), headers and
    checksum tables included, for the same requests."""
    total = tokens = 0
    for arrays, _ in requests:
        counts = arrays["sampling_mask"][0]
        cb = 1 if counts.max() < 256 else 2 if counts.max() < 1 << 16 else 4
        total += REGION_HEADER.size + len("sampling_mask") + FILE_HEADER.size
        total += values_start(len(counts), cb, BLOCK_ROWS) + 4 * int(counts.sum())
        total += 4 * table_entries(True, len(counts), BLOCK_ROWS)
        tokens += len(counts)
    return total / tokens


def checksum_seconds(requests: list) -> float:
    """The time the writer spends on checksum tables for ``requests`` (the same calls)."""
    t0 = time.perf_counter()
    for arrays, _ in requests:
        if "routed_experts" in arrays:
            body = arrays["routed_experts"]
            view = memoryview(body.reshape(-1))
            fixed_table(b"header", view, len(body), body[0].nbytes)
        counts, values = arrays["sampling_mask"]
        body, cb = ragged_bytes(counts, values, dtype="uint24")
        ragged_table(b"header", memoryview(body), counts, cb, BLOCK_ROWS, 3)
    return time.perf_counter() - t0


def raw_ranges(segs) -> list[tuple[str, int, int]]:
    """The byte ranges a window read over whole records asks for: each record's region header
    (right before its body) and its body."""
    out = []
    for s in segs:
        head = REGION_HEADER.size + len(s.field.encode())
        if s.ragged is None:
            body = s.rows * s.row_bytes
        else:
            lay = s.ragged
            body = values_start(lay.rows, lay.count_bytes, lay.block_rows)
            body += DTYPE_SIZES[s.dtype] * lay.values
        out.append((s.file, s.offset - head, head + body))
    return out


def _contention(segs, window, root, tokens, reps: int) -> None:
    """The masks' window read ragged and padded (``width=``), with every core free and with one
    held busy by another process, rounds interleaved; prints each busy/free ratio."""
    masks = [s for s in segs if s.field == "sampling_mask"]
    labels = {"sampling_mask": tokens}
    rows = read_fields(masks, {"sampling_mask": window}, root=root, labels=labels)
    width = -(-rows["sampling_mask"].values.width() // 64) * 64  # a static width that holds it

    def read(width: int | None) -> None:
        read_fields(masks, {"sampling_mask": window}, root=root, labels=labels, width=width)

    fns = {"ragged": lambda: read(None), "padded": lambda: read(width)}
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(max(1, reps // 3)):
        free, _ = _medians(fns, 3)
        with busy_core():
            busy, _ = _medians(fns, 3)
        for k in fns:
            times[f"{k} free"].append(free[k])
            times[f"{k} busy"].append(busy[k])
    t = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"  contention: the masks' window with one of {os.cpu_count()} cores held busy by another"
        " process vs all free (goal: no worse than the share of the cores lost)"
    )
    for k, what in (("ragged", "ragged"), ("padded", f"padded width={width}")):
        free, busy = t[f"{k} free"], t[f"{k} busy"]
        print(
            f"    {what:<18} {free * 1e3:6.2f} ms free, {busy * 1e3:6.2f} ms busy "
            f"-> busy/free = {busy / free:.2f}"
        )


def _medians(fns: dict, reps: int) -> tuple[dict, dict]:
    """Median wall and CPU seconds (this process, kernel time included) of each function."""
    for fn in fns.values():
        fn()  # warm: open files, page cache
    wall: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = statistics.median
    return {k: med(v) for k, v in wall.items()}, {k: med(v) for k, v in cpu.items()}


def _bytes_per_token(tmp: str, rng: np.random.Generator) -> None:
    print("mask bytes per completion token (file and region headers, checksums included)")
    for kind in ("1.7", "8", "heavy"):
        reqs = [request_arrays(rng, 65_536 // 16, kind, routing=False) for _ in range(16)]
        _, per_token, _ = write_requests(tmp, reqs, f"mask{kind}")
        total, sums = per_token["sampling_mask"]
        counts = np.concatenate([a["sampling_mask"][0] for a, _ in reqs])
        widest = int(counts.max())
        v2 = format_2_bytes(reqs)
        label = (
            f"mean {counts.mean():.1f}, {np.mean(counts == 1):.0%} singletons, "
            f"p99 {np.percentile(counts, 99):.0f}"
        )
        print(f"  {kind:>5} ({label}): {total:6.2f} B/token ({sums:.3f} checksums)")
        print(
            f"        format-2 CSR {v2:6.2f} ({v2 / total:.2f}x more), padded [T, {widest}] int32 "
            f"{4 * widest:7.2f} ({4 * widest / total:.0f}x more)"
        )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.bench payload")
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        _bytes_per_token(tmp, rng)
        reqs = [
            request_arrays(rng, args.tokens // args.files, "1.7", routing=True)
            for _ in range(args.files)
        ]
        segs, per_token, write_s = write_requests(tmp, reqs, "window")
        total, sums = per_token["routed_experts"]
        print(f"  routing 48 layers x top-8 of 128 experts: {total:.2f} B/token as uint8,", end="")
        print(f" {sums:.3f} of them checksums  (int32: {48 * 8 * 4}, int64: {48 * 8 * 8})")

        heavy = [
            request_arrays(rng, args.tokens // args.files, "heavy", routing=False)
            for _ in range(args.files)
        ]
        heavy_segs, _, _ = write_requests(tmp, heavy, "heavy")
        plain, checking = PayloadRoot(tmp), PayloadRoot(tmp, verify_checksums=True)
        window = (0, args.tokens)
        # the label of every window row: the token sampled there (each kept set's first slot)
        labels = {
            "mean 1.7": np.concatenate([sampled for _, sampled in reqs]),
            "heavy": np.concatenate([sampled for _, sampled in heavy]),
        }
        names = {
            "routing + masks": (("routed_experts", "sampling_mask"), "mean 1.7"),
            "routing alone": (("routed_experts",), "mean 1.7"),
            "masks alone": (("sampling_mask",), "mean 1.7"),
            "masks, heavy": (("sampling_mask",), "heavy"),
        }
        every = [*segs, *heavy_segs]
        fds = {s.file: os.open(os.path.join(tmp, s.file), os.O_RDONLY) for s in every}
        fns, sizes = {}, {}
        for what, (fields, kind) in names.items():
            mine = segs if kind == "mean 1.7" else heavy_segs
            ranges = raw_ranges([s for s in mine if s.field in fields])
            view = memoryview(bytearray(sum(n for _, _, n in ranges)))
            sizes[what] = (len(ranges), len(view))

            def raw(ranges=ranges, view=view) -> None:
                at = 0
                for f, off, n in ranges:
                    os.preadv(fds[f], [view[at : at + n]], off)
                    at += n

            def ours(fields=fields, mine=mine, tokens=labels[kind]) -> None:
                read_fields(
                    mine,
                    dict.fromkeys(fields, window),
                    root=plain,
                    labels={"sampling_mask": tokens} if "sampling_mask" in fields else None,
                )

            fns[(what, "raw")], fns[(what, "ours")] = raw, ours
        t, cpu = _medians(fns, args.reps)
        # The checking read runs in its own round, against the plain one: interleaved with the
        # raw/ours pairs, its scratch buffers and checksum passes evict what both sides keep
        # in the CPU caches (+0.7-1.5 ms on ours, 64 files).
        both = dict.fromkeys(names["routing + masks"][0], window)
        checks, _ = _medians(
            {
                "plain": lambda: read_fields(segs, both, root=plain),
                "checked": lambda: read_fields(segs, both, root=checking),
            },
            args.reps,
        )
        for fd in fds.values():
            os.close(fd)
        sums_s = min(checksum_seconds(reqs) for _ in range(3))
        how = "compiled read" if COMPILED else "NumPy reader: the compiled read is not built"
        print(f"read one micro batch window ({args.tokens} tokens, {args.files} files; {how})")
        for what in names:
            r, o = t[(what, "raw")], t[(what, "ours")]
            calls, size = sizes[what]
            goal = {"routing + masks": 0.84, "masks alone": 0.8, "masks, heavy": 0.8}.get(what)
            goal = f"  (goal >= {goal})" if goal else ""
            print(
                f"  {what:<15} {size / 2**20:5.2f} MiB in {calls:3d} ranges: raw preadv "
                f"{r * 1e3:5.2f} ms, read_fields {o * 1e3:5.2f} ms -> raw/ours = {r / o:.2f}{goal}"
            )
            rc, oc = cpu[(what, "raw")], cpu[(what, "ours")]
            cpu_line = f"CPU time: raw {rc * 1e3:5.2f} ms, ours {oc * 1e3:5.2f} ms"
            print(f"{'':>19}{cpu_line} -> {rc / oc:.2f}")
        rows = read_fields(
            heavy_segs,
            {"sampling_mask": window},
            root=plain,
            labels={"sampling_mask": labels["heavy"]},
        )["sampling_mask"].values
        n, nnz, widest = rows.n_rows, rows.nnz, rows.width()
        ideal = 4 * nnz + 8 * (n + 1)
        print(
            f"  the heavy-tailed micro batch's mask field ({n} rows, {nnz} ids, widest {widest}):"
            f" {rows.nbytes / 2**20:.3f} MiB = {rows.nbytes / ideal:.2f} x (4·nnz + 8·(n + 1))"
            f" (goal <= 1.2); padded [n, W] int32 {4 * n * widest / 2**20:.1f} MiB"
        )
        _contention(segs, window, plain, labels["mean 1.7"], args.reps)
        o, c = checks["plain"], checks["checked"]
        print(f"  checking every block's CRC-32C: {c * 1e3:.2f} ms -> checked/plain = {c / o:.2f}")
        print(
            f"  writing those {args.files} requests: {write_s * 1e3:.1f} ms, of which checksum",
            end="",
        )
        print(f" tables {sums_s * 1e3:.1f} ms ({sums_s / write_s:.0%})")
