"""Command line: ``python -m rollfeed demo | inspect ROOT | verify ROOT``."""

from __future__ import annotations

import argparse
import collections
import os
import sys

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


def demo(workdir: str | None, *, prompts: int, samples: int, max_tokens: int) -> int:
    """Tiny MoE -> vLLM rollouts captured by handle -> 2 DP x 2 CP/SP trainer ranks -> report."""
    from rollfeed.demo.run import run_demo

    return run_demo(workdir, prompts=prompts, samples=samples, max_tokens=max_tokens)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollfeed")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="vLLM rollouts captured by handle, scored by torchrun ranks (needs vLLM)"
    )
    d.add_argument("--workdir", default=None, help="default: ~/.cache/rollfeed/demo")
    d.add_argument("--prompts", type=int, default=16)
    d.add_argument("--samples", type=int, default=4, help="completions per prompt")
    d.add_argument("--max-tokens", type=int, default=48)
    for name, help_text in (
        ("inspect", "summarise a payload root"),
        ("verify", "check a payload root"),
    ):
        sub.add_parser(name, help=help_text).add_argument("root")
    args = ap.parse_args(argv)
    if args.command == "demo":
        return demo(
            args.workdir, prompts=args.prompts, samples=args.samples, max_tokens=args.max_tokens
        )
    if not os.path.isdir(args.root):
        print(f"{args.root}: not a directory", file=sys.stderr)
        return 2
    return inspect(args.root) if args.command == "inspect" else verify(args.root)
