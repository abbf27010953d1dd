"""Attack family ``tree_index`` of the adversary harness (:mod:`tests.payload.adversary`): step
files whose index claims shared prefixes, read through the loader.

Each trial writes GRPO groups and a branching conversation (:mod:`tests.collate.tree_cases`) to a
step file under random group names (their 64-bit hashes fall on both sides of 2**63), each sample
claiming its group's root prompt, and changes at most one thing: a token flipped (inside or after
the claimed prefix), a sample's claimed length longer or shorter by one, a sample moved to
another group. Each is read, shuffled, by both ranks of cp 2 (zigzag).

The oracle is the same samples planned in memory with the claims the index holds
(``SharedPrefixes.of_groups``): the loader's micro batches must be the in-memory ones, tensor for
tensor, and where the in-memory planning or reading refuses (a ``SharedPrefixError``: the tokens
differ where they are claimed shared), the loader must refuse too, naming the step file, the step,
the field and the position. A group planned flat that the in-memory plan packs as a tree, or a
refusal that does not name the file, is ``wrong``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from rollfeed.collate import (
    LossRuns,
    PlanConfig,
    SharedPrefixError,
    SharedPrefixes,
    place_micro_batch,
    plan_lengths,
    to_tensor_micro_batch,
)
from rollfeed.loaders import LoaderConfig, RolloutDataset, StepWriter, Topology, build_dataloader
from tests.collate.tree_cases import conversation, group, make_tree_samples, paths
from tests.payload.adversary_tally import Tally, Wrong

CASES = [group(7, [3, 4, 2]), conversation(4, [2, 3]), group(5, [6, 2]), group(6, [3, 3])]
GRIDS = (((1, 2, "zigzag"), True),)  # (dp, cp, layout), shuffle


def family_tree_index(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    for trial in range(6):
        _trial(tally, workdir, rng, f"trial={trial}")


def _trial(tally: Tally, workdir: Path, rng: np.random.Generator, tag: str) -> None:
    samples, _ = make_tree_samples(np.random.default_rng(int(rng.integers(1 << 30))), CASES)
    names, shared = [], []
    for root in CASES:
        name = rng.bytes(6).hex()
        for _ in paths(root):
            names.append(name)
            shared.append(root.length)
    tally.case(f"{tag} untouched", lambda: _read(workdir, samples, names, shared))
    i = int(rng.integers(len(samples)))
    at = int(rng.integers(len(samples[i])))
    ids = samples[i].token_ids.copy()
    ids[at] = (ids[at] + 1) % 1000
    flipped = [
        dataclasses.replace(s, token_ids=ids) if k == i else s for k, s in enumerate(samples)
    ]
    where = "inside" if at < shared[i] else "after"
    tally.case(
        f"{tag} token {at} of sample {i} flipped ({where} the claim)",
        lambda: _read(workdir, flipped, names, shared),
    )
    for delta in (1, -1):
        claims = [n + delta if k == i else n for k, n in enumerate(shared)]
        tally.case(
            f"{tag} sample {i} claims {claims[i]} tokens",
            lambda c=claims: _read(workdir, samples, names, c),
        )
    other = names[int(rng.integers(len(names)))]
    moved = [other if k == i else n for k, n in enumerate(names)]
    tally.case(
        f"{tag} sample {i} claims group {other}", lambda: _read(workdir, samples, moved, shared)
    )


def _oracle(samples, plan: PlanConfig, dp_size: int, claims: SharedPrefixes):
    """Per dp rank, its micro batches placed in memory as
    :func:`rollfeed.collate.prepare_batch` places them, or None where placing one of them
    refuses (the loader places only its rank's)."""
    lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
    planned = plan_lengths(
        lengths, plan, dp_size=dp_size, loss_runs=LossRuns.of_samples(samples), prefixes=claims
    )
    assert planned.loss is not None
    out = []
    for rank, rank_trees in zip(planned, planned.trees, strict=True):
        try:
            out.append(
                [
                    place_micro_batch(
                        [samples[j] for j in mb],
                        plan,
                        indices=mb,
                        step_counts=planned.loss.counts(mb),
                        trees=trees,
                    )
                    for mb, trees in zip(rank, rank_trees, strict=True)
                ]
            )
        except SharedPrefixError:
            out.append(None)
    return out


def _read(workdir: Path, samples, names: list[str], shared: list[int]) -> None:
    """Write the step and read it through the loader on every grid rank, against the in-memory
    plan (see the module doc)."""
    steps = workdir / f"steps{len(list(workdir.glob('steps*')))}"
    claimed = [min(n, len(s)) for s, n in zip(samples, shared, strict=True)]
    with StepWriter(steps, 0) as w:
        for s, g, n in zip(samples, names, claimed, strict=True):
            w.append(s, group=g, shared_prefix=n)
    dataset = RolloutDataset.from_step_dir(steps)
    claims = SharedPrefixes.of_groups(names, claimed)
    for (dp_size, cp_size, layout), shuffle in GRIDS:
        plan = PlanConfig(seq_len=64, cp_size=cp_size, cp_layout=layout)
        config = LoaderConfig(plan=plan, shuffle=shuffle, seed=3)
        order = np.arange(len(samples))
        if shuffle:
            order = np.random.default_rng([3, 0]).permutation(len(samples))
        ordered = SharedPrefixes(chains=tuple(claims.chains[k] for k in order))
        want = _oracle([samples[k] for k in order], plan, dp_size, ordered)
        for dp in range(dp_size):
            for cp in range(cp_size):
                topo = Topology(dp_rank=dp, dp_size=dp_size, cp_rank=cp, cp_size=cp_size)
                try:
                    got = list(build_dataloader(dataset, topo, config, root=None))
                except SharedPrefixError as err:
                    if want[dp] is not None:
                        raise Wrong(f"refused what planning in memory reads: {err}") from None
                    if err.file != dataset.source.where(0) or err.pos is None:
                        raise Wrong(f"the refusal does not name the step file: {err}") from None
                    raise
                if want[dp] is None:
                    raise Wrong("read tokens that differ where the index claims them shared")
                if len(got) != len(want[dp]):
                    raise Wrong(f"{len(got)} micro batches, the in-memory plan {len(want[dp])}")
                for a, mb in zip(got, want[dp], strict=True):
                    b = to_tensor_micro_batch(mb, cp_rank=cp)
                    if (a.tree is None) != (b.tree is None):
                        raise Wrong(
                            "a micro batch planned flat that the index's claims make a tree"
                        )
                    same = zip(a.tensors(), b.tensors(), strict=True)
                    if not all(torch.equal(x, y) for x, y in same):
                        raise Wrong("a micro batch differs from the in-memory one")
