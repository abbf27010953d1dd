"""SharedPrefixes: which samples claim a shared token prefix, the planner's input for trees.

Planning reads no tokens, so a shared prefix is *claimed* by keys: per sample a chain of
``(key, length)`` nodes, outermost first, with strictly increasing lengths. Two samples naming
the same key claim the same first ``length`` tokens (and, where they carry routes, the same routes
over them); the tokens are confirmed when the samples are placed
(:func:`~rollfeed.collate.place_micro_batch`) and the routes when they are read
(:func:`~rollfeed.collate.to_tensor_micro_batch`): a mismatch is a :class:`SharedPrefixError`.

- A GRPO group: every sample of the group names one node of ``prompt_len`` tokens, keyed by
  its group id and that length (:meth:`SharedPrefixes.of_groups`, the step index's two columns).
- A conversation with branches: a sample names the node of every turn boundary it shares with
  another branch, e.g. a 3-turn conversation with 2 branches per turn gives 8 samples whose
  chains are ``[(c, p0), (c.a, p1), (c.a.b, p2)]`` and so on; :meth:`SharedPrefixes.of_tokens`
  finds such chains from the tokens of samples held in memory.

Worked example (samples 0-2 share a 4-token prompt, sample 3 shares nothing)::

    SharedPrefixes.of_groups([7, 7, 7, -1], [4, 4, 4, 0]).chains
    -> ((((7, 4), 4),), (((7, 4), 4),), (((7, 4), 4),), ())

A key must mean one prefix: the same key with two lengths, or with two outer chains, is refused
(:class:`SharedPrefixError` naming both samples).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rollfeed.collate.errors import SharedPrefixError

if TYPE_CHECKING:
    from rollfeed.collate.image_runs import ImageRuns

Chain = tuple[tuple[Hashable, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedPrefixes:
    """Per sample its chain of claimed shared prefixes (see the module doc); checked on
    construction."""

    chains: tuple[Chain, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "chains", tuple(tuple(map(tuple, c)) for c in self.chains))
        seen: dict[Hashable, tuple[int, int, Chain]] = {}  # key -> (sample, length, outer chain)
        for i, chain in enumerate(self.chains):
            last = 0
            for depth, node in enumerate(chain):
                if len(node) != 2:
                    raise SharedPrefixError(
                        f"a chain holds (key, length) pairs, got {node!r}", sample=i
                    )
                key, length = node
                if isinstance(length, bool) or not isinstance(length, int | np.integer):
                    raise SharedPrefixError(
                        f"prefix length of key {key!r} must be an int, got {length!r}", sample=i
                    )
                if length <= last:
                    raise SharedPrefixError(
                        f"prefix lengths must increase along a chain and be >= 1, got {length} "
                        f"after {last} (key {key!r})",
                        sample=i,
                    )
                try:
                    hash(key)
                except TypeError:
                    key = None
                if key is None:
                    raise SharedPrefixError(
                        f"prefix key {node[0]!r} is not a hashable value other than None", sample=i
                    )
                outer = chain[:depth]
                first = seen.setdefault(key, (i, int(length), outer))
                if first[1:] != (int(length), outer):
                    raise SharedPrefixError(
                        f"prefix key {key!r} claims {first[1]} tokens after {list(first[2])} in "
                        f"sample {first[0]} and {int(length)} tokens after {list(outer)} here; a "
                        "key names one prefix",
                        sample=i,
                    )
                last = int(length)

    def __len__(self) -> int:
        return len(self.chains)

    @classmethod
    def of_groups(
        cls,
        groups: Sequence[Hashable | None] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
    ) -> SharedPrefixes:
        """One level, as a step index holds it: sample ``i`` shares its first ``lengths[i]``
        tokens with every sample of group ``groups[i]`` (any hashable id, e.g. the prompt's);
        a group ``None`` (or a negative integer id) or a length 0 claims nothing. The key is
        ``(group, length)``: samples of one group claiming other lengths share nothing."""
        if len(groups) != len(lengths):
            raise SharedPrefixError(
                f"{len(groups)} groups for {len(lengths)} prefix lengths; give one per sample",
                field="groups",
            )
        chains = []
        for i, (g, n) in enumerate(zip(_plain(groups), _plain(lengths), strict=True)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise SharedPrefixError(
                    f"a shared-prefix length must be an int >= 0, got {n!r}", sample=i
                )
            none = g is None or (isinstance(g, int) and not isinstance(g, bool) and g < 0)
            chains.append(() if none or n == 0 else (((g, n), n),))
        return cls(chains=tuple(chains))

    @classmethod
    def of_tokens(
        cls, token_lists: Sequence[np.ndarray | Sequence[int]], groups: Sequence[Hashable]
    ) -> SharedPrefixes:
        """The chains of samples held in memory, found from their tokens within each group
        (``groups[i]``; ``None``: the sample shares nothing): a node at every length where two or
        more samples of the group still agree and the group's samples then part. Keys are
        ``(group, length, first sample)``.

        Example: ``[1, 2, 3, 4]``, ``[1, 2, 3, 5]``, ``[1, 2, 6]``, all of group 0 ->
        chains ``[((0, 2, 0), 2), ((0, 3, 0), 3)]``, the same, ``[((0, 2, 0), 2)]``.
        """
        if len(token_lists) != len(groups):
            raise SharedPrefixError(
                f"{len(token_lists)} token lists for {len(groups)} groups", field="groups"
            )
        tokens = [np.asarray(t, np.int64).reshape(-1) for t in token_lists]
        chains: list[list[tuple[Hashable, int]]] = [[] for _ in tokens]
        members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(groups):
            if g is not None:
                members.setdefault(g, []).append(i)
        for g, idx in members.items():
            _split(g, idx, 0, tokens, chains)
        return cls(chains=tuple(tuple(c) for c in chains))


def check_prefixes(
    prefixes: SharedPrefixes, lengths: np.ndarray, image_runs: ImageRuns | None
) -> None:
    """Prefixes of the samples of ``lengths``: one chain per sample, none claimed by a sample
    with images (``image_runs``)."""
    if not isinstance(prefixes, SharedPrefixes) or len(prefixes) != len(lengths):
        raise SharedPrefixError(
            f"prefixes must be SharedPrefixes with one chain per sample ({len(lengths)}), got "
            f"{len(prefixes) if isinstance(prefixes, SharedPrefixes) else type(prefixes).__name__}"
        )
    if image_runs is None:
        return
    for i, chain in enumerate(prefixes.chains):
        if chain and image_runs.counts[i]:
            raise SharedPrefixError(
                "a sample with images is not packed as a tree; give it no shared prefix",
                sample=i,
                field="images",
            )


def _plain(values) -> list:
    """Python values of a list or NumPy array (NumPy integers as ints)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _split(group, idx, depth, tokens, chains) -> None:
    """Give the samples ``idx`` (all agreeing on their first ``depth`` tokens) the node of the
    tokens they all still share, then part them by their next token."""
    stack = [(idx, depth)]
    while stack:
        idx, depth = stack.pop()
        if len(idx) < 2:
            continue
        shortest = min(len(tokens[i]) for i in idx)
        first = tokens[idx[0]][:shortest]
        agree = np.ones(shortest, bool)
        for i in idx[1:]:
            agree &= tokens[i][:shortest] == first
        same = int(np.argmin(agree)) if not agree.all() else shortest
        if same > depth:
            for i in idx:
                chains[i].append(((group, same, idx[0]), same))
        parts: dict[int, list[int]] = {}
        for i in idx:
            if len(tokens[i]) > same:
                parts.setdefault(int(tokens[i][same]), []).append(i)
        stack += [(p, same) for p in reversed(parts.values())]
