"""Attack family ``cli_steps`` of the adversary harness (:mod:`tests.payload.adversary`):
``verify ROOT --steps DIR`` over step directories holding a record with a byte flipped (its
CRC-32C stale, or made to match so that only the record's structure is checked), an index or
footer with a byte flipped, or a segment record no writer made.

The loader is the oracle: a :class:`~rollfeed.loaders.RolloutDataset` over the same directory,
each sample's records read back with :func:`~rollfeed.payload.read_fields`. ``verify`` must
return 0 or 1 (never 2 for valid arguments, never raise), print one JSON object, and name
exactly the samples (by step file and sample) the loader cannot read; a step the loader refuses
whole (a footer or an index it refuses) must have a finding.
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

from rollfeed.collate import Sample
from rollfeed.errors import RollfeedError
from tests.cli.common import write_root_and_steps
from tests.loaders.step_bytes import footer_fields
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
    """Bytes flipped in step ``VICTIM``'s file (a record, its CRC-32C stale or resealed; the
    index; the footer) and mutated segment records; see the module doc for the oracle."""
    from rollfeed.loaders import write_step_file
    from rollfeed.loaders.step_files import step_file_name
    from tests.loaders.step_bytes import flip, record_span, reseal

    base = write_root_and_steps(workdir / "base", n=4)
    tally.case("cli_steps: sound directory", lambda: _check(base.steps, base.root))
    path = base.steps / step_file_name(VICTIM)
    offset, size = record_span(path, 1)
    index_at, total = footer_fields(path)[0], path.stat().st_size
    j = 0
    for at in sorted(rng.choice(size, 25, replace=False).tolist()):
        for resealed in (False, True):
            j += 1
            steps = _case_dir(base, workdir, j)
            flip(steps / step_file_name(VICTIM), offset + at)
            if resealed:
                reseal(steps / step_file_name(VICTIM))
            state = "resealed" if resealed else "CRC-32C stale"
            tally.case(
                f"cli_steps: record 1 byte {at} flipped, {state}",
                lambda steps=steps: _check(steps, base.root),
            )
    for at in sorted(rng.choice(total - index_at, 12, replace=False).tolist()):
        j += 1
        steps = _case_dir(base, workdir, j)
        flip(steps / step_file_name(VICTIM), index_at + at)
        where = "index" if index_at + at < total - 48 else "footer"
        tally.case(
            f"cli_steps: {where} byte {at} flipped",
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
                samples = list(base.handle[VICTIM])
                try:
                    samples[i] = Sample.from_dict(record)
                except RollfeedError:
                    continue  # a record the sample itself refuses: no writer can write it
                write_step_file(steps, VICTIM, samples)
                tally.case(
                    f"cli_steps: sample {i} record {kseg} {seg.field} with {what}",
                    lambda steps=steps: _check(steps, base.root),
                )
