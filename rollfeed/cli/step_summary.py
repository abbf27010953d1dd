"""``python -m rollfeed steps DIR [--seq-len N] [--root ROOT]``: what each step of a step
directory holds.

Per step file: its samples, their tokens (total; min / median / max sample length) and loss
tokens (``loss_mask`` 1); with ``--seq-len N``, what truncation at ``N`` (the planner's
``overlong="truncate"``: a sample keeps its first ``N`` tokens) would do: samples cut, tokens and
loss tokens dropped; with ``--root ROOT``, the kept-set widths of the ids recorded per token (the
fields declared ``label="omitted"``, the sampling mask: inline rows and the rows their records
read from ``ROOT``, the sampled token included): rows, mean, p99 (the smallest width that at
least 99% of rows do not exceed) and max. Samples are read as the loader reads them
(:mod:`rollfeed.cli.step_samples`); a sample that cannot be read, or whose kept sets cannot be
read, is a finding (exit 1) and is left out of the numbers.

Example text::

    steps: 2 step files, 11 samples, 640 tokens (seq-len 64; kept sets from root/)
    step    samples   tokens  length min/median/max  loss tokens   cut  dropped   kept mean/p99/max
    1             6      300         12 / 49 / 120          210     2       84     2.61 / 7 / 7
    2             5      340         30 / 60 / 100          260     3       52     2.48 / 7 / 7

``--json`` prints one object instead::

    command     "steps"
    steps_dir   DIR as given;  seq_len: N or null;  root: ROOT or null
    totals      {step_files, samples, tokens, loss_tokens, samples_cut, tokens_dropped,
                loss_tokens_dropped, support_width, findings}: the cut and dropped counts are
                null without --seq-len; support_width as below, over every step
    steps       [{step, step_file, samples, tokens, length, loss_tokens, samples_cut,
                tokens_dropped, loss_tokens_dropped, support_width, findings}], by step;
                length: {min, median, max} (null for a step of no readable sample);
                support_width: {rows, mean, p99, max}, the kept-set widths (null without
                --root, or with no kept row; the key was ``kept_width`` before this release)
    findings    [{type, message, step_file, step, sample}] (+ field, pos, file, offset for a
                kept-set read)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from rollfeed.cli.progress import Progress
from rollfeed.cli.report import CLEAN, FINDINGS, count, shown, write_json
from rollfeed.cli.root_scan import check_directory
from rollfeed.cli.step_samples import step_finding, step_finding_line, step_numbers, walk_steps
from rollfeed.collate import Sample
from rollfeed.payload import PAYLOAD_FIELDS, PayloadError, PayloadRoot, RaggedRows, read_fields

_TRUNCATION = ("samples_cut", "tokens_dropped", "loss_tokens_dropped")


def kept_widths(sample: Sample, root: PayloadRoot, names: list[str]) -> np.ndarray:
    """``[rows]`` int64 width of each recorded kept set of ``sample`` (inline and by handle)."""
    out = []
    for name in names:
        inline = sample.fields.get(name)
        if inline is not None:
            counts = np.asarray(inline[0])  # type: ignore[index]
            out.append(counts[counts > 0])
        mine = [s for s in sample.payload if s.field == name]
        if mine:
            got = read_fields(mine, {name: (0, len(sample))}, root=root)[name]
            assert isinstance(got.values, RaggedRows)  # a ragged field read without a width
            out.append(got.values.lengths().numpy()[got.coverage.numpy()])
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def width_stats(histogram: np.ndarray) -> dict[str, Any] | None:
    """``{rows, mean, p99, max}`` of the widths counted in ``histogram`` (``[w]``: rows of
    width ``w``); None when it counts no row."""
    rows = int(histogram.sum())
    if rows == 0:
        return None
    widths = np.arange(len(histogram))
    cumulative = np.cumsum(histogram)
    return {
        "rows": rows,
        "mean": round(float((widths * histogram).sum() / rows), 3),
        "p99": int(np.searchsorted(cumulative, 0.99 * rows)),
        "max": int(np.flatnonzero(histogram)[-1]),
    }


def _add(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    size = max(len(total), len(more))
    return np.pad(total, (0, size - len(total))) + np.pad(more, (0, size - len(more)))


class _StepCounts:
    """What one step's readable samples add up to, as they are read."""

    def __init__(self, step: int, name: str) -> None:
        self.step, self.name = step, name
        self.lengths: list[int] = []
        self.loss = 0
        self.cut = np.zeros(3, np.int64)  # samples cut, tokens and loss tokens dropped
        self.histogram = np.zeros(0, np.int64)  # kept-set widths: rows of each width
        self.findings = 0

    def add(self, sample: Sample, seq_len: int | None) -> None:
        self.lengths.append(len(sample))
        self.loss += int(sample.loss_mask.sum())
        if seq_len is not None:
            over = max(len(sample) - seq_len, 0)
            self.cut += (over > 0, over, int(sample.loss_mask[seq_len:].sum()))

    def row(self, seq_len: int | None, kept: bool) -> dict[str, Any]:
        """The step's ``--json`` entry (module doc)."""
        arr = np.asarray(self.lengths, np.int64)
        span = None
        if len(arr):
            span = {"min": int(arr.min()), "median": float(np.median(arr)), "max": int(arr.max())}
        row: dict[str, Any] = {
            "step": self.step,
            "step_file": self.name,
            "samples": len(arr),
            "tokens": int(arr.sum()),
            "length": span,
            "loss_tokens": self.loss,
        }
        cut = [None if seq_len is None else int(v) for v in self.cut]
        row.update(zip(_TRUNCATION, cut, strict=True))
        row["support_width"] = width_stats(self.histogram) if kept else None
        row["findings"] = self.findings
        return row


