"""Attack family ``loss_runs`` of the adversary harness (:mod:`tests.payload.adversary`): crafted
loss runs in a step file's index.

A step of samples with varied loss masks (none, a completion, several turns, a loss token at
position 0 only; some truncated at ``seq_len``) is written; then the index's run counts and runs
are rewritten, the footer's size and CRC-32C of the index made to match (so only the index's own
checks and each record's own runs stand between them and a reader): runs out of order,
overlapping, touching, empty, past the sample, shifted by one token, dropped, added, merged, split,
moved to another sample, counts that do not match the runs, values at the ends of ``<u4``, the
runs' bytes cut short or one value longer.
Every (dp, cp) rank of a dp 2 x cp 2 world then takes a pass of the step from the directory. The
oracle is the same step planned from the samples in memory: every rank's micro batches, their
step counts included, must be exactly those, or the pass must raise a typed error. A count taken
from crafted runs that reaches a micro batch is ``wrong``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from tests.collate.loss_samples import samples_for
from tests.loaders.common import assert_bitwise
from tests.loaders.step_bytes import index_of, index_with_runs, rewrite_index
from tests.payload.adversary_tally import Tally, Wrong

SEQ_LEN = 16
RANKS = [(dp, cp) for dp in range(2) for cp in range(2)]


def _passes(dataset: RolloutDataset) -> dict[tuple[int, int], list]:
    out = {}
    for dp, cp in RANKS:
        topo = Topology(dp_rank=dp, dp_size=2, cp_rank=cp, cp_size=2)
        config = LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN))
        out[dp, cp] = list(build_dataloader(dataset, topo, config, root=None))
    return out


def _flat(per: list[list[list[int]]]) -> tuple[list[int], list[int]]:
    """``(loss_runs, loss_spans)`` of each sample's runs ``per[i]`` (pairs)."""
    return [len(r) for r in per], [v for r in per for p in r for v in p]


def _with(per: list, i: int, runs: list) -> tuple[list[int], list[int]]:
    """The step's runs with sample ``i``'s replaced by ``runs``."""
    return _flat([runs if s == i else r for s, r in enumerate(per)])


def _shifted(runs: list, k: int, da: int, db: int) -> list:
    a, b = runs[k]
    return [*runs[:k], [a + da, b + db], *runs[k + 1 :]]


def _split(runs: list, k: int, gap: int) -> list:
    """Run ``k`` cut in two, ``gap`` tokens apart (0: touching); a run too short for that gets a
    second run past it, which is not the mask either."""
    a, b = runs[k]
    if b - a < 2 + gap:
        return [*runs[:k], [a, b], [b, b + 1], *runs[k + 1 :]]
    mid = (a + b) // 2
    return [*runs[:k], [a, mid], [mid + gap, b], *runs[k + 1 :]]


def _edits(rng: np.random.Generator, counts: list[int], spans: list[int], lengths: list[int]):
    """``(what, counts, spans)``: crafted runs (integers, wrapped to ``<u4`` when written;
    ``None`` spans: the runs' bytes cut by one value)."""
    pairs = [spans[2 * k : 2 * k + 2] for k in range(len(spans) // 2)]
    first = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    per = [pairs[first[i] : first[i + 1]] for i in range(len(counts))]
    with_runs = [i for i in range(len(per)) if per[i]]
    several = [i for i in with_runs if len(per[i]) > 1]
    out = []
    for _ in range(3):
        i = int(rng.choice(with_runs))
        runs, T = per[i], lengths[i]
        k = int(rng.integers(0, len(runs)))
        a, b = runs[k]
        j = (i + 1) % len(per)
        moved = [[] if s == i else per[i] + r if s == j else r for s, r in enumerate(per)]
        out += [
            (f"sample {i} run {k} start -1", *_with(per, i, _shifted(runs, k, -1, 0))),
            (f"sample {i} run {k} start +1", *_with(per, i, _shifted(runs, k, 1, 0))),
            (f"sample {i} run {k} end -1", *_with(per, i, _shifted(runs, k, 0, -1))),
            (f"sample {i} run {k} end +1", *_with(per, i, _shifted(runs, k, 0, 1))),
            (
                f"sample {i} run {k} past the sample",
                *_with(per, i, _shifted(runs, k, 0, T + 1 - b)),
            ),
            (
                f"sample {i} run {k} end 2**32-1",
                *_with(per, i, _shifted(runs, k, 0, 2**32 - 1 - b)),
            ),
            (f"sample {i} run {k} empty", *_with(per, i, _shifted(runs, k, 0, a - b))),
            (f"sample {i} run {k} dropped", *_with(per, i, [*runs[:k], *runs[k + 1 :]])),
            (f"sample {i} run {k} twice", *_with(per, i, [*runs[: k + 1], *runs[k:]])),
            (f"sample {i} runs reversed", *_with(per, i, runs[::-1])),
            (f"sample {i} the whole sample", *_with(per, i, [[0, T]])),
            (f"sample {i} no run", *_with(per, i, [])),
            (f"sample {i} run {k} split touching", *_with(per, i, _split(runs, k, 0))),
            (f"sample {i} run {k} split apart", *_with(per, i, _split(runs, k, 1))),
            (f"sample {i} runs moved to sample {j}", *_flat(moved)),
        ]
        if several:
            m = int(rng.choice(several))
            merged = [[per[m][0][0], per[m][-1][1]]]
            out.append((f"sample {m} runs merged over their gaps", *_with(per, m, merged)))
        for d in (1, -1):
            more = [c + d if s == i else c for s, c in enumerate(counts)]
            out.append((f"sample {i} count {d:+d}, spans as they were", more, spans))
    out += [
        ("spans unchanged", counts, spans),  # the oracle itself: correct
        ("a negative start", counts, [-1, *spans[1:]]),
        ("a start of 2**31", counts, [2**31, *spans[1:]]),
        ("counts rolled by one sample", counts[1:] + counts[:1], spans),
        ("the runs cut by one value", counts, spans[:-1]),
        ("one extra value", counts, [*spans, 1]),
        ("one extra run at the end", [*counts[:-1], counts[-1] + 1], [*spans, 0, 1]),
        ("all spans reversed", counts, spans[::-1]),
        ("counts huge", [2**31] * len(counts), spans),
        ("counts 2**32-1", [2**32 - 1] * len(counts), spans),
    ]
    return out


def family_loss_runs(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    samples = samples_for(int(rng.integers(0, 1 << 16)), 9, SEQ_LEN)
    oracle = _passes(RolloutDataset(samples))
    steps = workdir / "steps"
    path = Path(write_step_file(steps, 0, samples))
    index = index_of(path)
    counts, spans = index.run_counts.tolist(), index.run_spans.ravel().tolist()
    edits = _edits(rng, counts, spans, index.tokens.tolist())

    for what, counts, spans in edits:
        crafted = index_with_runs(path, counts, spans)

        def attack(crafted=crafted) -> None:
            write_step_file(steps, 0, samples)
            rewrite_index(path, crafted)
            got = _passes(RolloutDataset.from_step_dir(steps))
            for rank, want in oracle.items():
                if len(got[rank]) != len(want):
                    raise Wrong(f"rank {rank}: {len(got[rank])} micro batches, not {len(want)}")
                for k, (a, b) in enumerate(zip(got[rank], want, strict=True)):
                    try:
                        assert_bitwise(a, b, (rank, k))
                    except AssertionError as err:
                        raise Wrong(f"rank {rank} micro batch {k} differs: {err}") from None

        tally.case(f"loss_runs: {what}", attack)
