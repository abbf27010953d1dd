"""micro_batch_rows aligns the sequence-window mask logprobs with the labels-window kept sets."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from rollfeed.collate import (
    PlanConfig,
    RaggedRows,
    Sample,
    TensorMicroBatch,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.objectives import ObjectiveInputError, micro_batch_rows

# Per sample: tokens, and per position either None or {id: logprob} (the kept set).
SAMPLES = [
    ([5, 6, 7, 8], [None, {6: -0.1, 2: -2.4}, {7: -0.01, 9: -math.inf, 1: -5.0}, {8: 0.0}]),
    ([9, 3, 4], [None, {3: -0.5, 11: -1.0}, {4: -0.2, 0: -9999.0}]),
]


def _samples() -> list[Sample]:
    out = []
    for i, (tokens, rows) in enumerate(SAMPLES):
        counts = np.array([len(r) if r else 0 for r in rows])
        ids = np.array([v for r in rows if r for v in r], np.int32)
        lps = np.array([x for r in rows if r for x in r.values()], np.float32)
        out.append(
            Sample(
                np.array(tokens),
                loss_mask=np.array([0] + [1] * (len(tokens) - 1), bool),
                advantages=np.ones(len(tokens), np.float32),
                inference_logprobs=np.full(len(tokens), -0.5, np.float32),
                fields={"sampling_mask": (counts, ids), "sampling_mask_logprobs": (counts, lps)},
                uid=f"s{i}",
            )
        )
    return out


def _expected(tmb) -> list[list[float]]:  # type: ignore[no-untyped-def]
    """Per local row: the kept set's logprobs, the label first, then the ids ascending."""
    at = {}
    start = 0
    for tokens, rows in SAMPLES:
        for t, r in enumerate(rows):
            if r:
                label = tokens[t]
                at[start + t] = [r[label], *(r[v] for v in sorted(r) if v != label)]
        start += len(tokens)
    return [at.get(int(p) + 1, []) for p in tmb.positions]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("form", ["ragged", "padded", "trimmed"])
def test_rows_align_slot_for_slot_with_the_kept_sets(layout: str, form: str) -> None:
    (mb,) = prepare_batch(
        _samples(), PlanConfig(seq_len=8, cp_size=2, cp_layout=layout), dp_size=1
    )[0]
    for rank in range(2):
        tmb = to_tensor_micro_batch(mb, cp_rank=rank, width=4 if form == "padded" else None)
        if form == "trimmed":  # trailing -inf slots trimmed: the rows must be re-aligned
            lp = tmb.fields["sampling_mask_logprobs"]
            trimmed = RaggedRows.from_padded(lp.padded(fill=-math.inf), fill=-math.inf)
            assert trimmed.nnz < lp.nnz
            fields = {**tmb.fields, "sampling_mask_logprobs": trimmed}
            tmb = dataclasses.replace(tmb, fields=fields)
        support, mask = micro_batch_rows(tmb)
        assert torch.equal(mask.offsets, support.offsets)
        ids = support.padded(fill=-1)
        got = mask.padded(fill=-math.inf)
        for j, want in enumerate(_expected(tmb)):
            row = got[j, : len(want)].tolist()
            assert row == pytest.approx(want), (rank, j)
            assert (got[j, len(want) :] == -math.inf).all()
            if want:
                assert int(ids[j, 0]) == int(tmb.labels[j])


def test_a_field_of_another_window_is_refused() -> None:
    (mb,) = prepare_batch(_samples(), PlanConfig(seq_len=8, cp_size=1), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    cut = {**tmb.fields, "sampling_mask_logprobs": tmb.fields["sampling_mask_logprobs"].rows(0, 5)}
    with pytest.raises(
        ObjectiveInputError, match=f"must hold the micro batch's {tmb.seq_len} rows"
    ):
        micro_batch_rows(dataclasses.replace(tmb, fields=cut))
    support, mask = micro_batch_rows(dataclasses.replace(tmb, fields={}))
    assert support.nnz == mask.nnz == 0 and mask.n_rows == tmb.labels.numel()


class _Largest(TorchFunctionMode):
    """The largest tensor any torch call returns while the mode is on, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def test_a_sample_without_mask_logprobs_keeps_the_rows_ragged() -> None:
    # 4,008 rows, one kept set of 4,000 ids (N x W would be 16M slots), ~80k kept ids; the first
    # sample was written without mask logprobs, the rest with.
    g = torch.Generator().manual_seed(0)
    n = 4008
    lengths = torch.randint(1, 40, (n,), generator=g)
    lengths[7] = 4000
    support = RaggedRows.from_lengths(
        lengths, torch.randint(0, 1000, (int(lengths.sum()),), generator=g, dtype=torch.int32)
    )
    held = torch.cat([torch.zeros(1, dtype=torch.int64), lengths])  # row p: the token at p
    held[1:100] = 0
    mask = RaggedRows.from_lengths(held, -torch.rand(int(held.sum()), generator=g))
    mb = TensorMicroBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        position_ids=torch.arange(n),
        labels=torch.zeros(n, dtype=torch.int64),
        loss_mask=torch.ones(n, dtype=torch.bool),
        advantages=torch.zeros(n),
        inference_logprobs=torch.zeros(n),
        temperatures=torch.ones(n),
        positions=torch.arange(n),
        seq_lens=torch.tensor([n + 1], dtype=torch.int32),
        cu_seqlens=torch.tensor([0, 99, n + 1], dtype=torch.int32),
        seq_len=n + 1,
        cp_rank=0,
        cp_size=1,
        cp_layout="contiguous",
        fields={"sampling_mask": support, "sampling_mask_logprobs": mask},
    )
    with _Largest() as largest:
        _, got = micro_batch_rows(mb)
    assert largest.bytes <= 8 * (support.nnz + n + 2)  # an int64 per kept id: no [N, W]
    assert torch.equal(got.offsets, support.offsets)
    vals = got.values
    assert (vals[: int(support.offsets[99])] == -math.inf).all()  # the sample without any
    assert torch.equal(vals[int(support.offsets[99]) :], mask.values)


def test_positions_outside_the_micro_batch_are_refused() -> None:
    (mb,) = prepare_batch(_samples(), PlanConfig(seq_len=8, cp_size=1), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    bad = tmb.positions.clone()
    bad[3] = tmb.seq_len
    with pytest.raises(ObjectiveInputError) as err:
        micro_batch_rows(dataclasses.replace(tmb, positions=bad))
    assert (err.value.tensor, err.value.pos) == ("positions", 3)
