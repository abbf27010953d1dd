"""write -> clip (mid-request, mid-row-block) -> shift -> read, against the NumPy reference."""

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfeed.payload import (
    PAYLOAD_FIELDS,
    PayloadField,
    PayloadRoot,
    PayloadWidthError,
    PayloadWriter,
    RaggedRows,
    clip_segments,
    read_field,
    read_fields,
    register_field,
    shift_segments,
)
from tests.payload.common import kept_sets, stored
from tests.payload.reference import (
    dense_fixed,
    dense_ragged,
    padded_ref,
    read_fixed_ref,
    read_ragged_ref,
    row_lists,
    widest_ref,
    window_positions,
)

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def requests(draw):
    """Two requests of one sequence written by two writers (two files), plus a clip and a shift."""
    length = draw(st.integers(1, 400))
    cut = draw(st.integers(0, length))
    experts = draw(st.sampled_from([8, 128, 300]))
    seed = draw(st.integers(0, 2**31))
    lo = draw(st.integers(0, length))
    hi = draw(st.integers(lo, length + 3))
    delta = draw(st.integers(0, 50))
    n_ranges = draw(st.integers(1, 3))
    ranges = []
    for _ in range(n_ranges):
        a = draw(st.integers(0, length + 4))
        ranges.append((a, draw(st.integers(a, length + 6))))
    return length, cut, experts, seed, (lo, hi), delta, ranges


@SETTINGS
@given(requests())
def test_fixed_routing_round_trip(tmp_path, case):
    length, cut, experts, seed, (lo, hi), delta, ranges = case
    rng = np.random.default_rng(seed)
    data = rng.integers(0, experts, (length, 3, 2))
    stored = np.uint8 if experts <= 256 else np.uint16
    # A run with more than 256 experts pins uint16 so every request stores the same dtype.
    dtypes = {"routed_experts": "uint16"} if experts > 256 else None
    segs = []
    for a, b in [(0, cut), (cut, length)]:
        if b > a:
            with PayloadWriter(tmp_path, group="g", dtypes=dtypes) as w:
                segs += w.write({"routed_experts": data[a:b]}, pos=a)
    assert all(s.dtype == np.dtype(stored).name for s in segs)
    segs = shift_segments(clip_segments(segs, lo, hi), delta)
    dense = dense_fixed(length + delta, [(delta + lo, data[lo:hi])], 0, (3, 2), stored)
    got = read_field(segs, "routed_experts", ranges, root=tmp_path)
    assert got.dtype == (torch.uint8 if stored is np.uint8 else torch.uint16)
    np.testing.assert_array_equal(got.numpy(), read_fixed_ref(dense, ranges, 0))


@SETTINGS
@given(requests(), st.sampled_from([0.7, 1.7, 8.0]))
def test_ragged_mask_round_trip(tmp_path, case, mean):
    length, cut, _, seed, (lo, hi), delta, ranges = case
    rng = np.random.default_rng(seed)
    counts = 1 + rng.poisson(mean, length)
    high = int(rng.choice([200, 60_000, 151_936, 1 << 30]))  # 1, 2, 3 and 4-byte ids
    values, sampled = kept_sets(rng, counts, high)
    starts = np.cumsum(counts) - counts
    segs = []
    for a, b in [(0, cut), (cut, length)]:
        if b > a:
            vals = values[starts[a] : starts[a] + counts[a:b].sum()]
            with PayloadWriter(tmp_path, group="g") as w:
                segs += w.write({"sampling_mask": (counts[a:b], vals)}, a, sampled=sampled[a:b])
    segs = shift_segments(clip_segments(segs, lo, hi), delta)
    rows = dense_ragged(length + delta, [(delta, *stored(counts, values))])
    covered = range(delta + lo, delta + min(hi, length))  # the records' live positions
    tokens = rng.integers(0, high, len(window_positions(ranges)))
    labels = {"sampling_mask": tokens}
    got = read_fields(segs, {"sampling_mask": ranges}, root=tmp_path, labels=labels)
    got = got["sampling_mask"]
    offsets, want = read_ragged_ref(rows, ranges, np.int32, covered, lead=1, labels=tokens)
    assert isinstance(got.values, RaggedRows) and got.values.dtype == torch.int32
    assert got.values.equal(RaggedRows(torch.from_numpy(offsets), torch.from_numpy(want)))
    widest = widest_ref(rows, covered, lead=1)
    assert got.widest == widest
    plain = read_field(segs, "sampling_mask", ranges, root=tmp_path)  # label slots at the fill
    fill_offsets, fill_want = read_ragged_ref(rows, ranges, np.int32, covered, lead=1)
    assert plain.equal(RaggedRows(torch.from_numpy(fill_offsets), torch.from_numpy(fill_want)))
    if widest:  # width= pads the same rows, and refuses a width below the records' widest row
        padded = read_fields(
            segs, {"sampling_mask": ranges}, root=tmp_path, width=widest, labels=labels
        )["sampling_mask"]
        assert padded.values.dtype == torch.int32 and padded.widest == widest
        np.testing.assert_array_equal(padded.values.numpy(), padded_ref(offsets, want, widest, -1))
        if widest > 1:
            with pytest.raises(PayloadWidthError):
                read_field(segs, "sampling_mask", ranges, root=tmp_path, width=widest - 1)


