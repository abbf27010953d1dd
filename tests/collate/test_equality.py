"""By handle == inline, bitwise, for every DP rank, micro batch and CP rank."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.payload import PayloadRoot, PayloadWriter, RaggedRows
from tests.collate.gen import make_batch

SEQ_LEN = 48  # a multiple of 2 * 4 (zigzag with cp 4)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    root = tmp_path_factory.mktemp("payload")
    rng = np.random.default_rng(7)
    with PayloadWriter(root, group="a") as wa, PayloadWriter(root, group="b") as wb:
        inline, handle = make_batch(rng, 14, SEQ_LEN, [wa, wb])
    return PayloadRoot(root), inline, handle


def _assert_equal(a, b, where):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("fields", "coverage"):
            assert sorted(x) == sorted(y), (where, sorted(x), sorted(y))
            for k in x:
                assert type(x[k]) is type(y[k]), (where, k)
                assert x[k].dtype == y[k].dtype, (where, k, x[k].dtype, y[k].dtype)
                if isinstance(x[k], RaggedRows):
                    assert x[k].equal(y[k]), (where, k)
                    continue
                assert x[k].shape == y[k].shape, (where, k, x[k].shape, y[k].shape)
                assert torch.equal(x[k], y[k]), (where, k)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (where, f.name)
        else:
            assert x == y, (where, f.name)


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("whole_fields", [False, True])
def test_by_handle_equals_inline(batches, cp_size, cp_layout, whole_fields):
    root, inline, handle = batches
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=cp_size, cp_layout=cp_layout)
    plan_a, plan_b = (
        prepare_batch(inline, config, dp_size=2),
        prepare_batch(handle, config, dp_size=2),
    )
    assert plan_a.metrics == plan_b.metrics
    assert plan_a.metrics["truncated"] > 0  # non-vacuity: truncation happened
    seen = {"fields": set(), "mixed_width": False, "segments": 0, "clipped_head": False}
    for dp, (ra, rb) in enumerate(zip(plan_a, plan_b, strict=True)):
        for step, (ma, mb) in enumerate(zip(ra, rb, strict=True)):
            assert ma.indices == mb.indices and ma.cu_seqlens == mb.cu_seqlens
            seen["segments"] += sum(len(v) for v in mb.segments.values())
            seen["clipped_head"] |= any(s.first > 0 for v in mb.segments.values() for s in v)
            whole = to_tensor_micro_batch(mb, cp_rank=0, root=root, whole_fields=True)
            for r in range(cp_size):
                ta = to_tensor_micro_batch(ma, cp_rank=r, whole_fields=whole_fields)
                tb = to_tensor_micro_batch(mb, cp_rank=r, root=root, whole_fields=whole_fields)
                _assert_equal(ta, tb, (dp, step, r))
                seen["fields"] |= set(tb.fields)
                mask = tb.fields.get("sampling_mask")
                if mask is not None and not whole_fields:
                    # a rank's rows are the whole row's rows at its positions, re-based
                    mine = whole.fields["sampling_mask"].take(tb.positions)
                    assert mask.equal(mine), (dp, step, r)
                    seen["mixed_width"] |= mask.width() > 1
    assert seen["fields"] == {
        "routed_experts",
        "routed_expert_weights",
        "sampling_mask",
        "sampling_mask_logprobs",
    }
    assert seen["segments"] > 0 and seen["clipped_head"]
    assert seen["mixed_width"] or whole_fields


def test_static_width_and_too_narrow(batches):
    from rollfeed.payload import PayloadWidthError

    root, inline, handle = batches
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")
    pairs = zip(
        prepare_batch(inline, config, dp_size=1)[0],
        prepare_batch(handle, config, dp_size=1)[0],
        strict=True,
    )
    rank0 = dict(cp_rank=0)
    wide = [
        (ma, mb)
        for ma, mb in pairs
        if "sampling_mask" in (t := to_tensor_micro_batch(ma, **rank0)).fields
        and t.fields["sampling_mask"].width() > 1
    ]
    assert wide  # non-vacuity: some micro batch has a mask row wider than 1
    ma, mb = wide[0]
    ta = to_tensor_micro_batch(ma, cp_rank=1, width=9)
    tb = to_tensor_micro_batch(mb, cp_rank=1, width=9, root=root)
    _assert_equal(ta, tb, "width=9")
    assert ta.fields["sampling_mask"].shape[1] == 9
    ragged = to_tensor_micro_batch(mb, cp_rank=1, root=root).fields["sampling_mask"]
    assert torch.equal(ta.fields["sampling_mask"], ragged.padded(9))
    with pytest.raises(PayloadWidthError, match="sampling_mask"):
        to_tensor_micro_batch(ma, width=1, **rank0)
    with pytest.raises(PayloadWidthError, match="sampling_mask"):
        to_tensor_micro_batch(mb, width=1, root=root, **rank0)


def test_mixed_inline_and_by_handle_in_one_micro_batch(batches):
    root, inline, handle = batches
    mixed = [h if i % 2 else a for i, (a, h) in enumerate(zip(inline, handle, strict=True))]
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")
    plan_a, plan_m = (
        prepare_batch(inline, config, dp_size=1),
        prepare_batch(mixed, config, dp_size=1),
    )
    both = 0
    for ma, mm in zip(plan_a[0], plan_m[0], strict=True):
        both += bool(mm.segments) and any(s.fields for s in mm.samples)
        for r in range(2):
            ta = to_tensor_micro_batch(ma, cp_rank=r)
            _assert_equal(ta, to_tensor_micro_batch(mm, cp_rank=r, root=root), ("mixed", r))
    assert both > 0  # non-vacuity: some micro batch holds both kinds


def test_field_cut_to_placeholders_reads_empty_rows(tmp_path):
    from rollfeed.collate import Sample

    T, P = 20, 12
    counts, sampled = np.full(T - P, 2), np.arange(P, T)  # tokens are arange(T)
    values = np.stack([sampled, 100 + sampled], axis=1).reshape(-1).astype(np.int32)
    with PayloadWriter(tmp_path) as w:
        segs = w.write({"sampling_mask": (counts, values)}, P, sampled=sampled)
    base = dict(loss_mask=np.ones(T), advantages=np.zeros(T), inference_logprobs=np.zeros(T))
    full = np.concatenate([np.zeros(P, np.int64), counts])
    a = Sample(np.arange(T), **base, fields={"sampling_mask": (full, values)})
    b = Sample(np.arange(T), **base, payload=segs)
    for s, root in ((a, None), (b, tmp_path)):
        plan = prepare_batch([s], PlanConfig(seq_len=8), dp_size=1)
        assert plan.metrics["truncated"] == 1
        t = to_tensor_micro_batch(plan[0][0], cp_rank=0, root=root)
        mask = t.fields["sampling_mask"]
        assert mask.offsets.tolist() == [0] * 9 and mask.dtype == torch.int32


def test_plan_pickles(batches):
    import pickle

    _, _, handle = batches
    plan = prepare_batch(handle, PlanConfig(seq_len=SEQ_LEN), dp_size=2)
    back = pickle.loads(pickle.dumps(plan))
    assert back.metrics == plan.metrics and len(back) == 2
    assert back[0][0].segments == plan[0][0].segments
