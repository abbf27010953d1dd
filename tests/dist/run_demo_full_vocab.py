"""The demo trainer's step-0 records of a micro batch with prefix trees over a cp group of 2
(2 ranks, gloo, zigzag), against the same samples packed flat on one rank: each rank's
full-vocabulary logprobs at its flat rows, and cp rank 0's sample fingerprints. A tree micro
batch's flat rows are split unevenly over cp (each rank holds the flat rows of its tree-row
tokens): the scoring runs the tree row, the fingerprints gather parts of different sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollfeed.collate import to_tensor_micro_batch
from rollfeed.demo.ledger import sample_fingerprints
from rollfeed.demo.trainer import full_vocab
from rollfeed.models import CPGroup, PolicyScorer
from tests.dist.launch import run_rank
from tests.models.test_tree_policy import float64_rms_norms
from tests.models.tiny import tiny_qwen3
from tests.models.tree_policy_cases import flat_twin, tree_micro_batch


def main() -> None:
    torch.set_num_threads(1)
    cp = CPGroup(group=dist.group.WORLD, rank=dist.get_rank(), size=2)
    mb = tree_micro_batch(cp=2, layout="zigzag")
    tmb = to_tensor_micro_batch(mb, cp_rank=cp.rank)
    counts = tmb.tree.flat_counts
    assert counts[0] != counts[1], counts  # the case the flat rows alone cannot run
    flat = to_tensor_micro_batch(flat_twin(mb), cp_rank=0)
    want = full_vocab(PolicyScorer(float64_rms_norms(tiny_qwen3(seed=8))), flat)[: mb.length]
    got = full_vocab(PolicyScorer(float64_rms_norms(tiny_qwen3(seed=8)), cp=cp), tmb)
    torch.testing.assert_close(got, want[tmb.positions], atol=1e-10, rtol=0)
    assert bool(torch.isfinite(got[tmb.loss_mask]).all())
    prints = sample_fingerprints(tmb, dist.group.WORLD)
    assert prints == (sample_fingerprints(flat, None) if cp.rank == 0 else []), prints
    if cp.rank == 0:
        print(f"demo full vocab cp 2 zigzag tree: flat rows per rank {counts}", flush=True)


if __name__ == "__main__":
    run_rank(main)
