"""Command line: ``python -m rollfeed demo | inspect ROOT | verify ROOT``."""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np

from rollfeed.payload import PayloadRoot, PayloadWriter, clip_segments, read_field, shift_segments
from rollfeed.payload.scan import payload_files, scan_file


def inspect(root: str) -> int:
    """Fields, files, regions and bytes per token of a payload root; oldest and newest group."""
    files = payload_files(root)
    if not files:
        print(f"{root}: no payload files")
        return 1
    per_field: dict[str, list[int]] = collections.defaultdict(
        lambda: [0, 0, 0]
    )  # regions, rows, bytes
    groups: dict[str, float] = {}
    for rel in files:
        scan = scan_file(root, rel)
        group = os.path.dirname(rel) or "."
        groups[group] = max(groups.get(group, 0.0), scan.mtime)
        for _, h in scan.regions:
            stats = per_field[h.field]
            stats[0], stats[1], stats[2] = (
                stats[0] + 1,
                stats[1] + h.rows,
                stats[2] + h.size + h.body_bytes,
            )
    total = sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"{root}: {len(files)} files, {len(groups)} groups, {total / 2**20:.2f} MiB")
    for name, (regions, rows, nbytes) in sorted(per_field.items()):
        print(
            f"  {name:<28} {regions:>6} regions {rows:>10} rows {nbytes / max(rows, 1):8.2f} B/row"
        )
    ordered = sorted(groups, key=groups.get)
    print(f"  oldest group: {ordered[0]}   newest group: {ordered[-1]}")
    return 0


def verify(root: str) -> int:
    """Check every file's headers, region chain, sizes and CSR indexes; list the bad ones."""
    bad = 0
    files = payload_files(root)
    for rel in files:
        scan = scan_file(root, rel)
        if scan.problems:
            bad += 1
            print(f"BAD {rel}: {'; '.join(scan.problems)}")
    print(f"{len(files) - bad} of {len(files)} payload files are sound")
    return 1 if bad else 0


def demo(root: str | None) -> int:
    """Write a step's side channels by handle, clip and pack the handles, read CP windows."""
    with tempfile.TemporaryDirectory() as tmp:
        root = root or os.path.join(tmp, "payload")
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        samples = []
        for i in range(8):
            prompt, completion = int(rng.integers(16, 64)), int(rng.integers(32, 256))
            counts = rng.geometric(1 / 1.7, completion)
            with PayloadWriter(root, group="step_000001", name=f"request_{i:03d}") as writer:
                segs = writer.write(
                    {
                        "routed_experts": rng.integers(0, 64, (prompt + completion - 1, 4, 2)),
                        "sampling_mask": (counts, rng.integers(0, 1024, counts.sum())),
                    },
                    pos={"routed_experts": 0, "sampling_mask": prompt},
                )
            samples.append((prompt + completion, segs))
        written = time.perf_counter() - t0
        # Pack the samples (truncated at 256 tokens) one after another into one micro batch.
        packed, at = [], 0
        for length, segs in samples:
            keep = min(length, 256)
            packed += shift_segments(clip_segments(segs, 0, keep), at)
            at += keep
        t0 = time.perf_counter()
        payload = PayloadRoot(root)
        half = at // 2
        for cp_rank, window in enumerate([(0, half), (half, at)]):
            experts = read_field(packed, "routed_experts", window, root=payload)
            mask = read_field(packed, "sampling_mask", window, root=payload)
            print(
                f"cp rank {cp_rank}: routed_experts {tuple(experts.shape)} {experts.dtype}, "
                f"sampling_mask {tuple(mask.shape)} {mask.dtype}, "
                f"{int((mask >= 0).sum())} kept ids"
            )
        read = time.perf_counter() - t0
        records = sum(len(s.model_dump_json()) for s in packed)
        print(f"{len(samples)} requests, {at} packed tokens, ", end="")
        print(f"{len(packed)} segment records ({records} B of JSON)")
        print(f"write {written * 1e3:.1f} ms, read both windows {read * 1e3:.1f} ms")
        inspect(root)
        return verify(root)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollfeed")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="write, clip, pack and read back a step of payload")
    d.add_argument("--root", default=None, help="payload root (default: a temporary directory)")
    for name, help_text in (
        ("inspect", "summarise a payload root"),
        ("verify", "check a payload root"),
    ):
        sub.add_parser(name, help=help_text).add_argument("root")
    args = ap.parse_args(argv)
    if args.command == "demo":
        return demo(args.root)
    if not os.path.isdir(args.root):
        print(f"{args.root}: not a directory", file=sys.stderr)
        return 2
    return inspect(args.root) if args.command == "inspect" else verify(args.root)