def test_kept_sets_are_stored_in_canonical_order_and_their_logprobs_follow(tmp_path):
    """Rows given in any order: the mask is stored without the sampled token, the others
    ascending; the logprobs row holds the sampled token's value first, then the others' in
    ascending id order; a repeated sampled token stands once."""
    rng = np.random.default_rng(3)
    counts = np.array([1, 4, 3])
    ids = np.array([5, 9, 4, 6, 4, 300, 70_000, 2])  # sampled 5; 4 (twice); 2
    lp = np.array([-0.0, -1.9, -0.4, -1.6, -0.4, -2.3, -3.1, -0.2], np.float32)
    weights = rng.random((3, 2, 2)).astype(np.float32)
    with PayloadWriter(tmp_path) as w:
        segs = w.write(
            {
                "sampling_mask": (counts, ids),
                "sampling_mask_logprobs": (counts, lp),
                "routed_expert_weights": weights,
            },
            pos=2,
            sampled=np.array([5, 4, 2]),
        )
    mask = next(s for s in segs if s.field == "sampling_mask")
    assert mask.dtype == "uint24" and mask.ragged.values == 4  # 6, 9 | 300, 70000
    got = read_field(segs, "sampling_mask", (0, 6), root=tmp_path)
    assert got.dtype == torch.int32
    assert row_lists(got) == [[], [], [-1], [-1, 6, 9], [-1, 300, 70_000], []]
    got = read_field(segs, "sampling_mask_logprobs", (0, 6), root=tmp_path)
    assert got.dtype == torch.float32 and got.offsets.tolist() == [0, 0, 0, 1, 4, 7, 7]
    want = np.array([-0.0, -0.4, -1.6, -1.9, -0.2, -2.3, -3.1], np.float32)
    np.testing.assert_array_equal(got.values.numpy(), want)
    assert np.signbit(got.values.numpy()[0])  # the sampled token's -0.0 as given
    w_got = read_field(segs, "routed_expert_weights", (1, 4), root=tmp_path)
    assert w_got.dtype == torch.float32
    np.testing.assert_array_equal(
        w_got.numpy(), np.concatenate([np.zeros((1, 2, 2), np.float32), weights[:2]])
    )


def test_registered_fields_round_trip_without_other_changes(tmp_path):
    table = dict(PAYLOAD_FIELDS)
    register_field(
        "token_entropy_topk", PayloadField(fill=0.5, window="sequence", ragged=True), fields=table
    )
    register_field("tool_call_id", PayloadField(fill=-7, window="inputs"), fields=table)
    counts = np.array([2, 1])
    vals = np.array([0.25, 1.5, -3.0], np.float32)
    ids = np.array([[3], [-2], [1000]])
    with PayloadWriter(tmp_path, fields=table) as w:
        segs = w.write(
            {"token_entropy_topk": (counts, vals), "tool_call_id": ids},
            pos={"token_entropy_topk": 1, "tool_call_id": 0},
        )
    rag = read_field(segs, "token_entropy_topk", (0, 4), root=tmp_path, fields=table)
    assert rag.dtype == torch.float32 and row_lists(rag) == [[], [0.25, 1.5], [-3.0], []]
    padded = read_field(segs, "token_entropy_topk", (0, 4), root=tmp_path, fields=table, width=3)
    want = [[0.5] * 3, [0.25, 1.5, 0.5], [-3.0, 0.5, 0.5], [0.5] * 3]  # the field's own fill
    np.testing.assert_array_equal(padded.numpy(), np.array(want, np.float32))
    fixed = read_field(segs, "tool_call_id", (0, 4), root=tmp_path, fields=table)
    assert fixed.dtype == torch.int16  # smallest dtype holding -7 .. 1000
    np.testing.assert_array_equal(fixed.numpy()[:, 0], [3, -2, 1000, -7])


