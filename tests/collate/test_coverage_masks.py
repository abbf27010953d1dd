"""Coverage masks of fixed-width ``inputs`` fields: which rows of a rank's window came from recorded
data. By handle == inline, bitwise, and both equal a reference taken from the records alone, over
truncation, packing, DP 2 x CP 1/2/4 and both layouts; a dummy micro batch has none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
from rollfeed.collate.cp import field_ranges, ranges_index, rank_ranges
from rollfeed.payload import PayloadRoot, PayloadWriter

SEQ_LEN = 48
ROUTED = ("routed_experts", "routed_expert_weights")


def _pairs(root, seed: int = 11, n: int = 12):
    """(inline samples, by-handle samples): routing rows for a prefix of each sample (the
    forwarded positions, or fewer: a gap at the end), written by handle in two regions."""
    rng = np.random.default_rng(seed)
    inline, handle = [], []
    with PayloadWriter(root, group="a") as writer:
        for i, T in enumerate(rng.integers(2, 2 * SEQ_LEN, n)):
            T = int(T)
            rows = int(rng.integers(1, T)) if rng.random() < 0.3 else T - 1
            ids = rng.integers(0, 8, (rows, 2, 2)).astype(np.uint8)
            w = rng.random((rows, 2, 2), dtype=np.float32)
            cut = int(rng.integers(0, rows + 1))
            segs = []
            for lo, hi in ((0, cut), (cut, rows)):
                if hi > lo:
                    segs += writer.write(
                        {"routed_experts": ids[lo:hi], "routed_expert_weights": w[lo:hi]}, lo
                    )
            base = dict(
                token_ids=rng.integers(0, 100, T),
                loss_mask=np.ones(T, bool),
                advantages=np.zeros(T, np.float32),
                inference_logprobs=np.zeros(T, np.float32),
                uid=f"s{i}",
            )
            fields = {"routed_experts": ids, "routed_expert_weights": w}
            inline.append(Sample(**base, fields=fields))
            handle.append(Sample(**base, payload=segs))
    return inline, handle


def _reference(mb, ranges) -> np.ndarray:
    """From the micro batch's records alone: a position is covered when a record holds it."""
    idx = ranges_index(field_ranges(ranges, "inputs", mb.length))
    out = np.zeros(len(idx), bool)
    for seg in mb.segments.get("routed_experts", ()):
        out |= (idx >= seg.pos) & (idx < seg.pos + seg.rows)
    return out


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_coverage_by_handle_equals_inline_and_the_records(tmp_path, cp_size, cp_layout) -> None:
    inline, handle = _pairs(tmp_path)
    root = PayloadRoot(tmp_path)
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=cp_size, cp_layout=cp_layout)
    plan_a, plan_b = (
        prepare_batch(inline, config, dp_size=2),
        prepare_batch(handle, config, dp_size=2),
    )
    assert plan_b.metrics["truncated"] > 0
    fill_inside = covered = 0
    for ra, rb in zip(plan_a, plan_b, strict=True):
        for ma, mb in zip(ra, rb, strict=True):
            for rank in range(cp_size):
                a = to_tensor_micro_batch(ma, cp_rank=rank)
                b = to_tensor_micro_batch(mb, cp_rank=rank, root=root)
                assert (
                    sorted(a.coverage) == sorted(b.coverage) == sorted(ROUTED if mb.samples else ())
                )
                if mb.is_dummy:
                    continue
                want = _reference(mb, rank_ranges(mb.cu_seqlens, rank, cp_size, cp_layout))
                for name in ROUTED:
                    assert a.coverage[name].dtype == torch.bool
                    assert torch.equal(a.coverage[name], b.coverage[name]), name
                    np.testing.assert_array_equal(b.coverage[name].numpy(), want)
                    # Uncovered rows read the field's fill.
                    assert not b.fields[name][~b.coverage[name]].any()
                covered += int(want.sum())
                fill_inside += int((~want & (b.position_ids > 0).numpy()).sum())
    assert covered > 0 and fill_inside > 0  # recorded rows and fill rows inside samples
