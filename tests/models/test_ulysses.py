"""Single-process checks of packed attention, the cp group and the Ulysses helpers (real ranks:
tests/dist)."""

from __future__ import annotations

import pytest
import torch

from rollfeed.collate import Topology
from rollfeed.models import CPGroup, CPGroupError, PackingError, UlyssesShapeError
from rollfeed.models.packing_attention import packed_layout, segment_ids_from_positions
from rollfeed.models.ulysses import gather_sequence, heads_to_seq, seq_to_heads
from tests.models.tiny import VOCAB, tiny_qwen3

TOL = 1e-12  # float64: packed and per-sample runs differ only by summation order


def _forward(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[None], position_ids=pos[None], packing=packed_layout(pos)).logits
    return torch.log_softmax(logits[0], -1)


# Distinct lengths, and repeated ones (equal-length samples share one batched attention call;
# stacking them must not mix them).
@pytest.mark.parametrize("lengths", [[5, 1, 4, 3], [4, 2, 4, 1, 2, 4]])
def test_packed_row_equals_each_sample_alone_values_and_grads(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    weight = torch.randn(sum(lengths), VOCAB, generator=gen, dtype=torch.float64)

    packed_model = tiny_qwen3(seed=2)
    packed = _forward(packed_model, ids, pos)
    (packed * weight).sum().backward()

    alone_model = tiny_qwen3(seed=2)
    parts = []
    for sl_ids, sl_pos, sl_w in zip(
        ids.split(lengths), pos.split(lengths), weight.split(lengths), strict=True
    ):
        out = _forward(alone_model, sl_ids, sl_pos)
        (out * sl_w).sum().backward()
        parts.append(out.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(parts), atol=TOL, rtol=0)
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=TOL, rtol=0, msg=name)


def test_a_token_never_sees_another_sample() -> None:
    # Changing sample A's tokens must not move any output of sample B packed after it.
    model = tiny_qwen3(seed=4)
    pos = torch.tensor([0, 1, 2, 0, 1, 2])
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    other = ids.clone()
    other[:3] = torch.tensor([50, 60, 70])
    with torch.no_grad():
        a, b = _forward(model, ids, pos), _forward(model, other, pos)
    assert torch.equal(a[3:], b[3:])
    assert not torch.allclose(a[:3], b[:3])


def test_segment_ids_from_positions_example() -> None:
    pos = torch.tensor([0, 1, 2, 0, 1, 0])
    assert segment_ids_from_positions(pos).tolist() == [0, 0, 0, 1, 1, 2]
    # A row that starts mid-sample (truncated) still opens a segment at its first token.
    assert segment_ids_from_positions(torch.tensor([3, 4, 0])).tolist() == [0, 0, 1]


def test_layout_from_cu_seqlens_equals_layout_from_positions() -> None:
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1])
    cu = torch.tensor([0, 3, 5, 7])
    a = packed_layout(pos).allowed
    b = packed_layout(pos, cu_seqlens=cu).allowed
    assert torch.equal(a, b)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for lo, hi in [(0, 3), (3, 5), (5, 7)]:
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo).tril().bool()
    assert torch.equal(a, expected)


def test_layout_in_zigzag_order_is_the_permuted_canonical_mask() -> None:
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    cu = torch.tensor([0, 4, 8])
    order = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])
    canonical = packed_layout(pos, cu_seqlens=cu).allowed
    permuted = packed_layout(pos[order], canonical_index=order, cu_seqlens=cu).allowed
    assert torch.equal(permuted, canonical[order][:, order])


def test_bad_cu_seqlens_is_refused() -> None:
    with pytest.raises(PackingError, match="cu_seqlens"):
        packed_layout(torch.arange(4), cu_seqlens=torch.tensor([0, 2]))


def test_uneven_heads_and_lengths_are_refused() -> None:
    cp = CPGroup(group=object(), rank=0, size=3)  # never reaches a collective
    with pytest.raises(UlyssesShapeError, match="4 heads, cp=3"):
        seq_to_heads(torch.zeros(1, 4, 2, 8), cp, seq_dim=2, head_dim=1)
    with pytest.raises(UlyssesShapeError, match="S=5, cp=3"):
        heads_to_seq(torch.zeros(1, 3, 5, 8), cp, seq_dim=2, head_dim=1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rank": 0, "size": 2}, "needs the process group"),
        ({"group": object(), "rank": 2, "size": 2}, "0 <= rank < size"),
        ({"rank": 0, "size": 0}, "size >= 1"),
        ({"rank": True}, "rank must be an int"),
    ],
)
def test_invalid_cp_group_is_refused(options, match) -> None:
    with pytest.raises(CPGroupError, match=match):
        CPGroup(**options)


def test_gather_sequence_local_reorders_to_canonical() -> None:
    x = torch.tensor([[10.0], [13.0], [11.0], [12.0]], requires_grad=True)
    out = gather_sequence(x, CPGroup(), canonical_index=torch.tensor([0, 3, 1, 2]))
    assert out[:, 0].tolist() == [10.0, 11.0, 12.0, 13.0]
    (out[:, 0] * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert x.grad[:, 0].tolist() == [1.0, 4.0, 2.0, 3.0]
    with pytest.raises(PackingError, match="permutation"):
        gather_sequence(x, CPGroup(), canonical_index=torch.tensor([0, 0, 1, 2]))


def test_sliding_window_layers_are_exact() -> None:
    options = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model, stock = tiny_qwen3(**options), tiny_qwen3(**options)
    stock.set_attn_implementation("sdpa")
    pos = torch.arange(9)
    with torch.no_grad():
        got = model(input_ids=pos[None], position_ids=pos[None], packing=packed_layout(pos))
        want = stock(input_ids=pos[None])
    torch.testing.assert_close(got.logits, want.logits, atol=1e-10, rtol=0)


def test_cp_group_takes_rank_and_size_from_the_topology() -> None:
    group = object()  # never reaches a collective (no process group is initialised)
    topo = Topology(dp_rank=1, dp_size=2, cp_rank=1, cp_size=3)
    assert CPGroup.from_topology(topo, group=group) == CPGroup(group=group, rank=1, size=3)
    assert CPGroup.from_topology(Topology(dp_size=4, dp_rank=3), group=None) == CPGroup()
    with pytest.raises(CPGroupError, match="size=3 needs the process group"):
        CPGroup.from_topology(topo, group=None)
