"""Turn assembly: shifting, the final-token policy and the gap policy, all counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollfeed.capture import Turn, TurnGapError, TurnRangeError, assemble_turns
from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
from rollfeed.payload import PayloadRoot, PayloadSegment, PayloadWriter, read_field
from rollfeed.payload.errors import UnknownFieldError


def _routing(writer, n, seed):
    ids = np.random.default_rng(seed).integers(1, 9, (n, 2, 2)).astype(np.uint8)
    return ids, writer.write({"routed_experts": ids}, 0)


@pytest.fixture
def turns(tmp_path):
    with PayloadWriter(tmp_path) as w:
        ids0, seg0 = _routing(w, 3, 0)  # turn 0: 4 tokens, forwarded 0..2
        ids1, seg1 = _routing(w, 2, 1)  # turn 1: 3 tokens, forwarded 0..1
        kept = (np.array([1, 2]), np.array([5, 6, 7], np.int32))
        mask = w.write({"sampling_mask": kept}, 1, sampled=np.array([5, 7]))
    return (
        PayloadRoot(tmp_path),
        (ids0, ids1),
        [
            Turn(length=4, segments=(*seg0, *mask)),
            Turn(length=3, segments=tuple(seg1)),
        ],
    )


def test_repeat_final_token_reads_previous_row(turns):
    root, (ids0, ids1), ts = turns
    segs, metrics = assemble_turns(ts, final_token="repeat")
    assert metrics == {
        "turns": 2,
        "final_repeated": 2,
        "final_filled": 0,
        "gaps": 0,
        "fields_dropped": 0,
    }
    got = read_field(segs, "routed_experts", (0, 7), root=root)
    want = np.concatenate([ids0, ids0[-1:], ids1, ids1[-1:]])
    assert torch.equal(got, torch.from_numpy(want))
    mask = [s for s in segs if s.field == "sampling_mask"]
    assert [(s.pos, s.rows) for s in mask] == [(1, 2)]  # other windows only shift


def test_fill_final_token(turns):
    root, (ids0, ids1), ts = turns
    segs, metrics = assemble_turns(ts, final_token="fill")
    assert metrics["final_filled"] == 2 and metrics["final_repeated"] == 0
    got = read_field(segs, "routed_experts", (0, 7), root=root)
    zero = np.zeros((1, 2, 2), np.uint8)
    assert torch.equal(got, torch.from_numpy(np.concatenate([ids0, zero, ids1, zero])))
    sample = Sample(
        token_ids=np.arange(7),
        loss_mask=np.ones(7),
        advantages=np.zeros(7),
        inference_logprobs=np.zeros(7),
        payload=segs,
    )
    plan = prepare_batch([sample], PlanConfig(seq_len=8), dp_size=1)
    t = to_tensor_micro_batch(plan[0][0], cp_rank=0, root=root)
    assert torch.equal(t.fields["routed_experts"][:7], got)


def test_gap_drops_or_raises(turns):
    _, _, ts = turns
    gappy = [ts[0], Turn(length=3, segments=())]  # turn 1 has no routing at all
    segs, metrics = assemble_turns(gappy, final_token="repeat", gap="drop")
    assert {s.field for s in segs} == {"sampling_mask"}
    assert metrics["fields_dropped"] == 1 and metrics["gaps"] == 1
    with pytest.raises(TurnGapError, match=r"turn 1.*field=routed_experts, pos=4"):
        assemble_turns(gappy, gap="raise")


def test_hole_inside_a_turn(turns):
    _, _, ts = turns
    seg = ts[0].segments[0]
    holed = Turn(length=5, segments=(seg.model_copy(update={"pos": 1}),))  # position 0 missing
    with pytest.raises(TurnGapError, match="pos=0"):
        assemble_turns([holed], gap="raise")
    with pytest.raises(TurnRangeError, match="turn 0") as err:
        assemble_turns([Turn(length=2, segments=(seg,))])
    assert (err.value.turn, err.value.field) == (0, "routed_experts")


def test_assemble_turns_with_an_unknown_field_is_a_typed_error():
    seg = PayloadSegment(
        field="no_such_field", file="a.rfp", offset=64, pos=0, rows=1, dtype="uint8"
    )
    with pytest.raises(UnknownFieldError, match="no_such_field"):
        assemble_turns([Turn(length=2, segments=(seg,))])