def run_steps(args: argparse.Namespace) -> int:
    """``steps DIR [--seq-len N] [--root ROOT] [--json] [--progress]``; exit 0, 1 findings."""
    steps = step_numbers(args.dir)
    root = None
    if args.root is not None:
        check_directory(args.root, "payload root")
        root = PayloadRoot(args.root, retries=0)
    names = [n for n, f in PAYLOAD_FIELDS.items() if f.ragged and f.label == "omitted"]
    n = args.seq_len
    counts: list[_StepCounts] = []
    findings: list[dict[str, Any]] = []
    try:
        for step, got in walk_steps(args.dir, steps, Progress("steps", show=args.progress)):
            if got is None:
                counts.append(_StepCounts(step.step, step.name))
                if step.problem is not None:
                    findings.append(step_finding(step, step.problem))
                    counts[-1].findings += 1
                continue
            at = {"sample": got.sample}
            if got.error is not None:
                findings.append(step_finding(step, got.error, **at))
                counts[-1].findings += 1
                continue
            assert got.value is not None
            if root is not None:
                try:
                    widths = np.bincount(kept_widths(got.value, root, names))
                except PayloadError as err:
                    findings.append(step_finding(step, err, **at, uid=got.value.uid))
                    counts[-1].findings += 1
                    continue
                counts[-1].histogram = _add(counts[-1].histogram, widths)
            counts[-1].add(got.value, n)
    finally:
        if root is not None:
            root.close()
    rows = [c.row(n, root is not None) for c in counts]
    totals: dict[str, Any] = {"step_files": len(rows)}
    for key in ("samples", "tokens", "loss_tokens", *_TRUNCATION):
        totals[key] = None if n is None and key in _TRUNCATION else sum(r[key] for r in rows)
    every = np.zeros(0, np.int64)
    for c in counts:
        every = _add(every, c.histogram)
    totals["support_width"] = width_stats(every) if root is not None else None
    totals["findings"] = len(findings)
    report = {
        "command": "steps",
        "steps_dir": args.dir,
        "seq_len": n,
        "root": args.root,
        "totals": totals,
        "steps": rows,
        "findings": findings,
    }
    if args.json:
        write_json(report, sys.stdout)
    else:
        _print(report)
    return FINDINGS if findings else CLEAN


def _print(report: dict[str, Any]) -> None:
    t, n = report["totals"], report["seq_len"]
    notes = [f"seq-len {n}"] if n is not None else []
    if report["root"] is not None:
        notes.append(f"kept sets from {shown(report['root'])}")
    print(
        f"{shown(report['steps_dir'])}: {count(t['step_files'], 'step file')}, "
        f"{count(t['samples'], 'sample')}, "
        f"{t['tokens']} tokens{' (' + '; '.join(notes) + ')' if notes else ''}"
    )
    head = (
        f"{'step':<8}{'samples':>8}{'tokens':>10}{'length min/median/max':>24}{'loss tokens':>13}"
    )
    head += f"{'cut':>6}{'dropped':>9}" if n is not None else ""
    head += f"{'kept mean/p99/max':>20}" if report["root"] is not None else ""
    print(head)
    for r in report["steps"]:
        span = "-" if r["length"] is None else "{min} / {median:g} / {max}".format(**r["length"])
        text = f"{r['step']:<8}{r['samples']:>8}{r['tokens']:>10}{span:>24}{r['loss_tokens']:>13}"
        if n is not None:
            text += f"{r['samples_cut']:>6}{r['tokens_dropped']:>9}"
        if report["root"] is not None:
            k = r["support_width"]
            text += f"{'-' if k is None else '{mean:.2f} / {p99} / {max}'.format(**k):>20}"
        print(text)
    for f in report["findings"]:
        print(step_finding_line(f))
