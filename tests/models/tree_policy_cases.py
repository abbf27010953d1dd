"""Cases for tree-packed scoring, shared by the single-process tests and the cp rank script.

Groups of 1, 2 and 8 (a shared prompt, completions of their own lengths) and a 3-turn
conversation with 2 branches per turn (8 samples, a tree of depth 3), built by
:mod:`tests.collate.tree_cases` with routes other than the model's own (shifted by 3 of 8
experts, the model's own routing of each whole sample: a prefix routes alike in every sample
through it) and kept sets, planned as trees. The reference scores each sample alone
(:func:`tests.dist.policy_cases.reference`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rollfeed.collate import PlanConfig, place_micro_batch, prepare_batch
from tests.collate.tree_cases import conversation, group, make_tree_samples
from tests.dist.policy_cases import own_routing
from tests.models.tiny import VOCAB

CASES = [
    group(11, [4]),
    group(9, [3, 6]),
    group(10, [2, 5, 3, 4, 1, 6, 2, 3]),
    conversation(5, [3, 2, 2]),
]


def tree_micro_batch(model_for_routes=None, *, seed: int = 0, cp: int = 1, layout="contiguous"):
    """The planned micro batch of :data:`CASES` (one row, trees), routes from the model's own
    routing when ``model_for_routes`` is given (stock sdpa attention)."""
    routes = None
    if model_for_routes is not None:
        routes = lambda ids: (own_routing(model_for_routes, [ids])[0] + 3) % 8  # noqa: E731
    samples, prefixes = make_tree_samples(
        np.random.default_rng(seed),
        CASES,
        vocab=VOCAB,
        routes=routes,
        with_routes=model_for_routes is not None,
    )
    config = PlanConfig(seq_len=160, cp_size=cp, cp_layout=layout)
    (mb,) = prepare_batch(samples, config, dp_size=1, prefixes=prefixes)[0]
    assert len(mb.trees) == 3 and mb.tree.length < mb.length
    return mb


def flat_twin(mb):
    """The same samples packed one by one (flat, cp 1): the rows every tree result lines up with."""
    config = dataclasses.replace(mb.config, seq_len=1024, cp_size=1, cp_layout="contiguous")
    return place_micro_batch(list(mb.samples), config)


def weights(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
