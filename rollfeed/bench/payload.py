"""``python -m rollfeed.bench payload``: payload bytes per token and window read cost vs raw preadv.

Prints:
- mask bytes per completion token (CSR, as written to disk, headers included) at a mean of 1.7
  and of 8 kept ids, against a padded ``[T, 32]`` int32 layout;
- routing bytes per token for 48 layers x top-8 of 128 experts (uint8) against int32 / int64;
- the time to read one micro batch's window (16,384 tokens; routing ``[T, 48, 8]`` uint8 plus the
  CSR mask, spread over 64 request files), as ``raw / ours`` where raw is ``os.preadv`` of exactly
  the same byte ranges into one preallocated buffer with the files already open (goal >= 0.7).

Both sides run interleaved in one process on the page cache, median of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from rollfeed.payload import PayloadRoot, PayloadWriter, read_field
from rollfeed.payload.layout import index_bytes, values_start


def kept_counts(rng: np.random.Generator, n: int, mean: float) -> np.ndarray:
    """Kept-set sizes with a heavy singleton mass: 1 + a geometric tail with the requested mean."""
    if mean <= 1:
        return np.ones(n, np.int64)
    return rng.geometric(1.0 / mean, n).astype(np.int64)


def write_requests(
    root: str, rng: np.random.Generator, files: int, tokens: int, mean: float, routing: bool
):
    segs, file_bytes = [], 0
    per = tokens // files
    for i in range(files):
        counts = kept_counts(rng, per, mean)
        arrays = {
            "sampling_mask": (counts, rng.integers(0, 151_936, counts.sum()).astype(np.int32))
        }
        if routing:
            arrays["routed_experts"] = rng.integers(0, 128, (per, 48, 8)).astype(np.uint8)
        with PayloadWriter(root, group="bench", name=f"req{mean}-{routing}-{i}") as w:
            written = w.write(arrays, pos=0)
        for s in written:
            segs.append(s.model_copy(update={"pos": i * per}))
        file_bytes += os.path.getsize(os.path.join(root, "bench", f"req{mean}-{routing}-{i}.rfp"))
    return segs, file_bytes / tokens  # bytes on disk per token, headers included


def raw_ranges(segs) -> list[tuple[str, int, int]]:
    """Byte ranges read_field needs for the whole window: routing bodies, CSR index, values."""
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
        print("payload bytes per completion token")
        for mean in (1.7, 8.0):
            _, per_token = write_requests(tmp, rng, 16, 65_536, mean, routing=False)
            ratio = 128 / per_token
            print(f"  mask, mean {mean:>3} kept ids: {per_token:6.2f} B/token", end="")
            print(f"  (padded [T, 32] int32: 128.00, {ratio:5.1f}x more)")
        row = 48 * 8
        print(f"  routing 48 layers x top-8 of 128 experts: {row} B/token as uint8", end="")
        print(f"  (int32: {row * 4}, int64: {row * 8})")

        segs, _ = write_requests(tmp, rng, args.files, args.tokens, 1.7, routing=True)
        root = PayloadRoot(tmp)
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
            read_field(segs, "routed_experts", (0, args.tokens), root=root)
            read_field(segs, "sampling_mask", (0, args.tokens), root=root)

        ours(), raw()  # warm: open files, page cache
        t_raw, t_ours = [], []
        for _ in range(args.reps):
            for fn, acc in ((raw, t_raw), (ours, t_ours)):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        for fd in fds.values():
            os.close(fd)
        r, o = statistics.median(t_raw), statistics.median(t_ours)
        mib = len(buf) / 2**20
        print(
            f"read one micro batch window ({args.tokens} tokens, {args.files} files, {mib:.1f} MiB)"
        )
        print(f"  raw preadv {r * 1e3:.2f} ms, read_field {o * 1e3:.2f} ms", end="")
        print(f" -> raw/ours = {r / o:.2f} (goal >= 0.7)")
