import numpy as np
import pytest

from rollfeed.payload import (
    PayloadRoot,
    PayloadSegment,
    PayloadSegmentError,
    PayloadWriter,
    RaggedLayout,
    clip_segments,
    read_field,
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


ODD = [1.5, 2.0, True, "4", None, np.float64(4.0)]


@pytest.mark.parametrize("value", ODD, ids=repr)
@pytest.mark.parametrize("attr", ["pos", "rows", "offset", "first", "file_id"])
def test_a_copy_with_a_non_integer_is_refused_like_a_parsed_record(attr, value):
    if attr == "file_id" and value is None:  # None is a file id's own "absent"
        return
    with pytest.raises(PayloadSegmentError, match="malformed"):
        mask_segment(file_id=7).model_copy(update={attr: value})


@pytest.mark.parametrize("value", [128.0, True, "128"], ids=repr)
def test_a_ragged_layout_copy_with_a_non_integer_is_refused(value):
    with pytest.raises(PayloadSegmentError, match="malformed"):
        LAYOUT.model_copy(update={"block_rows": value})
    with pytest.raises(PayloadSegmentError, match="malformed"):
        mask_segment().model_copy(update={"ragged": {**LAYOUT.model_dump(), "rows": value}})


@pytest.mark.parametrize("bad", [0.5, 8.5, 3.0, True, "2", np.float32(1)], ids=repr)
def test_clip_and_shift_refuse_non_integer_positions(bad):
    with pytest.raises(PayloadSegmentError, match="must be an integer"):
        clip_segments([mask_segment()], 0, bad)
    with pytest.raises(PayloadSegmentError, match="must be an integer"):
        clip_segments([mask_segment()], bad, 20)
    with pytest.raises(PayloadSegmentError, match="must be an integer"):
        shift_segments([mask_segment()], bad)


def test_integer_copies_clips_and_shifts_stay_plain_ints():
    clipped = clip_segments([mask_segment()], np.int64(5), np.int32(8))
    (moved,) = shift_segments(clipped, np.int64(3))
    assert (moved.pos, moved.rows, moved.first) == (8, 3, 1)
    assert {type(moved.pos), type(moved.rows), type(moved.first)} == {int}
    assert mask_segment().model_copy(update={"pos": 9}).pos == 9


def test_record_without_a_file_id_is_refused_for_a_file_that_has_one(tmp_path):
    root = PayloadRoot(tmp_path, retries=0)
    rows = np.arange(12, dtype=np.int64).reshape(6, 2) % 5
    with PayloadWriter(root, group="g", name="w") as w:
        (seg,) = w.write({"routed_experts": rows}, pos=0)
    bare = PayloadSegment.from_json(seg.model_dump_json().replace(str(seg.file_id), "null"))
    assert bare.file_id is None  # schema-valid
    with pytest.raises(PayloadSegmentError, match="carries no file id") as err:
        read_field([bare], "routed_experts", (0, 6), root=root)
    assert err.value.file == seg.file and err.value.field == "routed_experts"
    root.prune("g")  # the same name written again: other rows, another file id
    with PayloadWriter(root, group="g", name="w") as w:
        w.write({"routed_experts": rows + 1}, pos=0)
    for check in (False, True):
        again = PayloadRoot(tmp_path, retries=0, verify_checksums=check)
        with pytest.raises(PayloadSegmentError, match="carries no file id"):
            read_field([bare], "routed_experts", (0, 6), root=again)


def test_a_record_made_past_validation_with_a_float_is_refused_by_the_reader(tmp_path):
    root = PayloadRoot(tmp_path, retries=0)
    with PayloadWriter(root, group="g", name="w") as w:
        (seg,) = w.write({"routed_experts": np.ones((6, 2), np.int64)}, pos=0)
    for attr, value in (("pos", 1.5), ("first", 1.0), ("rows", 5.5)):
        forged = PayloadSegment.model_construct(**{**seg.__dict__, attr: value})
        with pytest.raises(PayloadSegmentError, match="malformed") as err:
            read_field([forged], "routed_experts", (0, 6), root=root)
        assert err.value.field == "routed_experts"
