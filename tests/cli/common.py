"""A payload root and a step directory written by the project's own writers, for the command
line's tests, with the samples' inline twins as the oracle of what the records hold."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollfeed.cli import main
from rollfeed.collate import Sample
from rollfeed.loaders import step_file_name, write_step_file
from rollfeed.payload import PayloadWriter
from tests.collate.gen import make_batch

STEPS = (1, 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class Written:
    root: Path
    steps: Path
    inline: dict[int, list[Sample]]  # per step: the samples with every field inline
    handle: dict[int, list[Sample]]  # the same samples by handle, as the step files hold them

    def step_file(self, step: int) -> Path:
        return self.steps / step_file_name(step)


def write_root_and_steps(tmp_path: Path, *, n: int = 5, seq_len: int = 12) -> Written:
    """Per step ``k``: group ``step_00000k`` of the root (two writers), ``n`` samples of up to
    ``3 * seq_len`` tokens by handle (routing, kept sets, their logprobs; records split
    mid-request) in ``steps/step_00000k.rfs``."""
    rng = np.random.default_rng(7)
    root, steps = tmp_path / "root", tmp_path / "steps"
    inline, handle = {}, {}
    for step in STEPS:
        group = f"step_{step:06d}"
        with (
            PayloadWriter(root, group=group, name="a") as wa,
            PayloadWriter(root, group=group, name="b") as wb,
        ):
            inline[step], handle[step] = make_batch(rng, n, seq_len, [wa, wb])
        write_step_file(steps, step, handle[step])
    return Written(root=root, steps=steps, inline=inline, handle=handle)


def run(capsys, *argv) -> tuple[int, str, str]:
    """``python -m rollfeed ARGV`` in process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


def run_json(capsys, *argv) -> tuple[int, dict]:
    """The same with ``--json``: stdout is exactly one JSON object."""
    rc, out, _ = run(capsys, *argv, "--json")
    return rc, json.loads(out)
