"""Attack family ``trees`` of the adversary harness (:mod:`tests.payload.adversary`): samples that
claim a shared prefix they do not share, and trees that do not fit their samples.

Cases start from GRPO groups and a branching conversation (:mod:`tests.collate.tree_cases`),
inline or by handle, and change one thing: a token, inside the claimed prefix or after it; a
route row (inline, or by handle in a record of its own with the same or other bytes); a claimed
prefix length (longer than the tokens shared, shorter, past the sample); keys that contradict
each other; a ``seq_len`` that cuts inside the prefixes; a tree handed to ``place_micro_batch``
with a span moved, a member too many or too few, a parent out of order; ``prefixes`` of the wrong
kind or count. Each case plans, places and reads the micro batches for cp 1 and cp 2 (zigzag).

The oracle is the same samples packed one by one (flat): every rank's per-token tensors, its
tree tokens at its flat rows and its routes and coverage at them must equal the flat row's, or
the case must raise a typed error. A read that differs from the flat one, or a claimed prefix
that does not hold and still reads, is ``wrong``.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import numpy as np
import torch

from rollfeed.collate import (
    PlanConfig,
    PrefixTree,
    SharedPrefixes,
    TreeSpan,
    place_micro_batch,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.payload import PayloadWriter
from tests.collate.tree_cases import conversation, group, make_tree_samples
from tests.payload.adversary_tally import Tally, Wrong

CASES = [group(7, [3, 4, 2]), conversation(4, [2, 3]), group(5, [6])]
FLAT = ["input_ids", "position_ids", "labels", "loss_mask", "advantages", "temperatures"]


def _read_all(samples, prefixes, config, root, trees=None):
    """Every rank's tensors of every micro batch, checked against the one-by-one packing."""
    if trees is None:
        plan = prepare_batch(samples, config, dp_size=1, prefixes=prefixes)
        placed = [mb for rank in plan for mb in rank]
    else:
        placed = [place_micro_batch(samples, config, trees=trees)]
    for mb in placed:
        if mb.is_dummy:
            continue
        flat_config = dataclasses.replace(config, seq_len=4096, cp_size=1, cp_layout="contiguous")
        # a tree's flat row is its samples back to back; a flat micro batch's is its own row
        flat = (
            place_micro_batch(list(mb.samples), flat_config)
            if mb.tree is not None
            else dataclasses.replace(mb, config=flat_config)
        )
        ref = to_tensor_micro_batch(flat, cp_rank=0, root=root)
        held = []
        for rank in range(config.cp_size):
            t = to_tensor_micro_batch(mb, cp_rank=rank, root=root)
            pos = t.positions
            held.append(pos)
            for name in FLAT:
                if not torch.equal(getattr(t, name), getattr(ref, name)[pos]):
                    raise Wrong(f"{name} differs from the one-by-one packing")
            tree = t.tree
            if tree is None:
                continue
            if not torch.equal(tree.input_ids[tree.rows], t.input_ids):
                raise Wrong("a flat row's tree token is not its token")
            if "routed_experts" in ref.fields:
                got = t.fields["routed_experts"][tree.rows]
                covered = t.coverage["routed_experts"][tree.rows]
                if not torch.equal(covered, ref.coverage["routed_experts"][pos]):
                    raise Wrong("route coverage differs from the one-by-one packing")
                want = ref.fields["routed_experts"][pos]
                if not torch.equal(got[covered], want[covered]):
                    raise Wrong("routes read for the tree differ from the samples' own")
        if not torch.equal(torch.cat(held).sort().values, torch.arange(mb.length)):
            raise Wrong("the ranks' flat rows are not the flat row")


def _shared_below(prefixes: SharedPrefixes, i: int) -> int:
    """Tokens of sample ``i`` some other sample claims to share (its longest claimed prefix)."""
    return max((n for _, n in prefixes.chains[i]), default=0)


