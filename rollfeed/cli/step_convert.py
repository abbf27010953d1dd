"""``python -m rollfeed steps convert DIR [--remove]``: JSON-lines step files as step record files.

Step files were once JSON lines (``step_000042.jsonl``, one :meth:`~rollfeed.collate.Sample.to_json`
object per line, and an index ``step_000042.index.json``); the loader reads step record files
only (``step_000042.rfs``, :mod:`rollfeed.loaders.step_files`) and refuses a directory holding a
JSON-lines step without its record file, naming this command. It converts each such step once:
its lines are read in order (opened without following a symlink and never waiting on a FIFO; a
line at most 256 MiB, no NUL byte; blank lines hold no sample), each parsed alone and appended to
a :class:`~rollfeed.loaders.StepWriter`, which puts ``step_000042.rfs`` in place whole once every
line has parsed. A step that has its record file already is left as it is (running the command
again converts what is left). A line that does not parse is a finding naming the file and the line
(exit 1): that step is not converted (nothing of it is written) and the others are. With
``--remove`` the JSON-lines file and its index are deleted once their step is converted.

Example::

    $ python -m rollfeed steps convert /run/steps
    step_000000.jsonl -> step_000000.rfs: 128 samples, 1048576 tokens, 54.7 MB -> 8.5 MB
    BAD step_000001.jsonl line 7: malformed sample record (...)
    converted 1 of 2 step files (1 finding)
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Iterator

from rollfeed.cli.errors import UsageError
from rollfeed.cli.report import CLEAN, FINDINGS, count, shown
from rollfeed.cli.root_scan import check_directory
from rollfeed.collate import Sample
from rollfeed.errors import RollfeedError
from rollfeed.loaders.step_files import StepWriter, parse_json_step_name, step_file_name

MAX_LINE_BYTES = 1 << 28  # 256 MiB: one sample's record, its payload by handle
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LineError(RollfeedError):
    """A JSON-lines step file's line (or the file itself) that is not a sample: names the file and
    the 1-based line."""

    PLACE = ("file", "line")


def json_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of each non-blank line of ``path`` (see the module doc for the
    bounds); :class:`LineError` for what is not a JSON-lines file."""
    try:
        fd = os.open(path, _OPEN)
    except OSError as err:
        why = f"cannot be opened ({err.strerror}; a symlink is not followed)"
        raise LineError(why, file=path) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LineError("not a regular file", file=path)
        number = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise LineError(
                    f"a line of more than {MAX_LINE_BYTES} bytes", file=path, line=number
                )
            if b"\0" in line:
                raise LineError("a NUL byte, which no JSON line holds", file=path, line=number)
            if line.strip():
                yield number, line


def convert_step(directory: str, step: int, old: str) -> tuple[int, int]:
    """Step ``step``'s JSON-lines file ``old`` (a name in ``directory``) written as its step record
    file; ``(samples, tokens)``. Raises :class:`LineError` (nothing written)."""
    path = os.path.join(directory, old)
    samples = tokens = 0
    with StepWriter(directory, step) as writer:
        for number, line in json_lines(path):
            try:
                sample = Sample.from_json(line)
            except RollfeedError as err:
                raise LineError(f"{type(err).__name__}: {err}", file=path, line=number) from None
            writer.append(sample)
            samples, tokens = samples + 1, tokens + len(sample)
    return samples, tokens


def run_convert(args: argparse.Namespace) -> int:
    """``steps convert DIR [--remove]``; exit 0 every step converted, 1 findings."""
    directory = args.dir
    check_directory(directory, "step")
    names = sorted(os.listdir(directory))
    old = {s: n for n in names if (s := parse_json_step_name(n)) is not None}
    if not old:
        raise UsageError(
            f"no JSON-lines step files (step_NNNNNN.jsonl) in {shown(directory)}: nothing to "
            "convert"
        )
    done, findings = 0, 0
    for step, name in sorted(old.items()):
        new = step_file_name(step)
        path = os.path.join(directory, name)
        if new in names:
            print(f"{shown(name)}: {new} is there already, left as it is")
        else:
            try:
                samples, tokens = convert_step(directory, step, name)
            except LineError as err:
                findings += 1
                where = f" line {err.line}" if err.line is not None else ""
                print(f"BAD {shown(name)}{where}: {shown(err.message)}")
                continue
            size = os.path.getsize(path), os.path.getsize(os.path.join(directory, new))
            print(
                f"{shown(name)} -> {new}: {count(samples, 'sample')}, {tokens} tokens, "
                f"{size[0] / 1e6:.1f} MB -> {size[1] / 1e6:.1f} MB"
            )
        done += 1
        if args.remove:
            os.unlink(path)
            index = os.path.join(directory, name.removesuffix(".jsonl") + ".index.json")
            if os.path.lexists(index):
                os.unlink(index)
    bad = f" ({count(findings, 'finding')})" if findings else ""
    print(f"converted {done} of {count(len(old), 'step file')}{bad}")
    return FINDINGS if findings else CLEAN
