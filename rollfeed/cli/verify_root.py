"""``python -m rollfeed verify ROOT``: every file's headers, region chain, sizes, CSR indexes and
the checksum of every block, listed file by file.

Prints ``BAD <file>: <finding>`` for each problem, then ``<k> of <n> payload files are sound``;
exits 0 only when every entry is sound, else 1. ``--steps DIR`` checks the records of a step
directory against the root instead (:mod:`rollfeed.cli.verify_steps`).

``--json`` prints one object instead of the text::

    command       "verify"
    root          the root as given
    group_filter  the --group patterns ([] for every group)
    totals        {entries, files, sound, bytes, findings}: entries counts the files scanned
                  and the entries refused (symlinks, FIFOs, vanished files); sound: entries
                  without a finding
    groups        [{group, files, sound, bytes, findings}], by name
    files         [{file, group, bytes, regions, sound}], by path (regions: before the first
                  problem)
    findings      [finding record (rollfeed.cli.report)], refused entries first, then broken
                  files by path
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rollfeed.cli.groups import group_of
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import CLEAN, FINDINGS, line, record, write_json
from rollfeed.cli.root_scan import scan_groups
from rollfeed.payload.scan.scan import RootScan


def verify_report(scan: RootScan, patterns: list[str]) -> dict[str, Any]:
    """The ``--json`` object of ``scan`` (module doc)."""
    groups: dict[str, dict[str, Any]] = {}

    def group(path: str) -> dict[str, Any]:
        name = group_of(path)
        return groups.setdefault(
            name, {"group": name, "files": 0, "sound": 0, "bytes": 0, "findings": 0}
        )

    files = []
    for file in scan.scans:
        g = group(file.file)
        g["files"] += 1
        g["bytes"] += file.size
        g["sound"] += file.problem is None
        files.append(
            {
                "file": file.file,
                "group": group_of(file.file),
                "bytes": file.size,
                "regions": len(file.regions),
                "sound": file.problem is None,
            }
        )
    for err in scan.problems:
        group(err.file or ".")["findings"] += 1
    problems = scan.problems
    return {
        "command": "verify",
        "root": scan.root,
        "group_filter": patterns,
        "totals": {
            "entries": scan.entries,
            "files": len(scan.scans),
            "sound": scan.entries - len(problems),
            "bytes": sum(f.size for f in scan.scans),
            "findings": len(problems),
        },
        "groups": [groups[k] for k in sorted(groups)],
        "files": files,
        "findings": [record(err) for err in problems],
    }


def run_verify_root(args: argparse.Namespace) -> int:
    """``verify ROOT [--group PATTERN]... [--json] [--progress]``; exit 0 sound, 1 findings."""
    progress = Progress("verify", show=args.progress)
    scan = scan_groups(args.root, checksums=True, groups=args.group, progress=progress)
    if args.json:
        write_json(verify_report(scan, args.group), sys.stdout)
    else:
        for err in scan.problems:
            print(f"BAD {line(err)}")
        print(f"{scan.entries - len(scan.problems)} of {scan.entries} payload files are sound")
    return CLEAN if not scan.problems else FINDINGS