def family_trees(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    for handle in (False, True):
        root = workdir / f"root{int(handle)}" if handle else None
        for trial in range(6):
            seed = int(rng.integers(1 << 30))
            if handle:
                with PayloadWriter(root, group="g", name=f"w{trial}") as writer:
                    samples, prefixes = make_tree_samples(
                        np.random.default_rng(seed), CASES, writer=writer
                    )
            else:
                samples, prefixes = make_tree_samples(np.random.default_rng(seed), CASES)
            for cp, layout in ((1, "contiguous"), (2, "zigzag")):
                config = PlanConfig(seq_len=64, cp_size=cp, cp_layout=layout)
                tag = f"handle={handle} trial={trial} cp={cp}"
                _cases(tally, samples, prefixes, config, root, rng, tag, workdir, trial)


def _cases(tally, samples, prefixes, config, root, rng, tag, workdir, trial) -> None:
    run = lambda s, p, c=config, trees=None: _read_all(s, p, c, root, trees)  # noqa: E731
    tally.case(f"{tag} untouched", lambda: run(samples, prefixes), refusal_ok=False)
    # a token flipped: inside the claimed prefix it must be refused, after it read as flat
    i = int(rng.integers(len(samples)))
    at = int(rng.integers(len(samples[i])))
    ids = samples[i].token_ids.copy()
    ids[at] = (ids[at] + 1) % 1000
    flipped = [
        dataclasses.replace(s, token_ids=ids) if k == i else s for k, s in enumerate(samples)
    ]
    inside = at < _shared_below(prefixes, i)
    tally.case(
        f"{tag} token {at} of sample {i} flipped ({'inside' if inside else 'after'} the prefix)",
        lambda: _expect(inside, lambda: run(flipped, prefixes)),
    )
    # a route row changed (inline) or moved to a record of its own (by handle)
    routed = [k for k, s in enumerate(samples) if _routes(s, root) is not None and len(s) > 1]
    k = routed[int(rng.integers(len(routed)))]
    rows = _routes(samples[k], root)
    row = int(rng.integers(len(rows)))
    for change in (0, 1):
        new = rows.copy()
        new[row, 0, 0] = (new[row, 0, 0] + change) % 8
        moved = [
            _with_routes(s, new, root, workdir, uuid.uuid4().hex) if j == k else s
            for j, s in enumerate(samples)
        ]
        differs = change and row < _shared_below(prefixes, k)
        tally.case(
            f"{tag} route row {row} of sample {k} {'changed' if change else 'rewritten alike'}",
            lambda m=moved, d=differs: _expect(d, lambda: run(m, prefixes)),
        )
    # claimed lengths: one longer than what is shared, one shorter, one past the sample
    g = [j for j, c in enumerate(prefixes.chains) if c]
    j = g[int(rng.integers(len(g)))]
    key, n = prefixes.chains[j][0]
    for delta in (1, -1, 10_000):
        chains = [
            tuple((kk, nn + delta if kk == key and nn + delta > 0 else nn) for kk, nn in c)
            for c in prefixes.chains
        ]
        tally.case(
            f"{tag} key {key} claims {n + delta} tokens",
            lambda c=chains: run(samples, SharedPrefixes(chains=tuple(c))),
        )
    tally.case(
        f"{tag} key claimed with two lengths",
        lambda: SharedPrefixes(chains=((("x", 3),), (("x", 4),))),
    )
    tally.case(
        f"{tag} prefixes for one sample too few",
        lambda: run(samples, SharedPrefixes(chains=prefixes.chains[:-1])),
    )
    tally.case(f"{tag} prefixes of the wrong kind", lambda: run(samples, prefixes.chains))
    short = dataclasses.replace(config, seq_len=4 * config.pad)
    tally.case(
        f"{tag} seq_len {short.seq_len} cuts inside the prefixes",
        lambda: run(samples, prefixes, short),
    )
    # hand-made trees that do not fit their samples
    plan = prepare_batch(samples, config, dp_size=1, prefixes=prefixes)
    placed = [
        (mb, t)
        for r, rt in zip(plan, plan.trees, strict=True)
        for mb, t in zip(r, rt, strict=True)
        if t
    ]
    if not placed:
        return
    mb, trees = placed[0]
    members = list(mb.samples)
    first, tree = trees[0]
    spans = list(tree.spans)
    for what, bad in _bad_trees(spans, rng):
        tally.case(
            f"{tag} tree {what}",
            lambda b=bad: run(members, None, trees=((first, PrefixTree(spans=tuple(b))),)),
        )


def _bad_trees(spans: list[TreeSpan], rng) -> list[tuple[str, list[TreeSpan]]]:
    out = []
    k = int(rng.integers(1, len(spans)))
    s = spans[k]
    out.append(
        (
            "span end moved",
            [*spans[:k], TreeSpan(s.parent, s.start, s.end + 1, s.sample), *spans[k + 1 :]],
        )
    )
    out.append(
        (
            "span start moved",
            [*spans[:k], TreeSpan(s.parent, max(s.start - 1, 0), s.end, s.sample), *spans[k + 1 :]],
        )
    )
    out.append(
        (
            "parent after the span",
            [*spans[:k], TreeSpan(k, s.start, s.end, s.sample), *spans[k + 1 :]],
        )
    )
    out.append(
        (
            "a member too many",
            [
                *spans,
                TreeSpan(
                    0, spans[0].end, spans[0].end + 1, len([x for x in spans if x.sample >= 0])
                ),
            ],
        )
    )
    leaves = [i for i, x in enumerate(spans) if x.sample >= 0]
    out.append(("a member too few", [x for i, x in enumerate(spans) if i != leaves[-1]]))
    out.append(
        (
            "members swapped",
            [
                TreeSpan(x.parent, x.start, x.end, (x.sample + 1) % len(leaves))
                if x.sample >= 0
                else x
                for x in spans
            ],
        )
    )
    return out


def _routes(sample, root):
    data = sample.fields.get("routed_experts")
    if data is not None:
        return data
    segs = [s for s in sample.payload if s.field == "routed_experts"]
    if not segs:
        return None
    from rollfeed.payload import read_field

    n = max(s.end for s in segs)
    return read_field(segs, "routed_experts", (0, n), root=root).numpy()


def _with_routes(sample, rows, root, workdir, name):
    if root is None:
        return dataclasses.replace(sample, fields={**sample.fields, "routed_experts": rows})
    with PayloadWriter(root, group="g", name=name) as w:
        segs = w.write({"routed_experts": rows}, 0)
    keep = [s for s in sample.payload if s.field != "routed_experts"]
    return dataclasses.replace(sample, payload=[*keep, *segs])


def _expect(refused: bool, attack) -> None:
    """Run ``attack``; when it must be refused and returns, that is ``wrong``."""
    attack()
    if refused:
        raise Wrong("data that differs inside a claimed prefix was read without an error")
