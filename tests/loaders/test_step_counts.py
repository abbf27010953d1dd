"""The loader's micro batches carry their step's loss-token counts, planned on every rank from
the step file's index (or, for a list, from the samples): equal to a brute-force count over what
every (dp, cp) rank's loader yields, for every source, shuffled or not; the truncation warning is
logged once per step on one rank."""

from __future__ import annotations

import logging
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    RolloutDataset,
    Topology,
    build_dataloader,
    write_step_file,
)
from tests.collate.loss_samples import samples_for

SEQ_LEN = 16
DP, CP = 2, 2


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Steps 0 and 1 of 11 samples each, some truncated at ``SEQ_LEN``, some without a loss
    token; written as step files under ``indexed``."""
    base = tmp_path_factory.mktemp("counts")
    batches = {0: samples_for(20, 11, SEQ_LEN), 1: samples_for(21, 11, SEQ_LEN)}
    for step, samples in batches.items():
        write_step_file(base / "indexed", step, samples)
    return base, batches


def _pass(dataset, step: int, shuffle: bool) -> dict[tuple[int, int], list]:
    """Every (dp, cp) rank's micro batches of ``step``, each rank's own loader."""
    out = {}
    for dp in range(DP):
        for cp in range(CP):
            topo = Topology(dp_rank=dp, dp_size=DP, cp_rank=cp, cp_size=CP)
            plan = PlanConfig(seq_len=SEQ_LEN)
            config = LoaderConfig(plan=plan, shuffle=shuffle, seed=3, start_step=step)
            out[dp, cp] = list(build_dataloader(dataset, topo, config, root=None))
    return out


def _brute_force(ranks) -> tuple[int, int, int]:
    """``(loss tokens, samples, samples with a loss token)``: each loss token of every rank's
    ``loss_mask`` given to its sample (the slot its position lies in)."""
    tokens: dict[tuple[int, int, int], int] = {}
    for (dp, _), mbs in ranks.items():
        for k, mb in enumerate(mbs):
            slot = torch.searchsorted(mb.cu_seqlens.long(), mb.positions, right=True) - 1
            for s in range(mb.num_samples):
                key = (dp, k, s)
                tokens[key] = tokens.get(key, 0) + int(mb.loss_mask[slot == s].sum())
    return sum(tokens.values()), len(tokens), sum(v > 0 for v in tokens.values())


@pytest.mark.parametrize("source", ["list", "indexed"])
def test_every_source_gives_the_brute_force_counts_on_every_rank(steps, source):
    base, batches = steps
    for step in (0, 1):
        for shuffle in (False, True):
            if source == "list":
                dataset = RolloutDataset(batches[step])
            else:
                dataset = RolloutDataset.from_step_dir(base / source)
            ranks = _pass(dataset, step, shuffle)
            total, samples, with_loss = _brute_force(ranks)
            assert 0 < with_loss < samples  # some samples are left without a loss token
            for mbs in ranks.values():
                for k, mb in enumerate(mbs):
                    c = mb.step_counts
                    assert (c.loss_tokens, c.samples, c.samples_with_loss) == (
                        total,
                        samples,
                        with_loss,
                    ), (source, step, shuffle, k)
                    slot = torch.searchsorted(mb.cu_seqlens.long(), mb.positions, right=True) - 1
                    for s in range(mb.num_samples):  # this rank's part at most the whole sample
                        assert int(mb.loss_mask[slot == s].sum()) <= int(c.sample_loss_tokens[s])
            # every source plans the same step: the same (rank, micro batch) counts as the list
            listed = _pass(RolloutDataset(batches[step]), step, shuffle)
            for r, mbs in ranks.items():
                assert [mb.step_counts for mb in mbs] == [mb.step_counts for mb in listed[r]]


def test_the_truncation_warning_is_logged_once_per_step_on_one_rank(steps, caplog):
    base, _ = steps
    dataset = RolloutDataset.from_step_dir(base / "indexed")
    by_rank = {}
    for dp in range(DP):
        for cp in range(CP):
            topo = Topology(dp_rank=dp, dp_size=DP, cp_rank=cp, cp_size=CP)
            loader = build_dataloader(
                dataset, topo, LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN)), root=None
            )
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rollfeed.loaders"):
                for _ in range(2):  # steps 0 and 1, one pass each
                    assert len(loader) and list(loader)
                assert loader.metrics["truncated"] > 0
            by_rank[dp, cp] = [r.getMessage() for r in caplog.records if "truncated" in r.message]
    assert {r: len(m) for r, m in by_rank.items()} == {(0, 0): 2, (0, 1): 0, (1, 0): 0, (1, 1): 0}
    assert [m.split(":")[0] for m in by_rank[0, 0]] == ["step 0", "step 1"]


def test_planned_counts_reach_a_worker_as_plain_numbers(steps):
    """A micro batch's counts go to a DataLoader worker inside its planned indices: pickled as
    numbers, not as a tensor (which torch's pickler would send by shared memory and a file
    descriptor per micro batch), and rebuilt equal."""
    base, _ = steps
    dataset = RolloutDataset.from_step_dir(base / "indexed")
    sampler = build_dataloader(
        dataset, Topology(), LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN)), root=None
    ).batch_sampler
    for planned in sampler.step_micro_batches(0):
        data = bytes(ForkingPickler.dumps(planned))
        assert b"torch" not in data
        back = pickle.loads(data)
        assert back == planned and back.counts == planned.counts and back.lengths == planned.lengths
