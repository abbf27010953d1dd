"""Attack family ``cli_steps`` of the adversary harness (:mod:`tests.payload.adversary`):
``verify ROOT --steps DIR`` over step directories holding a crafted line, a segment record no
writer made, or an index that is stale or gone.

The loader is the oracle: a :class:`~rollfeed.loaders.RolloutDataset` over the same directory,
each sample's records read back with :func:`~rollfeed.payload.read_fields`. ``verify`` must
return 0 or 1 (never 2 for valid arguments, never raise), print one JSON object, and name
exactly the samples (by step file, sample and line) the loader cannot read; a step the loader
refuses whole (an index it refuses, an unindexed file with a bad line) must have a finding.
A case matching the oracle with no finding is ``correct``; with findings, ``refused`` (the first
finding's typed error is raised again from its record); any disagreement is ``wrong``.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np

from tests.cli.common import write_root_and_steps
from tests.payload.adversary_steps import crafted_lines
from tests.payload.adversary_tally import Tally, Wrong

VICTIM = 2  # the step whose file is attacked; step 1 stays sound


def _loader_view(steps: Path, root: Path) -> tuple[set[int], set[tuple[int, int]]]:
    """``(steps the loader refuses whole, (step, sample) it cannot read)``."""
    from rollfeed.errors import RollfeedError
    from rollfeed.loaders import RolloutDataset
    from rollfeed.loaders.dataset import STEP_STRIDE
    from rollfeed.payload import PayloadRoot, read_fields

    ds = RolloutDataset.from_step_dir(steps)
    reader = PayloadRoot(root, retries=0)
    whole, failing = set(), set()
    for step in ds.steps_from(0):
        try:
            n = len(ds.lengths(step))
        except RollfeedError:
            whole.add(step)
            continue
        for i in range(n):
            try:
                s = ds[step * STEP_STRIDE + i]
                fields = {x.field for x in s.payload}
                if fields:
                    read_fields(s.payload, {f: (0, len(s)) for f in fields}, root=reader)
            except RollfeedError:
                failing.add((step, i))
    reader.close()
    return whole, failing


def _verify(steps: Path, root: Path) -> dict:
    from rollfeed.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", str(root), "--steps", str(steps), "--json"])
    if rc not in (0, 1):
        raise Wrong(f"verify exited {rc}: {err.getvalue()[-300:]}")
    report = json.loads(out.getvalue())
    if (rc == 1) != bool(report["findings"]):
        raise Wrong(f"exit {rc} with {len(report['findings'])} findings")
    return report


def _check(steps: Path, root: Path) -> None:
    """One case: verify's findings against the loader's view (module doc)."""
    report = _verify(steps, root)
    whole, failing = _loader_view(steps, root)
    named = {(f["step"], f["sample"]) for f in report["findings"] if "sample" in f}
    stepwise = {f["step"] for f in report["findings"]}
    if not whole <= stepwise:
        raise Wrong(f"the loader refuses steps {sorted(whole)}; verify names {sorted(stepwise)}")
    kept = {(s, i) for s, i in named if s not in whole}
    if kept != failing:
        raise Wrong(f"verify names samples {sorted(kept)}, the loader fails {sorted(failing)}")
    for f in report["findings"]:
        if "sample" in f and f["line"] != f["sample"] + 1:  # the files here have no blank line
            raise Wrong(f"sample {f['sample']} named on line {f['line']}")
    if report["findings"]:  # agreed: verify refused the data with this error (tally: refused)
        raise _typed(report["findings"][0])


def _typed(finding: dict) -> Exception:
    """The typed rollfeed error a finding names, made again from its record."""
    import rollfeed.collate.errors
    import rollfeed.loaders.errors
    import rollfeed.payload.errors

    for module in (rollfeed.payload.errors, rollfeed.loaders.errors, rollfeed.collate.errors):
        kind = getattr(module, finding["type"], None)
        if kind is not None:
            return kind(finding["message"])
    return Wrong(f"a finding of an unknown type: {finding}")


def _case_dir(base, workdir: Path, j: int) -> Path:
    steps = workdir / f"c{j}"
    shutil.copytree(base.steps, steps)
    return steps


def family_cli_steps(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Crafted lines (index removed, stale, or rebuilt when the line parses) and mutated segment
    records, each in step ``VICTIM``'s file; see the module doc for the oracle."""
    from rollfeed.loaders.errors import StepFileError
    from rollfeed.loaders.step_files import step_file_name
    from rollfeed.loaders.step_index import build_step_index, index_path

    base = write_root_and_steps(workdir / "base", n=4)
    tally.case("cli_steps: sound directory", lambda: _check(base.steps, base.root))
    lines = crafted_lines()
    picked = rng.choice(len(lines), 20, replace=False)
    j = 0
    for k in sorted(picked.tolist()):
        what, line = lines[k]
        for index in ("removed", "stale", "rebuilt"):
            j += 1
            steps = _case_dir(base, workdir, j)
            path = steps / step_file_name(VICTIM)
            text = path.read_bytes().splitlines(keepends=True)
            text[1] = line.replace(b"\n", b" ") + b"\n"
            path.write_bytes(b"".join(text))
            if index == "removed":
                index_path(path).unlink()
            elif index == "rebuilt":
                try:
                    build_step_index(path)
                except StepFileError:
                    continue  # a line the index builder refuses: covered by "stale"
            tally.case(
                f"cli_steps: {what} on line 2, index {index}",
                lambda steps=steps: _check(steps, base.root),
            )
    victims = [(i, s) for i, s in enumerate(base.handle[VICTIM]) if s.payload]
    other = sorted(str(p.relative_to(base.root)) for p in base.root.rglob("*.rfp"))
    for i, sample in victims[:2]:
        for kseg, seg in enumerate(sample.payload[:2]):
            edits = [
                ("offset + 1", {"offset": seg.offset + 1}),
                ("offset - 8", {"offset": max(seg.offset - 8, 0)}),
                ("offset + 10**6", {"offset": seg.offset + 10**6}),
                ("first + 1", {"first": seg.first + 1}),
                ("first + 2**40", {"first": seg.first + 2**40}),
                ("another file", {"file": next(f for f in other if f != seg.file)}),
                ("a missing file", {"file": "step_000002/none.rfp"}),
                ("a file outside", {"file": "../outside.rfp"}),
                ("an absolute file", {"file": str(base.root / seg.file)}),
                ("another dtype", {"dtype": "int64" if seg.dtype != "int64" else "uint8"}),
                ("file_id + 1", {"file_id": (seg.file_id or 0) + 1}),
                ("no file_id", {"file_id": None}),
            ]
            if seg.ragged is None:
                edits.append(("shape + 1", {"shape": [*seg.shape[:-1], seg.shape[-1] + 1]}))
            else:
                layout = seg.ragged.model_dump()
                edits.append(
                    ("ragged values + 1", {"ragged": {**layout, "values": layout["values"] + 1}})
                )
            for what, edit in edits:
                j += 1
                steps = _case_dir(base, workdir, j)
                record = sample.to_dict()
                record["payload"][kseg] = {**record["payload"][kseg], **edit}
                path = steps / step_file_name(VICTIM)
                text = path.read_bytes().splitlines(keepends=True)
                text[i] = json.dumps(record).encode() + b"\n"
                path.write_bytes(b"".join(text))
                try:
                    build_step_index(path)
                except StepFileError:
                    index_path(path).unlink()
                tally.case(
                    f"cli_steps: sample {i} record {kseg} {seg.field} with {what}",
                    lambda steps=steps: _check(steps, base.root),
                )
