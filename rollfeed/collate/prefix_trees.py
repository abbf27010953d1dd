"""Prefix trees: the planner's pure step that packs samples sharing a prefix as one tree.

From each kept sample's cut (its length after truncation) and its claimed prefix chain
(:class:`~rollfeed.collate.SharedPrefixes`), :func:`plan_units` makes the step's *units*: a tree
of samples (the shared prefixes once, then each sample's own tokens as a branch, nested as deep as
the chains go) or a single flat sample. A chain node counts only where it ends before the
sample's cut (a truncated branch keeps at least one token of its own, so it stays a branch) and
only where two or more samples pass through it. A tree longer than ``seq_len`` is split into
pieces that each repeat the prefix above them (First-Fit-Decreasing over the branches); a piece
is kept as a tree only when it saves at least ``min_saving`` of its samples' tokens, otherwise
its samples are planned flat.

A tree is a tuple of :class:`TreeSpan` in preorder: shared spans (``sample == -1``) and each
member's own span (``sample`` = its index among the tree's members, members in preorder). Span
``[start, end)`` counts tokens from the samples' first token, so ``start`` is also the position
id of the span's first token.

Worked example (prompt of 4 shared by three samples of lengths 6, 7, 5)::

    plan_units(cuts=[6, 7, 5], chains=[((g, 4),)] * 3, seq_len=16, min_saving=0.2, ...)
    -> one unit, members (0, 1, 2), tokens 4 + 2 + 3 + 1 = 10 (flat: 18; saves 44%)
       spans: (parent -1, [0, 4), shared), (0, [4, 6), member 0), (0, [4, 7), 1), (0, [4, 5), 2)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.collate.pack import pack_ffd
from rollfeed.collate.shared_prefix import Chain


@dataclass(frozen=True, slots=True)
class TreeSpan:
    """One span of a tree: ``parent`` span index (-1: the root), tokens ``[start, end)`` of its
    samples, and the member whose own tokens it holds (``-1``: a shared prefix)."""

    parent: int
    start: int
    end: int
    sample: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixTree:
    """A tree of ``members`` samples, its spans in preorder (see the module doc)."""

    spans: tuple[TreeSpan, ...]

    @property
    def members(self) -> int:
        return sum(s.sample >= 0 for s in self.spans)

    @property
    def tokens(self) -> int:
        """Tokens the tree computes: each span once."""
        return sum(s.end - s.start for s in self.spans)

    def cost(self, quadratic: float) -> float:
        """Balance cost: tokens plus ``quadratic`` times the attention pairs (×2, as a flat
        sample's ``L²`` counts them): a span of ``b`` tokens after ``a`` sees ``2ab + b²``."""
        pairs = sum(2 * s.start * (s.end - s.start) + (s.end - s.start) ** 2 for s in self.spans)
        return self.tokens + quadratic * pairs


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """What the planner places in a row slot: ``members`` (plan positions, in row order) and the
    tree over them (``None``: one flat sample)."""

    members: tuple[int, ...]
    tree: PrefixTree | None
    tokens: int


@dataclass(slots=True)
class _Node:
    length: int
    parent: Hashable | None
    members: list[int]


def plan_units(
    cuts: np.ndarray,
    chains: Sequence[Chain],
    *,
    seq_len: int,
    min_saving: float,
) -> list[Unit]:
    """The units of the samples with ``cuts > 0`` (see the module doc), trees first in order of
    their first member, then the flat samples in plan order."""
    keep = [i for i in range(len(cuts)) if cuts[i] > 0]
    paths = {i: [k for k, n in chains[i] if n < cuts[i]] for i in keep}
    nodes: dict[Hashable, _Node] = {}
    for i in keep:
        parent = None
        for key, n in chains[i]:
            if n >= cuts[i]:
                break
            nodes.setdefault(key, _Node(int(n), parent, [])).members.append(i)
            parent = key
    roots: dict[Hashable, list[int]] = {}
    for i in keep:
        shared = [k for k in paths[i] if len(nodes[k].members) >= 2]
        paths[i] = shared
        if shared:
            roots.setdefault(shared[0], []).append(i)
    units, flat = [], set(keep) - {i for m in roots.values() for i in m}
    for root, members in roots.items():
        for piece in _pieces(root, members, seq_len, nodes, paths, cuts):
            tree = _build(piece, paths, nodes, cuts)
            saved = sum(int(cuts[i]) for i in piece) - tree[1].tokens if len(piece) > 1 else 0
            if len(piece) > 1 and saved >= min_saving * sum(int(cuts[i]) for i in piece):
                units.append(Unit(members=tree[0], tree=tree[1], tokens=tree[1].tokens))
            else:
                flat.update(piece)
    units.sort(key=lambda u: u.members[0])
    units += [Unit(members=(i,), tree=None, tokens=int(cuts[i])) for i in sorted(flat)]
    return units


def _tokens(members: list[int], above: int, nodes, paths, cuts) -> int:
    """Tokens of ``members`` hung below length ``above``: each node under it once, then each
    member's own tokens."""
    seen, total = set(), 0
    for i in members:
        last = above
        for key in paths[i]:
            node = nodes[key]
            if node.length > above and key not in seen:
                seen.add(key)
                parent = 0 if node.parent is None else nodes[node.parent].length
                total += node.length - max(parent, above)
            last = max(last, node.length)
        total += int(cuts[i]) - last
    return total


def _pieces(key, members, cap, nodes, paths, cuts) -> list[list[int]]:
    """``members`` (all under node ``key``) in pieces whose trees fit ``cap`` tokens counted from
    the node's parent: FFD over the node's child subtrees and own branches."""
    node = nodes[key]
    above = 0 if node.parent is None else nodes[node.parent].length
    if _tokens(members, above, nodes, paths, cuts) <= cap:
        return [members]
    room = cap - (node.length - above)
    children: dict[Hashable, list[int]] = {}
    items: list[list[int]] = []
    for i in members:
        path = paths[i]
        at = path.index(key)
        if at + 1 < len(path):
            children.setdefault(path[at + 1], []).append(i)
        else:
            items.append([i])
    for child, under in children.items():
        items += _pieces(child, under, room, nodes, paths, cuts)
    sizes = [_tokens(m, node.length, nodes, paths, cuts) for m in items]
    return [sorted(i for j in b for i in items[j]) for b in pack_ffd(sizes, room)]


def _build(members: list[int], paths, nodes, cuts) -> tuple[tuple[int, ...], PrefixTree]:
    """The tree of ``members`` (nodes passed by one member only fold into its branch): members
    in preorder and the spans."""
    count: dict[Hashable, int] = {}
    for i in members:
        for key in paths[i]:
            count[key] = count.get(key, 0) + 1
    trimmed = {i: [k for k in paths[i] if count[k] >= 2] for i in members}
    children: dict[Hashable | None, list[Hashable | int]] = {}
    for i in sorted(members):  # children in order of their first member
        parent = None
        for key in trimmed[i]:
            kids = children.setdefault(parent, [])
            if ("node", key) not in kids:
                kids.append(("node", key))
            parent = key
        children.setdefault(parent, []).append(("leaf", i))
    spans: list[TreeSpan] = []
    order: list[int] = []
    stack: list[tuple[tuple[str, Hashable], int, int]] = [
        (item, -1, 0) for item in reversed(children.get(None, []))
    ]
    while stack:
        (kind, what), parent, start = stack.pop()
        if kind == "leaf":
            order.append(what)
            spans.append(TreeSpan(parent, start, int(cuts[what]), len(order) - 1))
            continue
        end = nodes[what].length
        spans.append(TreeSpan(parent, start, end, -1))
        here = len(spans) - 1
        stack += [(item, here, end) for item in reversed(children.get(what, []))]
    return tuple(order), PrefixTree(spans=tuple(spans))


def micro_batch_trees(
    units: list[Unit], bin_units: list[int]
) -> tuple[tuple[int, PrefixTree], ...]:
    """The ``(first sample, tree)`` of each tree unit among ``bin_units`` (in row order)."""
    out, first = [], 0
    for j in bin_units:
        if units[j].tree is not None:
            out.append((first, units[j].tree))
        first += len(units[j].members)
    return tuple(out)
