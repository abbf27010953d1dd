"""Micro batches with prefix trees: every per-token tensor lines up with the samples packed one
by one, the forward's tokens and routes are the tree row's (a shared prefix's routes read once),
split over cp by the tree row; shared tokens and routes are confirmed, a mismatch is typed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rollfeed.collate import (
    PlanConfig,
    SharedPrefixError,
    place_micro_batch,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.payload import ImageSpan, PayloadWriter
from tests.collate.tree_cases import conversation, group, make_tree_samples

CASES = [group(9, [3, 5, 4]), conversation(6, [3, 2, 2]), group(5, [4])]
LAYOUTS = [(1, "contiguous"), (2, "contiguous"), (2, "zigzag"), (3, "zigzag")]
FLAT = ["input_ids", "position_ids", "labels", "loss_mask", "advantages", "temperatures"]


def _samples(tmp_path, by_handle: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    if not by_handle:
        return make_tree_samples(rng, CASES)
    with PayloadWriter(tmp_path, group="g", name="w") as writer:
        return make_tree_samples(rng, CASES, writer=writer)


def _one_by_one(mb, root):
    """The same samples packed one by one in one flat row, read whole (the reference)."""
    config = dataclasses.replace(mb.config, seq_len=1024, cp_size=1, cp_layout="contiguous")
    flat = place_micro_batch(list(mb.samples), config)
    assert flat.starts == mb.starts and flat.length == mb.length
    return to_tensor_micro_batch(flat, cp_rank=0, root=root)


@pytest.mark.parametrize("by_handle", [False, True])
@pytest.mark.parametrize(("cp", "layout"), LAYOUTS)
def test_tree_micro_batch_lines_up_with_samples_packed_one_by_one(tmp_path, by_handle, cp, layout):
    samples, prefixes = _samples(tmp_path, by_handle)
    config = PlanConfig(seq_len=96, cp_size=cp, cp_layout=layout)
    plan = prepare_batch(samples, config, dp_size=1, prefixes=prefixes)
    (mb,) = plan[0]
    assert len(mb.trees) == 2 and mb.tree is not None and mb.tree.length <= 96
    root = tmp_path if by_handle else None
    ref = _one_by_one(mb, root)
    held = []
    for rank in range(cp):
        t = to_tensor_micro_batch(mb, cp_rank=rank, root=root)
        pos, tree = t.positions, t.tree
        held.append(pos)
        assert t.seq_len == mb.length and tree.seq_len == mb.tree.length
        assert tree.flat_counts[rank] == pos.numel() and sum(tree.flat_counts) == mb.length
        for name in FLAT:
            assert torch.equal(getattr(t, name), getattr(ref, name)[pos]), name
        # the forward's tokens: each flat row's tree token is its token at its position
        assert torch.equal(tree.input_ids[tree.rows], t.input_ids)
        assert torch.equal(tree.position_ids[tree.rows], t.position_ids)
        assert tree.input_ids.numel() == mb.tree.length // cp
        kept, want = t.fields["sampling_mask"], ref.fields["sampling_mask"].take(pos)
        assert kept.equal(want)
        routes = t.fields["routed_experts"]
        assert routes.shape[0] == tree.input_ids.numel()  # over the rank's tree tokens
        assert torch.equal(routes[tree.rows], ref.fields["routed_experts"][pos])
        covered = t.coverage["routed_experts"]
        assert torch.equal(covered[tree.rows], ref.coverage["routed_experts"][pos])
    assert torch.equal(torch.cat(held).sort().values, torch.arange(mb.length))


def test_shared_routes_are_read_once(tmp_path):
    samples, prefixes = _samples(tmp_path, True)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=96), dp_size=1, prefixes=prefixes)[0]
    rows = lambda segs: sum(s.rows for s in segs)  # noqa: E731
    flat, tree = rows(mb.segments["routed_experts"]), rows(mb.tree_segments["routed_experts"])
    # every token of the tree row once but each sample's last (never forwarded), against every
    # sample's own copy of its prefixes
    owned = sum(n for n, o in zip(mb.tree.lengths, mb.tree.owners, strict=True) if o >= 0)
    assert tree == owned - len(mb.samples)
    assert flat == sum(len(s) - 1 for s in mb.samples) and tree < flat


def _tree_mb(samples, prefixes, config=None):
    plan = prepare_batch(samples, config or PlanConfig(seq_len=96), dp_size=1, prefixes=prefixes)
    return plan[0][0]


def test_a_token_that_differs_inside_the_shared_prefix_is_refused(tmp_path):
    samples, prefixes = _samples(tmp_path, False)
    ids = samples[1].token_ids.copy()
    ids[4] += 1
    samples[1] = dataclasses.replace(samples[1], token_ids=ids)
    with pytest.raises(SharedPrefixError, match="differs") as err:
        _tree_mb(samples, prefixes)
    assert (err.value.sample, err.value.field, err.value.pos) == (1, "token_ids", 4)


@pytest.mark.parametrize("by_handle", [False, True])
def test_routes_that_differ_inside_the_shared_prefix_are_refused(tmp_path, by_handle):
    samples, prefixes = _samples(tmp_path, False)
    routes = samples[2].fields["routed_experts"].copy()
    routes[3, 1, 0] = (routes[3, 1, 0] + 1) % 8
    fields = {**samples[2].fields, "routed_experts": routes}
    if by_handle:  # same bytes in another record for sample 0, other bytes for sample 2
        with PayloadWriter(tmp_path, group="g", name="x") as w:
            same = w.write({"routed_experts": samples[0].fields["routed_experts"]}, 0)
            other = w.write({"routed_experts": routes}, 0)
        samples[0] = dataclasses.replace(
            samples[0], fields={"sampling_mask": samples[0].fields["sampling_mask"]}, payload=same
        )
        fields = {"sampling_mask": fields["sampling_mask"]}
        samples[2] = dataclasses.replace(samples[2], fields=fields, payload=other)
    else:
        samples[2] = dataclasses.replace(samples[2], fields=fields)
    mb = _tree_mb(samples, prefixes)
    root = tmp_path if by_handle else None
    with pytest.raises(SharedPrefixError, match="routed_experts rows differ") as err:
        to_tensor_micro_batch(mb, cp_rank=0, root=root)
    assert (err.value.sample, err.value.field, err.value.pos) == (2, "routed_experts", 3)


def test_equal_routes_in_other_records_are_confirmed_by_bytes(tmp_path):
    samples, prefixes = _samples(tmp_path, False)
    with PayloadWriter(tmp_path, group="g", name="y") as w:
        for i in range(3):  # one record per sample: the prompt's rows written three times
            segs = w.write({"routed_experts": samples[i].fields["routed_experts"]}, 0)
            keep = {"sampling_mask": samples[i].fields["sampling_mask"]}
            samples[i] = dataclasses.replace(samples[i], fields=keep, payload=segs)
    mb = _tree_mb(samples, prefixes)
    t = to_tensor_micro_batch(mb, cp_rank=0, root=tmp_path)
    assert t.coverage["routed_experts"][: mb.tree.lengths[0]].all()


def test_a_tree_holding_a_sample_with_images_is_refused(tmp_path):
    samples, prefixes = _samples(tmp_path, False)
    mb = _tree_mb(samples, prefixes)
    image = ImageSpan(start=10, tokens=2, grid=(1, 2, 4), data=b"png")
    placed = list(mb.samples)
    placed[0] = dataclasses.replace(placed[0], images=[image])
    with pytest.raises(SharedPrefixError, match="images"):
        place_micro_batch(placed, mb.config, trees=mb.trees)
