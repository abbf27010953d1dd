"""Every kind of bad input or bad bytes surfaces as its typed PayloadError, naming the place."""

import os

import numpy as np
import pytest

from rollfeed.payload import (
    PayloadDtypeError,
    PayloadError,
    PayloadHeaderError,
    PayloadIndexError,
    PayloadInputError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadRegionError,
    PayloadRoot,
    PayloadSegmentError,
    PayloadTruncatedError,
    PayloadWidthError,
    PayloadWriter,
    UnknownFieldError,
    read_field,
)
from rollfeed.payload.format.layout import REGION_HEADER, REGION_HEADER_V1, file_header


def fast_root(path) -> PayloadRoot:
    return PayloadRoot(path, retries=2, backoff_s=0.001)


@pytest.fixture
def written(tmp_path):
    with PayloadWriter(tmp_path, group="step_000001") as w:
        segs = w.write(
            {
                "routed_experts": np.ones((4, 2), np.int64),
                "sampling_mask": (np.array([2, 4, 1, 3]), np.arange(10)),
            },
            pos=0,
            sampled=np.array([0, 2, 6, 7]),  # stored: [1] [3 4 5] [] [8 9]
        )
    return tmp_path, {s.field: s for s in segs}


def test_missing_file_after_retries(written):
    root, segs = written
    seg = segs["routed_experts"].model_copy(update={"file": "step_000001/gone.rfp"})
    with pytest.raises(PayloadMissingFileError) as info:
        read_field([seg], "routed_experts", (0, 4), root=fast_root(root))
    assert info.value.file == "step_000001/gone.rfp" and info.value.field == "routed_experts"
    assert "gone.rfp" in str(info.value)


def test_file_shorter_than_segment(written):
    root, segs = written
    seg = segs["routed_experts"].model_copy(
        update={"rows": 400, "offset": segs["routed_experts"].offset}
    )
    size = os.path.getsize(os.path.join(root, seg.file))
    with pytest.raises(PayloadTruncatedError, match=f"the file has {size} bytes") as info:
        read_field([seg], "routed_experts", (0, 400), root=fast_root(root))
    assert info.value.offset is not None and "routed_experts" in str(info.value)


def test_unknown_magic_and_version(tmp_path):
    (tmp_path / "junk.rfp").write_bytes(b"not a payload file at all")
    head = bytearray(file_header(1))
    head[8] = 99  # version 99
    (tmp_path / "future.rfp").write_bytes(bytes(head) + bytes(64))
    seg = dict(field="routed_experts", offset=16, pos=0, rows=1, dtype="uint8", shape=(2,))
    from rollfeed.payload import PayloadSegment

    with pytest.raises(PayloadHeaderError, match="bad magic"):
        read_field(
            [PayloadSegment(file="junk.rfp", **seg)], "routed_experts", (0, 1), root=tmp_path
        )
    with pytest.raises(PayloadHeaderError, match="version 99"):
        read_field(
            [PayloadSegment(file="future.rfp", **seg)], "routed_experts", (0, 1), root=tmp_path
        )


def test_csr_index_not_monotonic(written):
    root, segs = written
    seg = segs["sampling_mask"]
    path = os.path.join(root, seg.file)
    with open(path, "r+b") as f:  # block 0's value offset: 0 -> 5 (past the lengths' sum)
        f.seek(seg.offset)
        f.write((5).to_bytes(8, "little"))
    with pytest.raises(PayloadIndexError, match="not monotonic or points outside") as info:
        read_field([seg], "sampling_mask", (0, 4), root=root)
    assert info.value.file == seg.file and info.value.pos == 0


def test_csr_layout_disagreeing_with_its_region_header(written):
    root, segs = written
    seg = segs["sampling_mask"]
    lying = seg.model_copy(update={"ragged": seg.ragged.model_copy(update={"values": 3})})
    with pytest.raises(PayloadRegionError, match="header says region values 6") as info:
        read_field([lying], "sampling_mask", (0, 4), root=root)
    assert info.value.file == seg.file and info.value.pos == 0


def test_dtype_kind_disagrees_with_field(written):
    root, segs = written
    seg = segs["routed_experts"].model_copy(update={"dtype": "float32"})
    with pytest.raises(PayloadDtypeError, match="disagrees with the field's int fill"):
        read_field([seg], "routed_experts", (0, 4), root=root)


def test_segments_disagree_in_shape_or_float_dtype(written):
    root, segs = written
    a = segs["routed_experts"]
    b = a.model_copy(update={"pos": 10, "shape": (1,), "rows": 8})
    with pytest.raises(PayloadDtypeError, match="row shape"):
        read_field([a, b], "routed_experts", (0, 4), root=root)
    with PayloadWriter(root) as w:
        f32 = w.write({"routed_expert_weights": np.ones((2, 2), np.float32)}, pos=0)
        f16 = w.write({"routed_expert_weights": np.ones((2, 2), np.float16)}, pos=2)
    with pytest.raises(PayloadDtypeError, match="disagree on dtype"):
        read_field(f32 + f16, "routed_expert_weights", (0, 4), root=root)