def test_register_field_refuses_a_conflicting_definition():
    table = dict(PAYLOAD_FIELDS)
    register_field("sampling_mask", PAYLOAD_FIELDS["sampling_mask"], fields=table)  # same: no-op
    with pytest.raises(ValueError, match="already registered"):
        register_field("sampling_mask", PayloadField(fill=0, window="labels"), fields=table)
    with pytest.raises(ValueError, match="window"):
        PayloadField(fill=0, window="outputs")


def test_absent_field_is_none_and_placeholders_read_as_empty_rows(tmp_path):
    with PayloadWriter(tmp_path) as w:
        segs = w.write(
            {"sampling_mask": (np.array([2, 1]), np.array([5, 6, 7]))}, 3, sampled=np.array([6, 7])
        )
    assert read_field(segs, "routed_experts", (0, 4), root=tmp_path) is None
    placeholder = clip_segments(segs, 0, 3)
    assert placeholder[0].rows == 0
    got = read_fields(placeholder, {"sampling_mask": (0, 4)}, root=tmp_path)["sampling_mask"]
    assert got.values.dtype == torch.int32 and got.values.offsets.tolist() == [0] * 5
    assert got.values.nnz == 0 and got.widest == 0 and not got.coverage.any()
    fixed = read_field(placeholder, "sampling_mask", (0, 4), root=tmp_path, width=2)
    assert torch.equal(fixed, torch.full((4, 2), -1, dtype=torch.int32))


def test_width_is_taken_over_all_segment_rows_not_the_window(tmp_path):
    with PayloadWriter(tmp_path) as w:
        segs = w.write(
            {"sampling_mask": (np.array([1, 5, 1]), np.arange(7))},
            pos=0,
            sampled=np.array([0, 1, 6]),
        )
    # rows [0], [1, 2, 3, 4, 5], [6]: stored without their sampled token, read after its slot
    narrow = read_fields(segs, {"sampling_mask": (2, 3)}, root=tmp_path)["sampling_mask"]
    assert row_lists(narrow.values) == [[-1]]  # the window's row: its label slot only
    assert narrow.widest == 5  # the records' widest row (label slot + 4), outside the window
    wide = read_fields(segs, {"sampling_mask": (1, 2)}, root=tmp_path)["sampling_mask"]
    assert row_lists(wide.values) == [[-1, 2, 3, 4, 5]] and wide.widest == 5
    fixed = read_field(segs, "sampling_mask", (2, 3), root=tmp_path, width=8)
    assert fixed.tolist() == [[-1] * 8]
    assert read_field(segs, "sampling_mask", (2, 3), root=tmp_path, width=5).shape == (1, 5)
    with pytest.raises(PayloadWidthError) as err:  # the window's row fits; row 1 does not
        read_field(segs, "sampling_mask", (2, 3), root=tmp_path, width=4)
    assert err.value.pos == 1 and err.value.file == segs[0].file


def test_mixed_integer_widths_widen_losslessly(tmp_path):
    with PayloadWriter(tmp_path) as w:
        a = w.write({"routed_experts": np.array([[1, 2]])}, pos=0)
        b = w.write({"routed_experts": np.array([[300, 4]])}, pos=1)
    got = read_field(a + b, "routed_experts", (0, 3), root=tmp_path)
    assert got.dtype == torch.uint16 and got.tolist() == [[1, 2], [300, 4], [0, 0]]


def test_root_pickles_without_open_files_and_reads_after_fork(tmp_path):
    root = PayloadRoot(tmp_path)
    with PayloadWriter(root) as w:
        segs = w.write({"routed_experts": np.arange(6).reshape(3, 2)}, pos=0)
    first = read_field(segs, "routed_experts", (0, 3), root=root)
    clone = pickle.loads(pickle.dumps(root))
    assert clone.store._state is None and clone.path == root.path
    ctx = torch.multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        again = pool.apply(read_field, (segs, "routed_experts", (0, 3)), {"root": root})
    assert torch.equal(first, again)


def test_zero_row_fixed_region_round_trips_as_fill(tmp_path):
    with PayloadWriter(tmp_path) as w:
        segs = w.write({"routed_experts": np.zeros((0, 3, 2), np.int64)}, pos=4)
    assert segs[0].rows == 0 and segs[0].shape == (3, 2)
    got = read_field(segs, "routed_experts", (0, 2), root=tmp_path)
    assert got.shape == (2, 3, 2) and not got.any()
