"""Bad input: typed errors that name the sample, the field and the position."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from rollfeed.collate import (
    BatchConfigError,
    CollateError,
    DuplicateFieldError,
    OverlongError,
    PlanConfig,
    Sample,
    SampleDtypeError,
    SampleLengthError,
    SegmentRangeError,
    prepare_batch,
)
from rollfeed.payload import PayloadSegment, RaggedLayout


def _seg(field="sampling_mask", pos=0, rows=2):
    layout = RaggedLayout(rows=rows, values=rows, count_bytes=1, block_rows=128)
    return PayloadSegment(
        field=field, file="f.rfp", offset=64, pos=pos, rows=rows, dtype="int32", ragged=layout
    )


def _sample(T=4, **kw):
    base = dict(
        token_ids=np.arange(T),
        loss_mask=np.ones(T, bool),
        advantages=np.zeros(T),
        inference_logprobs=np.zeros(T),
    )
    base.update(kw)
    return Sample(**base)


def test_mismatched_per_token_lengths():
    with pytest.raises(SampleLengthError, match=r"advantages.*sample=s7, field=advantages") as e:
        _sample(advantages=np.zeros(3), uid="s7")
    assert e.value.sample == "s7" and e.value.field == "advantages"
    with pytest.raises(SampleLengthError, match="field=routed_experts"):
        _sample(fields={"routed_experts": np.zeros((5, 2), np.uint8)})  # more rows than tokens
    with pytest.raises(SampleLengthError, match="sum of counts"):
        _sample(fields={"sampling_mask": (np.array([1, 0, 2, 0]), np.array([1, 2]))})
    with pytest.raises(SampleLengthError, match="at least one token"):
        _sample(T=0)


def test_dtypes():
    with pytest.raises(SampleDtypeError, match="token_ids"):
        _sample(token_ids=np.array(["a", "b", "c", "d"]))
    with pytest.raises(SampleDtypeError, match="loss_mask must hold 0/1"):
        _sample(loss_mask=np.array([0, 1, 2, 1]))
    bad = _sample(fields={"routed_experts": np.zeros((4, 2), np.float32)})
    good = _sample()
    with pytest.raises(SampleDtypeError, match=r"int values.*sample=1, field=routed_experts"):
        prepare_batch([good, bad], PlanConfig(seq_len=8), dp_size=1)
    ragged_as_fixed = _sample(fields={"sampling_mask": np.zeros((4, 2), np.int32)})
    with pytest.raises(SampleDtypeError, match=r"\(counts, values\).*sample=0"):
        prepare_batch([ragged_as_fixed], PlanConfig(seq_len=8), dp_size=1)
    with pytest.raises(SampleDtypeError, match="must fit int32"):
        _sample(fields={"sampling_mask": (np.array([1, 0, 0, 0]), np.array([1 << 40]))})
    unknown = _sample(fields={"nope": np.zeros(4)})
    with pytest.raises(SampleDtypeError, match=r"unknown payload field.*field=nope"):
        prepare_batch([unknown], PlanConfig(seq_len=8), dp_size=1)


def test_field_inline_and_by_handle():
    with pytest.raises(DuplicateFieldError, match="sample=s1, field=sampling_mask"):
        _sample(
            fields={"sampling_mask": (np.array([1, 0, 0, 0]), np.array([5]))},
            payload=[_seg()],
            uid="s1",
        )


def test_segment_outside_sample():
    with pytest.raises(SegmentRangeError, match=r"\[3, 5\).*field=sampling_mask, pos=3"):
        _sample(payload=[_seg(pos=3, rows=2)])
    _sample(payload=[_seg(pos=4, rows=0)])  # a placeholder at pos == T is fine


def test_batch_options():
    with pytest.raises(BatchConfigError, match="cp_size must be an int >= 1"):
        PlanConfig(seq_len=8, cp_size=0)
    with pytest.raises(BatchConfigError, match=r"seq_len=10 is not a multiple of .* 4"):
        PlanConfig(seq_len=10, cp_size=2, cp_layout="zigzag")
    with pytest.raises(BatchConfigError, match="multiple of 2"):
        PlanConfig(seq_len=8, cp_size=2, pad_to_multiple_of=3)
    with pytest.raises(BatchConfigError, match="cp_layout"):
        PlanConfig(seq_len=8, cp_layout="ring")
    with pytest.raises(BatchConfigError, match="overlong"):
        PlanConfig(seq_len=8, overlong="skip")
    with pytest.raises(BatchConfigError, match="quadratic_cost"):
        PlanConfig(seq_len=8, quadratic_cost=-1.0)
    with pytest.raises(BatchConfigError, match="fields must map"):
        PlanConfig(seq_len=8, fields={"x": 1})
    with pytest.raises(BatchConfigError, match="dp_size"):
        prepare_batch([_sample()], PlanConfig(seq_len=8), dp_size=0)


def test_overlong_policies():
    s = [_sample(T=3), _sample(T=9)]
    with pytest.raises(OverlongError, match=r"9 tokens > seq_len=8.*sample=1"):
        prepare_batch(s, PlanConfig(seq_len=8, overlong="error"), dp_size=1)
    plan = prepare_batch(s, PlanConfig(seq_len=8, overlong="drop"), dp_size=1)
    assert plan.metrics["dropped"] == 1 and plan.metrics["tokens"] == 3
    plan = prepare_batch(s, PlanConfig(seq_len=8, overlong="truncate"), dp_size=1)
    assert plan.metrics["truncated"] == 1 and plan.metrics["truncated_tokens"] == 1
    assert plan.metrics["tokens"] == 11


def test_errors_pickle_and_are_value_errors():
    err = SegmentRangeError("outside", sample=3, field="routed_experts", pos=9)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, CollateError) and isinstance(back, ValueError)
    assert (back.sample, back.field, back.pos, str(back)) == (3, "routed_experts", 9, str(err))


def test_json_round_trip():
    s = _sample(
        temperatures=np.full(4, 0.7, np.float32),
        fields={
            "routed_experts": np.arange(16, dtype=np.uint8).reshape(4, 2, 2),
            "sampling_mask_logprobs": (np.array([0, 2, 0, 1]), np.array([-0.5, -1.0, -np.inf])),
        },
        uid="req-1/branch-0",
    )
    back = Sample.from_json(s.to_json())
    for name in ("token_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures"):
        a, b = getattr(s, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert back.fields["routed_experts"].dtype == np.uint8
    assert np.array_equal(back.fields["routed_experts"], s.fields["routed_experts"])
    assert np.array_equal(back.fields["sampling_mask_logprobs"][1], [-0.5, -1.0, -np.inf])
    assert back.uid == "req-1/branch-0"
    h = Sample.from_json(_sample(payload=[_seg(pos=1)]).to_json())
    assert h.payload == (_seg(pos=1),)
    with pytest.raises(SampleLengthError, match="inference_logprobs"):
        Sample.from_json(
            '{"token_ids": [1, 2], "loss_mask": [0, 1], "advantages": [0, 0], '
            '"inference_logprobs": [0]}'
        )
    with pytest.raises(SampleDtypeError, match="unknown keys"):
        Sample.from_json(
            '{"token_ids": [1], "loss_mask": [0], "advantages": [0], '
            '"inference_logprobs": [0], "extra": 1}'
        )
