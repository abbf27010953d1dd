"""``python -m rollfeed.bench payload``: payload bytes per token, window read cost vs raw preadv,
and what checksums cost.

Prints:
- mask bytes per completion token (CSR, as written to disk, headers and checksum tables
  included) at a mean of 1.7 and of 8 kept ids, against a padded ``[T, 32]`` int32 layout, and
  the share of the checksum tables;
- routing bytes per token for 48 layers x top-8 of 128 experts (uint8) against int32 / int64;
- the time to read one micro batch's window (16,384 tokens; routing ``[T, 48, 8]`` uint8 plus the
  CSR mask, spread over 64 request files) with one ``read_fields`` call, as ``raw / ours`` where
  raw is ``os.preadv`` of exactly the same byte ranges into one preallocated buffer with the files
  already open (goal >= 0.7);
- the same read checking every block's CRC-32C (``PayloadRoot(verify_checksums=True)``), against
  the plain read, and the share of the checksum tables in the time to write those requests.

Both sides run interleaved in one process on the page cache, median of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict

import numpy as np

from rollfeed.payload import PayloadRoot, PayloadWriter, read_fields
from rollfeed.payload.checksum import fixed_block_rows, fixed_table, ragged_table, table_entries
from rollfeed.payload.layout import (
    BLOCK_ROWS,
    FILE_HEADER,
    REGION_HEADER,
    index_bytes,
    ragged_bytes,
    values_start,
)


def kept_counts(rng: np.random.Generator, n: int, mean: float) -> np.ndarray:
    """Kept-set sizes with a heavy singleton mass: 1 + a geometric tail with the requested mean."""
    if mean <= 1:
        return np.ones(n, np.int64)
    return rng.geometric(1.0 / mean, n).astype(np.int64)


def request_arrays(rng: np.random.Generator, per: int, mean: float, routing: bool) -> dict:
    counts = kept_counts(rng, per, mean)
    arrays = {"sampling_mask": (counts, rng.integers(0, 151_936, counts.sum()).astype(np.int32))}
    if routing:
        arrays["routed_experts"] = rng.integers(0, 128, (per, 48, 8)).astype(np.uint8)
    return arrays


def write_requests(root: str, requests: list[dict], tag: str):
    """One file per request; returns (segments at consecutive positions, per field the bytes on
    disk per token (region headers, bodies and checksum tables) and the checksum tables' share,
    write seconds)."""
    segs, tokens, spent = [], 0, 0.0
    on_disk: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i, arrays in enumerate(requests):
        t0 = time.perf_counter()
        with PayloadWriter(root, group="bench", name=f"{tag}-{i}") as w:
            written = w.write(arrays, pos=0)
        spent += time.perf_counter() - t0
        for s in written:
            segs.append(s.model_copy(update={"pos": tokens}))
            if s.ragged is None:
                body = s.rows * s.row_bytes
                entries = table_entries(False, s.rows, fixed_block_rows(s.row_bytes))
            else:
                lay = s.ragged
                body = values_start(lay.rows, lay.count_bytes, lay.block_rows) + 4 * lay.values
                entries = table_entries(True, s.rows, lay.block_rows)
            head = REGION_HEADER.size + len(s.field.encode()) + FILE_HEADER.size / len(written)
            on_disk[s.field][0] += head + body + 4 * entries
            on_disk[s.field][1] += 4 * entries
        tokens += len(arrays["sampling_mask"][0])
    per_token = {k: (total / tokens, sums / tokens) for k, (total, sums) in on_disk.items()}
    return segs, per_token, spent


def checksum_seconds(requests: list[dict]) -> float:
    """The time the writer spends on checksum tables for ``requests`` (the same calls)."""
    t0 = time.perf_counter()
    for arrays in requests:
        if "routed_experts" in arrays:
            body = arrays["routed_experts"]
            view = memoryview(body.reshape(-1))
            fixed_table(b"header", view, len(body), body[0].nbytes)
        counts, values = arrays["sampling_mask"]
        body, cb = ragged_bytes(counts, values, dtype=np.dtype("int32"))
        ragged_table(b"header", memoryview(body), counts, cb, BLOCK_ROWS)
    return time.perf_counter() - t0


def raw_ranges(segs) -> list[tuple[str, int, int]]:
    """Byte ranges the read needs for the whole window: routing bodies, CSR index, values."""
    out = []
    for s in segs:
        if s.ragged is None:
            out.append((s.file, s.offset, s.rows * s.row_bytes))
        else:
            lay = s.ragged
            out.append((s.file, s.offset, index_bytes(lay.rows, lay.count_bytes, lay.block_rows)))
            vs = values_start(lay.rows, lay.count_bytes, lay.block_rows)
            out.append((s.file, s.offset + vs, 4 * lay.values))
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.bench payload")
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        print("payload bytes per completion token (file and region headers, checksums included)")
        for mean in (1.7, 8.0):
            reqs = [request_arrays(rng, 65_536 // 16, mean, routing=False) for _ in range(16)]
            _, per_token, _ = write_requests(tmp, reqs, f"mask{mean}")
            total, sums = per_token["sampling_mask"]
            print(
                f"  mask, mean {mean:>3} kept ids: {total:6.2f} B/token, {sums:.3f} of them", end=""
            )
            print(f" checksums  (padded [T, 32] int32: 128.00, {128 / total:5.1f}x more)")
        reqs = [
            request_arrays(rng, args.tokens // args.files, 1.7, routing=True)
            for _ in range(args.files)
        ]
        segs, per_token, write_s = write_requests(tmp, reqs, "window")
        total, sums = per_token["routed_experts"]
        print(f"  routing 48 layers x top-8 of 128 experts: {total:.2f} B/token as uint8,", end="")
        print(f" {sums:.3f} of them checksums  (int32: {48 * 8 * 4}, int64: {48 * 8 * 8})")

        plain, checking = PayloadRoot(tmp), PayloadRoot(tmp, verify_checksums=True)
        windows = {"routed_experts": (0, args.tokens), "sampling_mask": (0, args.tokens)}
        ranges = raw_ranges(segs)
        fds = {f: os.open(os.path.join(tmp, f), os.O_RDONLY) for f, _, _ in ranges}
        buf = bytearray(sum(n for _, _, n in ranges))
        view = memoryview(buf)

        def raw() -> None:
            at = 0
            for f, off, n in ranges:
                os.preadv(fds[f], [view[at : at + n]], off)
                at += n

        def ours() -> None:
            read_fields(segs, windows, root=plain)

        def checked() -> None:
            read_fields(segs, windows, root=checking)

        ours(), checked(), raw()  # warm: open files, page cache
        times: dict = {raw: [], ours: [], checked: []}
        for _ in range(args.reps):
            for fn, acc in times.items():
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        for fd in fds.values():
            os.close(fd)
        r, o, c = (statistics.median(times[f]) for f in (raw, ours, checked))
        sums_s = min(checksum_seconds(reqs) for _ in range(3))
        mib = len(buf) / 2**20
        print(
            f"read one micro batch window ({args.tokens} tokens, {args.files} files, {mib:.1f} MiB)"
        )
        print(f"  raw preadv {r * 1e3:.2f} ms, read_fields {o * 1e3:.2f} ms", end="")
        print(f" -> raw/ours = {r / o:.2f} (goal >= 0.7)")
        print(f"  checking every block's CRC-32C: {c * 1e3:.2f} ms -> checked/plain = {c / o:.2f}")
        print(
            f"  writing those {args.files} requests: {write_s * 1e3:.1f} ms, of which checksum",
            end="",
        )
        print(f" tables {sums_s * 1e3:.1f} ms ({sums_s / write_s:.0%})")
