"""Attack family ``step_replace`` of the adversary harness (:mod:`tests.payload.adversary`): a step
file replaced between planning and the reads of its samples.

The trainer plans a step; then the step file, its index or both are replaced under their names
(other tokens in lines of the same sizes, other samples, fewer or more, the same bytes again, a
stale or a missing index, the step file removed: a pass then waits ``step_timeout_s`` for it),
before the pass starts or after its first micro batch. The pass runs in the trainer's process,
in a fresh copy of the dataset (a worker started by ``spawn``) or in two forked DataLoader
workers. The oracle is the planned version's micro batches (a single-process reference): a pass
must yield exactly those or raise a typed error; yielding anything else is ``wrong``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np

from tests.loaders.common import SEQ_LEN, reference, write_batch
from tests.loaders.resume import tmb_key

SAMPLES = 6


def _replacements(planned, spare):
    """``(what, samples, index)``: the replacement's samples (``None``: the step file removed)
    and what becomes of the index (``"new"``, ``"old"``: the planned one stays, ``"none"``)."""
    from tests.loaders.test_step_replacement import same_sizes_other_tokens

    return [
        ("same line sizes, other tokens", same_sizes_other_tokens(planned), "new"),
        ("same line sizes, other tokens, old index", same_sizes_other_tokens(planned), "old"),
        ("other samples", spare[:SAMPLES], "new"),
        ("other samples, planned index kept", spare[:SAMPLES], "old"),
        ("fewer samples", planned[:2], "new"),
        ("more samples", planned + spare[:3], "new"),
        ("the same samples again", planned, "new"),
        ("other samples, no index", spare[:SAMPLES], "none"),
        ("step file removed", None, "none"),
    ]  # fmt: skip


def _replace(steps: Path, samples, index: str) -> None:
    from rollfeed.loaders.step_files import step_file_name, write_step_file
    from rollfeed.loaders.step_index import index_path

    path = steps / step_file_name(0)
    ipath = index_path(path)
    old_index = ipath.read_bytes()
    if samples is None:
        path.unlink()
    else:
        write_step_file(steps, 0, samples)
    if index == "old":
        ipath.write_bytes(old_index)
    elif index == "none":
        ipath.unlink(missing_ok=True)


def family(tally, workdir: Path, rng: np.random.Generator) -> None:
    """See the module doc; every attack is one pass over one freshly planned step."""
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import LoaderOptions, RolloutDataset, Topology, build_dataloader
    from rollfeed.loaders.step_files import write_step_file

    harness = sys.modules[type(tally).__module__]  # Wrong as the tally catches it
    root = workdir / "payload"
    samples = write_batch(root, 3 * SAMPLES, seed=int(rng.integers(1 << 30)))
    planned, spare = samples[:SAMPLES], samples[SAMPLES:]
    ref_mbs, _ = reference(planned, dp_size=1, cp_size=1, cp_layout="contiguous", root=root)
    want = [tmb_key(t) for t in ref_mbs[0, 0]]
    config, topo = PlanConfig(seq_len=SEQ_LEN), Topology(dp_rank=0, dp_size=1)
    case = 0
    for what, replacement, index in _replacements(planned, spare):
        for where in ("trainer", "spawned copy", "2 workers"):
            for when in ("before the pass", "after its first micro batch"):
                if where == "2 workers" and when != "before the pass":
                    continue  # prefetched by then: the same as the above, at a worker start's cost
                case += 1
                steps = workdir / f"c{case}"
                steps.mkdir()
                write_step_file(steps, 0, planned)

                def attack(steps=steps, replacement=replacement, index=index, where=where,
                           when=when, what=what):  # fmt: skip
                    ds = RolloutDataset.from_step_dir(steps)
                    workers = 2 if where == "2 workers" else 0
                    options = LoaderOptions(num_workers=workers, timeout_s=10, stopped_s=1)
                    loader = build_dataloader(
                        ds, topo, config, root=root, step_timeout_s=0.2, options=options
                    )
                    try:
                        assert len(loader) == len(want)  # planned
                        if where == "spawned copy":  # reads from a copy that loads it itself
                            loader.dataset = pickle.loads(pickle.dumps(ds))
                        got = []
                        it = iter(loader)
                        if when != "before the pass":
                            got.append(tmb_key(next(it)))
                        _replace(steps, replacement, index)
                        got += [tmb_key(t) for t in it]
                    finally:
                        loader.close()
                    if got != want:
                        raise harness.Wrong(
                            f"{what}, {where}, {when}: {len(got)} micro batches, not the "
                            f"planned {len(want)} (or they differ)"
                        )

                tally.case(f"step_replace: {what}; {where}; {when}", attack)
