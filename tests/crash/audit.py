"""What the crash test holds a run to, from its log alone: the step files, the producer's cursor and
the trainer's record of the steps it trained (the lineage of its newest checkpoint).

- every step file holds exactly the rollouts ``(prompt id, sample)`` of the prompts its step took,
  each once, and no rollout is in two step files (nothing lost, nothing repeated by the producer);
- the trainer's lineage holds steps ``0 .. c - 1`` once each, in order;
- every sample of a trained step was trained exactly once (the fingerprints the trainer recorded
  are, as a multiset, the step's samples that the staleness policy keeps) or was dropped by the
  policy ("drop": its oldest policy version lags the step by more than ``max_staleness``), and
  the loader counted exactly those drops.

``lost`` counts samples of trained steps that were neither trained nor dropped, ``duplicated``
samples trained more often than the step holds them; both must be 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rollfeed.demo.ledger import fingerprint
from rollfeed.loaders import read_step_file
from rollfeed.orchestrator.cursor_events import StepBegun, decode_event
from rollfeed.orchestrator.cursor_frames import scan
from rollfeed.orchestrator.cursor_log import FOLDER, LOG_NAME


@dataclass(kw_only=True)
class Audit:
    steps_written: int = 0
    steps_trained: int = 0
    produced: int = 0
    trained: int = 0
    dropped: int = 0
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)


def oldest_version(sample) -> int | None:
    spans = getattr(sample, "version_spans", None)
    if spans is None or len(spans) == 0:
        return None
    return int(min(int(row[2]) for row in spans))


def cursor_steps(steps_dir: Path) -> dict[int, list[str]]:
    """The prompts each begun step took, from the cursor log (a torn tail ignored)."""
    data = (steps_dir / FOLDER / LOG_NAME).read_bytes()
    out = {}
    for seq, payload in enumerate(scan(data).payloads):
        event = decode_event(payload, seq=seq, name=LOG_NAME)
        if isinstance(event, StepBegun):
            out[event.step] = list(event.prompts)
    return out


def audit(
    steps_dir: Path, lineage: list[dict], *, group_size: int, max_staleness: int | None
) -> Audit:
    """The run's numbers and every problem found (see the module doc)."""
    a = Audit()
    begun = cursor_steps(steps_dir)
    seen: Counter[str] = Counter()
    files = sorted(steps_dir.glob("step_*.rfs"))
    a.steps_written = len(files)
    if [f.name for f in files] != [f"step_{k:06d}.rfs" for k in range(len(files))]:
        a.problems.append(f"the step files are not steps 0..{len(files) - 1}: {files}")
    samples = {}
    for k in range(len(files)):
        got = read_step_file(steps_dir / f"step_{k:06d}.rfs")
        samples[k] = got
        want = [f"{p}/{s}" for p in begun.get(k, []) for s in range(group_size)]
        uids = [s.uid for s in got]
        if uids != want:
            a.problems.append(f"step {k} holds {uids}, its prompts make {want}")
        seen.update(uids)
        a.produced += len(got)
    repeated = [uid for uid, n in seen.items() if n > 1]
    if repeated:
        a.problems.append(f"rollouts in more than one step file: {repeated[:5]}")
    steps = [entry["step"] for entry in lineage]
    if steps != list(range(len(steps))):
        a.problems.append(f"the trainer's lineage holds steps {steps}, not 0..{len(steps) - 1}")
    a.steps_trained = len(steps)
    for entry in lineage:
        k = entry["step"]
        if k not in samples:
            a.problems.append(f"step {k} was trained but its file is not there")
            continue
        keep, stale = Counter(), 0
        for s in samples[k]:
            v = oldest_version(s)
            if max_staleness is not None and v is not None and k - v > max_staleness:
                stale += 1
            else:
                keep[fingerprint(s.token_ids)] += 1
        trained = Counter(entry["samples"])
        a.trained += sum(trained.values())
        a.dropped += stale
        a.lost += sum((keep - trained).values())
        a.duplicated += sum((trained - keep).values())
        if entry.get("stale_dropped", 0) != stale:
            a.problems.append(
                f"step {k}: the loader dropped {entry.get('stale_dropped', 0)} stale samples, "
                f"{stale} lag more than {max_staleness}"
            )
    if a.lost or a.duplicated:
        a.problems.append(f"{a.lost} samples lost, {a.duplicated} duplicated")
    return a