def test_row_wider_than_width(written):
    root, segs = written
    with pytest.raises(PayloadWidthError, match=r"holds 4 values .*, wider than width=3") as info:
        read_field([segs["sampling_mask"]], "sampling_mask", (3, 4), root=root, width=3)
    assert info.value.pos == 1  # the widest row's position, even outside the window


@pytest.mark.parametrize(
    "update", [{"rows": -1}, {"offset": -5}, {"pos": -2}, {"first": -1}, {"rows": 10**20}]
)
def test_negative_or_absurd_extents(written, update):
    root, segs = written
    with pytest.raises(PayloadSegmentError):
        read_field(
            [segs["routed_experts"].model_copy(update=update)], "routed_experts", (0, 4), root=root
        )


def test_overlapping_segments(written):
    root, segs = written
    shifted = segs["routed_experts"].model_copy(update={"pos": 2})
    with pytest.raises(PayloadSegmentError, match="overlap"):
        read_field([segs["routed_experts"], shifted], "routed_experts", (0, 6), root=root)


@pytest.mark.parametrize("bad", ["../outside.rfp", "/etc/passwd", "step_000001/../../x.rfp"])
def test_handles_outside_the_root(written, bad):
    root, segs = written
    with pytest.raises(PayloadPathError):
        read_field(
            [segs["routed_experts"].model_copy(update={"file": bad})],
            "routed_experts",
            (0, 4),
            root=root,
        )


def test_symlink_escape(written, tmp_path_factory):
    root, segs = written
    outside = tmp_path_factory.mktemp("outside")
    real = os.path.join(root, segs["routed_experts"].file)
    os.rename(real, outside / "f.rfp")
    os.symlink(outside / "f.rfp", real)
    with pytest.raises(PayloadPathError, match="symlink"):
        read_field([segs["routed_experts"]], "routed_experts", (0, 4), root=root)


def test_unknown_field(written):
    root, segs = written
    with pytest.raises(UnknownFieldError, match="known:"):
        read_field(list(segs.values()), "router_logits", (0, 4), root=root)
    with PayloadWriter(root) as w, pytest.raises(UnknownFieldError):
        w.write({"router_logits": np.zeros((2, 2))}, pos=0)


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"sampling_mask": (np.array([2, 1]), np.arange(2))}, "sum\\(counts\\)=3"),
        ({"sampling_mask": (np.array([2, -1]), np.arange(1))}, "counts must be >= 0"),
        ({"routed_experts": np.ones((2, 2), np.float32)}, "holds integer values"),
        ({"routed_expert_weights": np.ones((2, 2), np.int64)}, "holds float values"),
        ({"sampling_mask": np.ones((2, 2), np.int64)}, "needs a \\(counts, values\\) pair"),
        ({"sampling_mask": (np.array([2, 1]), np.arange(3))}, "without its sampled token 5"),
        ({"sampling_mask": (np.array([2, 0]), np.arange(2))}, "row 1 .* holds ids \\[\\]"),
        (
            {"sampling_mask_logprobs": (np.array([1, 1]), np.zeros(2, np.float32))},
            "one label='omitted' field written in the same call",
        ),
    ],
)
def test_bad_writer_input(tmp_path, arrays, match):
    with PayloadWriter(tmp_path) as w, pytest.raises(PayloadInputError, match=match) as info:
        w.write(arrays, pos=0, sampled=np.array([0, 5]))
    assert info.value.field == next(iter(arrays))


def test_kept_sets_need_their_sampled_tokens(tmp_path):
    mask = (np.array([1]), np.array([4]))
    with PayloadWriter(tmp_path) as w, pytest.raises(PayloadInputError, match="pass sampled="):
        w.write({"sampling_mask": mask}, pos=0)
    with PayloadWriter(tmp_path) as w, pytest.raises(PayloadInputError, match="sampled must be"):
        w.write({"sampling_mask": mask}, pos=0, sampled=np.array([4, 4]))


def test_writer_refuses_a_taken_name_and_a_closed_writer(tmp_path):
    with PayloadWriter(tmp_path, name="same") as w:
        w.write({"routed_experts": np.ones((1, 1), np.int64)}, pos=0)
    with (
        PayloadWriter(tmp_path, name="same") as w2,
        pytest.raises(PayloadPathError, match="already exists"),
    ):
        w2.write({"routed_experts": np.ones((1, 1), np.int64)}, pos=0)
    with pytest.raises(ValueError, match="closed"):
        w.write({"routed_experts": np.ones((1, 1), np.int64)}, pos=0)


def test_errors_survive_pickling_with_their_place():
    import pickle

    err = PayloadTruncatedError("short read", file="a.rfp", field="sampling_mask", offset=12, pos=3)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is PayloadTruncatedError and str(again) == str(err)
    assert (again.file, again.field, again.offset, again.pos) == ("a.rfp", "sampling_mask", 12, 3)
    assert isinstance(again, PayloadError) and isinstance(again, ValueError)


def test_region_header_size_is_stable():
    assert REGION_HEADER.size == 64 and REGION_HEADER_V1.size == 40
