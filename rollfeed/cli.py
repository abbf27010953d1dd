"""Command line: ``python -m rollfeed demo | serve ... | inspect ROOT | verify ROOT``."""

from __future__ import annotations

import argparse
import collections
import os
import sys

from rollfeed.payload.errors import PayloadError
from rollfeed.payload.scan.scan import RootScan, scan_root


def _shown(name: str) -> str:
    """``name`` as printed: quoted when it holds a newline, control or undecodable character."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return ascii(name)
    return name if name.isprintable() else ascii(name)


def _finding(err: PayloadError) -> str:
    place = [
        f"{k}={_shown(str(v))}"
        for k, v in (("field", err.field), ("offset", err.offset))
        if v is not None
    ]
    where = f" [{', '.join(place)}]" if place else ""
    return f"{_shown(err.file or '.')}: {_shown(err.message)}{where}"


def _scan(root: str, *, checksums: bool) -> RootScan | None:
    """The scan of ``root``, or ``None`` (after saying why) when it holds no payload files."""
    scan = scan_root(root, checksums=checksums)
    if not scan.entries:
        print(
            f"no payload files found under {_shown(root)} (payload files end in .rfp)",
            file=sys.stderr,
        )
        return None
    return scan


def inspect(root: str) -> int:
    """Fields, files, regions and bytes per token of a payload root; oldest and newest group.

    Exits 1 when anything under the root is corrupted or unreadable, listing each finding (the
    summary then covers only the regions before each file's first problem).
    """
    scan = _scan(root, checksums=False)
    if scan is None:
        return 1
    per_field: dict[str, list[int]] = collections.defaultdict(
        lambda: [0, 0, 0]
    )  # regions, rows, bytes
    groups: dict[str, float] = {}
    for file in scan.scans:
        group = os.path.dirname(file.file) or "."
        groups[group] = max(groups.get(group, 0.0), file.mtime)
        for _, h in file.regions:
            stats = per_field[h.field]
            stats[0], stats[1], stats[2] = (
                stats[0] + 1,
                stats[1] + h.rows,
                stats[2] + h.size + h.body_bytes,
            )
    total = sum(file.size for file in scan.scans)
    print(f"{_shown(root)}: {len(scan.scans)} files, {len(groups)} groups, {total / 2**20:.2f} MiB")
    for name, (regions, rows, nbytes) in sorted(per_field.items()):
        print(
            f"  {_shown(name):<28} {regions:>6} regions {rows:>10} rows"
            f" {nbytes / max(rows, 1):8.2f} B/row"
        )
    if groups:
        ordered = sorted(groups, key=groups.get)
        print(f"  oldest group: {_shown(ordered[0])}   newest group: {_shown(ordered[-1])}")
    problems = scan.problems
    if problems:
        print(
            f"CORRUPTED: {len(problems)} of {scan.entries} entries; the summary above stops at "
            "each one's first problem:"
        )
        for err in problems:
            print(f"  {_finding(err)}")
        return 1
    return 0


def verify(root: str) -> int:
    """Check every file's headers, region chain, sizes, CSR indexes and block checksums; list the
    bad ones."""
    scan = _scan(root, checksums=True)
    if scan is None:
        return 1
    for err in scan.problems:
        print(f"BAD {_finding(err)}")
    sound = scan.entries - len(scan.problems)
    print(f"{sound} of {scan.entries} payload files are sound")
    return 0 if sound == scan.entries else 1


def demo(
    workdir: str | None,
    *,
    prompts: int,
    samples: int,
    max_tokens: int,
    server: str | None,
    loss: tuple[str, ...] = (),
) -> int:
    """Tiny MoE -> capture server rollouts by handle -> 2 DP x 2 CP trainer ranks -> report."""
    from rollfeed.demo.run import run_demo

    return run_demo(
        workdir,
        prompts=prompts,
        samples=samples,
        max_tokens=max_tokens,
        server=server,
        loss=loss,
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:  # vLLM's serve flags are parsed by vLLM's own parser
        from rollfeed.capture.server import main as serve

        return serve(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m rollfeed")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server plus the capture route: --payload-root R --model M [vllm flags]",
    )
    d = sub.add_parser(
        "demo", help="rollouts from a capture server by handle, scored by torchrun ranks (vLLM)"
    )
    d.add_argument(
        "--workdir",
        default=None,
        help="locked while the demo runs (default: a fresh directory under ~/.cache/rollfeed/demo)",
    )
    d.add_argument("--prompts", type=int, default=16)
    d.add_argument("--samples", type=int, default=4, help="completions per prompt")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument(
        "--server",
        default=None,
        help="a running capture server (http://host:port) with --payload-root WORKDIR/payload "
        "and the demo's model (default: the demo starts its own)",
    )
    d.add_argument("--clip-eps", type=float, default=0.2, help="the PPO clip's ε (0: no clip)")
    d.add_argument(
        "--correction",
        choices=("none", "tis", "icepop", "trust"),
        default="tis",
        help="the token-level importance weight (rollfeed.demo.objective)",
    )
    d.add_argument(
        "--centering", action=argparse.BooleanOptionalAction, default=True, help="score centering"
    )
    for name, help_text in (
        ("inspect", "summarise a payload root"),
        ("verify", "check a payload root"),
    ):
        sub.add_parser(name, help=help_text).add_argument("root")
    args = ap.parse_args(argv)
    if args.command == "demo":
        return demo(
            args.workdir,
            prompts=args.prompts,
            samples=args.samples,
            max_tokens=args.max_tokens,
            server=args.server,
            loss=(
                *("--clip-eps", str(args.clip_eps)),
                *("--correction", args.correction),
                "--centering" if args.centering else "--no-centering",
            ),
        )
    if not os.path.isdir(args.root):
        what = "is not a directory" if os.path.lexists(args.root) else "does not exist"
        print(f"{_shown(args.root)} {what}: give the payload root directory", file=sys.stderr)
        return 2
    return inspect(args.root) if args.command == "inspect" else verify(args.root)
