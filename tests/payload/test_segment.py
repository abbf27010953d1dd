import pytest

from rollfeed.payload import (
    PayloadSegment,
    PayloadSegmentError,
    RaggedLayout,
    clip_segments,
    shift_segments,
)

LAYOUT = RaggedLayout(rows=6, values=11, count_bytes=1, block_rows=128)


def mask_segment(**kw) -> PayloadSegment:
    base = dict(field="sampling_mask", file="s/w.rfp", offset=56, pos=4, rows=6, dtype="int32")
    return PayloadSegment(**{**base, "ragged": LAYOUT, **kw})


def test_json_round_trip_keeps_every_attribute():
    seg = mask_segment(first=2)
    again = PayloadSegment.from_json(seg.model_dump_json())
    assert again == seg and again.ragged == LAYOUT and again.first == 2
    fixed = PayloadSegment(
        field="routed_experts", file="a.rfp", offset=16, pos=0, rows=3, dtype="uint8", shape=(2, 8)
    )
    assert PayloadSegment.from_json(fixed.model_dump_json()).shape == (2, 8)


def test_malformed_record_is_a_typed_error():
    with pytest.raises(PayloadSegmentError, match="malformed"):
        PayloadSegment.from_json('{"field": "x", "file": 3}')


def test_segments_are_frozen():
    with pytest.raises(Exception, match="frozen"):
        mask_segment().rows = 3


@pytest.mark.parametrize(
    ("lo", "hi", "pos", "rows", "first"),
    [
        (0, 8, 4, 4, 0),  # tail cut (truncation)
        (6, 20, 6, 4, 2),  # head cut mid-request
        (5, 7, 5, 2, 1),  # both
        (0, 100, 4, 6, 0),  # untouched
        (12, 20, 12, 0, 0),  # beyond: placeholder clamped to lo
        (0, 3, 3, 0, 0),  # before: placeholder clamped to hi
    ],
)
def test_clip(lo, hi, pos, rows, first):
    (out,) = clip_segments([mask_segment()], lo, hi)
    assert (out.pos, out.rows, out.first) == (pos, rows, first)
    assert out.offset == 56 and out.ragged == LAYOUT  # metadata only: no widths, no I/O


def test_clip_twice_composes_and_shift_moves_positions():
    (once,) = clip_segments(clip_segments([mask_segment()], 5, 20), 0, 8)
    assert (once.pos, once.rows, once.first) == (5, 3, 1)
    (moved,) = shift_segments([once], 100)
    assert (moved.pos, moved.rows, moved.first) == (105, 3, 1)


def test_clip_refuses_inverted_range():
    with pytest.raises(ValueError, match="lo <= hi"):
        clip_segments([mask_segment()], 5, 4)
