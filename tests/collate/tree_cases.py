"""Samples that share prefixes, for the tree tests: GRPO groups and branching conversations.

A case is a tree of token runs (:class:`Node`): a sample is the tokens along a path from the root
to a leaf, so the samples below a node share every token above and in it. Each node's side
channels are made once and every sample through it carries them, the way a capture that writes a
shared prefix once hands them over: routes (``routed_experts [T - 1, L, K]``, the sample's last
token never forwarded) and kept sets (on the tokens after the root, the sampled token first among
0-3 others), inline or by handle (one record per node, shared by the samples below it). Keys
are claimed for every node with two or more leaves below it.

Worked example: ``group(prompt=5, completions=[3, 4])`` is a root of 5 tokens with two leaves:
samples of 8 and 9 tokens sharing their first 5, claimed by ``SharedPrefixes`` keys
``((case, node id), 5)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rollfeed.collate import Sample, SharedPrefixes
from rollfeed.payload import PayloadWriter

LAYERS, TOPK, EXPERTS = 2, 2, 8


@dataclass
class Node:
    length: int
    children: list[Node] = field(default_factory=list)


def group(prompt: int, completions: list[int]) -> Node:
    return Node(prompt, [Node(c) for c in completions])


def conversation(first: int, turns: list[int], branches: int = 2) -> Node:
    """A conversation of ``len(turns)`` branching turns after a first prompt of ``first`` tokens:
    every turn node has ``branches`` children (a 3-turn conversation with 2 branches: 8 leaves)."""

    def grow(depth: int) -> list[Node]:
        if depth == len(turns):
            return []
        return [Node(turns[depth], grow(depth + 1)) for _ in range(branches)]

    return Node(first, grow(0))


def paths(root: Node) -> list[list[Node]]:
    out, stack = [], [[root]]
    while stack:
        path = stack.pop()
        kids = path[-1].children
        if not kids:
            out.append(path)
        stack += [[*path, k] for k in reversed(kids)]
    return out


def make_tree_samples(
    rng: np.random.Generator,
    cases: list[Node],
    *,
    vocab: int = 1000,
    writer: PayloadWriter | None = None,
    routes: Callable[[np.ndarray], np.ndarray] | None = None,
    with_routes: bool = True,
) -> tuple[list[Sample], SharedPrefixes]:
    """Samples of every leaf path of ``cases`` (in order) and their claimed prefixes (a key per
    node with two or more leaves below it). ``writer``: side channels by handle, one record per
    node; else inline. ``routes(tokens) -> [T, L, K]``: a sample's routing (default random per
    node); the rows of a node are taken from the first sample through it."""
    samples, chains = [], []
    made: dict[int, dict] = {}  # id(node) -> its tokens, kept sets, routes, records
    for c, root in enumerate(cases):
        for path in paths(root):
            tokens = []
            for node in path:
                if id(node) not in made:
                    made[id(node)] = {"ids": rng.integers(0, vocab, node.length)}
                tokens.append(made[id(node)]["ids"])
            ids = np.concatenate(tokens)
            own = None if routes is None else routes(ids)
            counts, values, route_rows, segs, chain = [], [], [], [], []
            at = 0
            for k, node in enumerate(path):
                info = made[id(node)]
                n = node.length
                last = k == len(path) - 1
                if "kept" not in info:
                    info["kept"] = _kept(rng, info["ids"], vocab, loss=k > 0)
                    rows = n - 1 if last else n
                    if own is not None:
                        info["routes"] = own[at : at + rows].astype(np.uint8)
                    else:
                        info["routes"] = rng.integers(0, EXPERTS, (rows, LAYERS, TOPK)).astype(
                            np.uint8
                        )
                    if writer is not None:
                        arrays = {"sampling_mask": info["kept"]} if k > 0 else {}
                        if with_routes and rows:
                            arrays["routed_experts"] = info["routes"]
                        pos = {"sampling_mask": 0, "routed_experts": 0}
                        info["segs"] = writer.write(arrays, pos, sampled=info["ids"])
                counts.append(info["kept"][0])
                values.append(info["kept"][1])
                route_rows.append(info["routes"])
                if writer is not None:
                    segs += [s.model_copy(update={"pos": s.pos + at}) for s in info["segs"]]
                at += n
                if not last and _leaves(node) >= 2:
                    chain.append(((c, id(node)), at))
            loss = np.arange(len(ids)) >= path[0].length
            fields = {}
            if writer is None:
                fields["sampling_mask"] = (np.concatenate(counts), np.concatenate(values))
                if with_routes:
                    fields["routed_experts"] = np.concatenate(route_rows)
            samples.append(
                Sample(
                    ids,
                    loss_mask=loss,
                    advantages=rng.standard_normal(len(ids)).astype(np.float32),
                    inference_logprobs=-rng.random(len(ids), dtype=np.float32),
                    temperatures=rng.choice([0.7, 1.0], len(ids)).astype(np.float32),
                    fields=fields,
                    payload=segs,
                    uid=f"c{c}s{len(samples)}",
                )
            )
            chains.append(tuple(chain))
    return samples, SharedPrefixes(chains=tuple(chains))


def _leaves(node: Node) -> int:
    return 1 if not node.children else sum(_leaves(k) for k in node.children)


def _kept(rng, ids: np.ndarray, vocab: int, *, loss: bool) -> tuple[np.ndarray, np.ndarray]:
    """Kept sets of a node's tokens: none on a root (the prompt), else each token's sampled token
    and 0-3 other ids."""
    counts = np.zeros(len(ids), np.int64)
    values: list[int] = []
    if loss:
        for t, y in enumerate(ids.tolist()):
            extra = rng.choice(np.setdiff1d(np.arange(vocab), [y]), rng.integers(0, 4), False)
            row = [y, *map(int, extra)]
            rng.shuffle(row)
            counts[t] = len(row)
            values += row
    return counts, np.asarray(values, np.int32)
