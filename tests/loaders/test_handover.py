"""The memfd handover: a micro batch arrives bitwise, a buffer is reused only once every tensor
of the trainer's mapping of it is gone, and buffers of discarded micro batches come back."""

from __future__ import annotations

import gc

import pytest
import torch

from rollfeed.loaders.handover import Handover
from tests.loaders.common import assert_bitwise, reference, write_batch

pytestmark = pytest.mark.skipif(not Handover.available(), reason="needs memfd_create (Linux)")


@pytest.fixture(scope="module")
def tmbs(tmp_path_factory):
    root = tmp_path_factory.mktemp("handover") / "payload"
    samples = write_batch(root, 16, seed=21)
    ref, _ = reference(samples, dp_size=1, cp_size=1, cp_layout="contiguous", root=root)
    return ref[0, 0]


def test_a_buffer_is_reused_only_when_no_tensor_views_it(tmbs):
    a, b, c = tmbs[0], tmbs[1], tmbs[2]
    h = Handover(1)  # this process plays the worker and the trainer
    held = h.receive(h.send(a, worker=0, token=1))
    kept_view = h.receive(h.send(b, worker=0, token=2)).input_ids  # one tensor keeps it
    assert len(h._buffers) == 2
    third = h.receive(h.send(c, worker=0, token=3))  # nothing given back yet: a new buffer
    assert len(h._buffers) == 3
    expected = kept_view.clone()
    del third
    gc.collect()
    h.receive(h.send(a, worker=0, token=4))  # reuses the third's buffer, no other
    assert len(h._buffers) == 3
    assert_bitwise(held, a, "held")
    assert torch.equal(kept_view, expected)


def test_buffers_of_discarded_micro_batches_come_back(tmbs):
    h = Handover(1)
    h.send(tmbs[0], worker=0, token=1)  # the DataLoader discarded this one (a pass left early)
    got = h.receive(h.send(tmbs[1], worker=0, token=2))
    assert_bitwise(got, tmbs[1], "after a discarded one")
    del got
    gc.collect()
    h.receive(h.send(tmbs[2], worker=0, token=3))
    assert len(h._buffers) == 2  # the discarded one's buffer was given back and reused
