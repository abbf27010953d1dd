"""``python -m rollfeed inspect ROOT``: what a payload root holds, per field and per group.

Reads region headers and CSR indexes only (no checksums: that is ``verify``). Exits 1 when
anything under the root is corrupted or unreadable, listing each finding (the summary then
covers only the regions before each file's first problem).

``--json`` prints one object instead of the text::

    command       "inspect"
    root          the root as given
    group_filter  the --group patterns ([] for every group)
    totals        {entries, files, groups, bytes, regions, rows, findings}: entries counts the
                  files scanned and the entries refused (symlinks, FIFOs, vanished files)
    fields        {name: {regions, rows, bytes, bytes_per_row}}: bytes of headers and bodies
    groups        [{group, files, bytes, regions, rows, newest_mtime, findings}], by name
    files         [{file, group, bytes, mtime, regions, problem}], by path; problem: a finding
                  record (rollfeed.cli.report) or null
    oldest_group, newest_group   by the newest file of each group (null with no file)
    findings      [finding record], refused entries first, then broken files by path

Example text (two groups, one field)::

    /data/root: 2 files, 2 groups, 0.01 MiB
      routed_experts                    2 regions         20 rows    12.00 B/row
      oldest group: step_000001   newest group: step_000002
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

from rollfeed.cli.groups import group_of
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import CLEAN, FINDINGS, line, record, shown, write_json
from rollfeed.cli.root_scan import scan_groups
from rollfeed.payload.scan.scan import RootScan


def inspect_report(scan: RootScan, patterns: list[str]) -> dict[str, Any]:
    """The ``--json`` object of ``scan`` (module doc)."""
    fields: dict[str, dict[str, Any]] = collections.defaultdict(
        lambda: {"regions": 0, "rows": 0, "bytes": 0}
    )
    groups: dict[str, dict[str, Any]] = {}
    files = []
    for file in scan.scans:
        name = group_of(file.file)
        group = groups.setdefault(name, _group(name))
        rows = sum(h.rows for _, h in file.regions)
        group["files"] += 1
        group["bytes"] += file.size
        group["regions"] += len(file.regions)
        group["rows"] += rows
        newest = group["newest_mtime"]
        group["newest_mtime"] = file.mtime if newest is None else max(newest, file.mtime)
        for _, h in file.regions:
            stats = fields[h.field]
            stats["regions"] += 1
            stats["rows"] += h.rows
            stats["bytes"] += h.size + h.body_bytes
        files.append(
            {
                "file": file.file,
                "group": name,
                "bytes": file.size,
                "mtime": file.mtime,
                "regions": len(file.regions),
                "problem": None if file.problem is None else record(file.problem),
            }
        )
    for err in scan.problems:
        name = group_of(err.file or ".")
        groups.setdefault(name, _group(name))["findings"] += 1
    for stats in fields.values():
        stats["bytes_per_row"] = round(stats["bytes"] / max(stats["rows"], 1), 2)
    dated = sorted((g for g in groups.values() if g["files"]), key=lambda g: g["newest_mtime"])
    return {
        "command": "inspect",
        "root": scan.root,
        "group_filter": patterns,
        "totals": {
            "entries": scan.entries,
            "files": len(scan.scans),
            "groups": len(groups),
            "bytes": sum(f.size for f in scan.scans),
            "regions": sum(g["regions"] for g in groups.values()),
            "rows": sum(g["rows"] for g in groups.values()),
            "findings": len(scan.problems),
        },
        "fields": dict(sorted(fields.items())),
        "groups": [groups[k] for k in sorted(groups)],
        "files": files,
        "oldest_group": dated[0]["group"] if dated else None,
        "newest_group": dated[-1]["group"] if dated else None,
        "findings": [record(err) for err in scan.problems],
    }


def _group(name: str) -> dict[str, Any]:
    return {
        "group": name,
        "files": 0,
        "bytes": 0,
        "regions": 0,
        "rows": 0,
        "newest_mtime": None,
        "findings": 0,
    }


def run_inspect(args: argparse.Namespace) -> int:
    """``inspect ROOT [--group PATTERN]... [--json] [--progress]``; exit 0 clean, 1 findings."""
    progress = Progress("inspect", show=args.progress)
    scan = scan_groups(args.root, checksums=False, groups=args.group, progress=progress)
    report = inspect_report(scan, args.group)
    if args.json:
        write_json(report, sys.stdout)
    else:
        _print(report, scan)
    return FINDINGS if scan.problems else CLEAN


def _print(report: dict[str, Any], scan: RootScan) -> None:
    totals = report["totals"]
    chosen = f" (groups {', '.join(map(shown, report['group_filter']))})"
    print(
        f"{shown(report['root'])}{chosen if report['group_filter'] else ''}: "
        f"{totals['files']} files, {totals['groups']} groups, {totals['bytes'] / 2**20:.2f} MiB"
    )
    for name, stats in report["fields"].items():
        print(
            f"  {shown(name):<28} {stats['regions']:>6} regions {stats['rows']:>10} rows"
            f" {stats['bytes_per_row']:8.2f} B/row"
        )
    if report["oldest_group"] is not None:
        print(
            f"  oldest group: {shown(report['oldest_group'])}   "
            f"newest group: {shown(report['newest_group'])}"
        )
    problems = scan.problems
    if problems:
        print(
            f"CORRUPTED: {len(problems)} of {scan.entries} entries; the summary above stops at "
            "each one's first problem:"
        )
        for err in problems:
            print(f"  {line(err)}")
