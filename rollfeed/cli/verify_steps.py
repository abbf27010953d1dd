"""``python -m rollfeed verify ROOT --steps DIR``: every record of every step file in ``DIR``
checked against the payload root ``ROOT``.

Each step file is read as the loader reads it (:mod:`rollfeed.cli.step_samples`: through its
index, each sample's record held to its index row), and each sample's segment records are read
back from the root field by field over the whole sample, as a trainer would read them: the files
exist under the root, every record lies within its region and its region within its file; with
``--checksums`` the CRC-32C of every block read is checked too.
A sample whose read fails is read again record by record, so each finding names the step file,
its sample, the field, the record's token position and the payload file and offset. Only the
bytes the records name are read: ``verify ROOT`` checks the files themselves.

Exits 0 when every record of every step file is readable, else 1.

Example text::

    BAD step_000002.rfs sample 2 (uid s2): sampling_mask at pos 4: the segment's region ends
        past the file [file=a/w0.rfp, offset=812]
    17 of 18 samples in 2 step files have readable records (31 segments read)

``--json`` prints one object instead::

    command     "verify"
    root        the root as given;  steps_dir: DIR as given;  checksums: true / false
    totals      {step_files, samples, sound, segments, findings}: sound counts the samples
                without a finding, segments the records read
    steps       [{step, step_file, samples, sound, segments, findings}], by step
    findings    [{type, message, step_file, step, sample, uid, field, pos, file, offset}]: the
                keys a finding does not know are left out. A finding of the step file as a
                whole (it cannot be opened, the loader refuses its footer or index: the loader
                refuses the step) has no sample, unless the index names the one at fault; a
                record finding names field, pos and what the payload error knows of file and
                offset
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rollfeed.cli.errors import UsageError
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import CLEAN, FINDINGS, count, write_json
from rollfeed.cli.root_scan import check_directory
from rollfeed.cli.step_samples import step_finding, step_finding_line, step_numbers, walk_steps
from rollfeed.collate import Sample
from rollfeed.payload import PayloadError, PayloadRoot, PayloadSegment, read_field

Problem = tuple[str, PayloadSegment | None, PayloadError]  # field, the record at fault, error


def record_problems(sample: Sample, root: PayloadRoot) -> tuple[int, list[Problem]]:
    """``(records read, problems)`` of ``sample``'s segment records: each field read over the
    whole sample, a failed field again record by record to name the one at fault (``None``
    when no single record fails alone, e.g. two records overlapping)."""
    problems: list[Problem] = []
    for name in sorted({s.field for s in sample.payload}):
        mine = [s for s in sample.payload if s.field == name]
        try:
            read_field(mine, name, (0, len(sample)), root=root)
            continue
        except PayloadError as whole:
            failed = whole
        alone: list[Problem] = []
        for seg in mine:
            try:
                read_field([seg], name, (seg.pos, seg.end), root=root)
            except PayloadError as err:
                alone.append((name, seg, err))
        problems += alone or [(name, None, failed)]
    return len(sample.payload), problems


def verify_records(
    root_dir: str, steps_dir: str, steps: list[int], *, checksums: bool, progress: Progress
) -> dict[str, Any]:
    """The report (the ``--json`` object) of the records of ``steps`` in ``steps_dir`` checked
    against the payload root ``root_dir``."""
    root = PayloadRoot(root_dir, retries=0, verify_checksums=checksums)
    findings: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    try:
        for step, got in walk_steps(steps_dir, steps, progress):
            if got is None:
                rows.append({"step": step.step, "step_file": step.name, "samples": step.samples})
                row = rows[-1]
                row.update(sound=0, segments=0, findings=0)
                if step.problem is not None:
                    findings.append(step_finding(step, step.problem))
                    row["findings"] += 1
                continue
            at = {"sample": got.sample}
            if got.error is not None:
                findings.append(step_finding(step, got.error, **at))
                row["findings"] += 1
                continue
            assert got.value is not None
            read, problems = record_problems(got.value, root)
            row["segments"] += read
            row["sound"] += not problems
            row["findings"] += len(problems)
            for name, seg, err in problems:
                where = {"uid": got.value.uid, "field": name}
                if seg is not None:
                    where["pos"] = seg.pos if err.pos is None else err.pos
                findings.append(step_finding(step, err, **at, **where))
    finally:
        root.close()
    return {
        "command": "verify",
        "root": root_dir,
        "steps_dir": steps_dir,
        "checksums": checksums,
        "totals": {
            "step_files": len(rows),
            **{k: sum(r[k] for r in rows) for k in ("samples", "sound", "segments")},
            "findings": len(findings),
        },
        "steps": rows,
        "findings": findings,
    }


def run_verify_steps(args: argparse.Namespace) -> int:
    """``verify ROOT --steps DIR [--checksums] [--json] [--progress]``; exit 0 sound, 1 not."""
    if args.group:
        raise UsageError(
            "--group selects the payload files verify scans; with --steps every record of "
            "every step file is checked: give one or the other"
        )
    check_directory(args.root, "payload root")
    steps = step_numbers(args.steps)
    progress = Progress("verify --steps", show=args.progress)
    report = verify_records(
        args.root, args.steps, steps, checksums=args.checksums, progress=progress
    )
    if args.json:
        write_json(report, sys.stdout)
    else:
        print_report(report)
    return FINDINGS if report["findings"] else CLEAN


def print_report(report: dict[str, Any]) -> None:
    """The text of a report: each finding, then the totals."""
    for f in report["findings"]:
        print(step_finding_line(f))
    t = report["totals"]
    checked = ", checksums checked" if report["checksums"] else ""
    print(
        f"{t['sound']} of {count(t['samples'], 'sample')} in "
        f"{count(t['step_files'], 'step file')} have readable records "
        f"({t['segments']} segments read{checked})"
    )
