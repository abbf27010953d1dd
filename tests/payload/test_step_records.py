"""Step record files: the bytes are the documented layout (built here from the docs, section by
section), every encoding round-trips at its dtype, the step of the design (128 x 8,192 tokens,
vocabulary 151,936) costs at most 10 bytes per token, claims no record could hold are refused
before anything is allocated, and a writer puts the file under its name whole or not at all."""

from __future__ import annotations

import os
import struct

import crc32c
import numpy as np
import pytest

from rollfeed.payload import (
    PayloadInputError,
    PayloadRoot,
    PayloadSegment,
    RaggedLayout,
    StepRecord,
    StepRecordError,
    StepRecordFile,
    StepRecordWriter,
)
from rollfeed.payload.format.step_layout import group_hash
from rollfeed.payload.format.step_record_codec import decode_record, encode_record


def _pad(b: bytes) -> bytes:
    return b + bytes(-len(b) % 8)


def _doc_record() -> StepRecord:
    ids = np.array([5, 6, 7])
    return StepRecord(ids=ids, mask=ids > 5, columns={"advantages": np.full(3, 0.5, np.float32)})


def test_a_record_is_the_documented_bytes():
    """The worked example of the codec's module doc, built from its layout."""
    head = struct.pack("<4sBBHHHIQII", b"RREC", 0, 0, 1, 0, 0, 0, 3, 1, 10)
    ids = _pad(bytes([5, 6, 7]))
    runs = struct.pack("<II", 1, 3)
    column = struct.pack("<IHBBBBxxQQ4Ixxxx", 0, 10, 1, 10, 10, 0, 3, 4, 0, 0, 0, 0)
    strings = _pad(b"advantages")
    data = _pad(struct.pack("<f", 0.5))
    want = head + ids + runs + column + strings + data
    assert len(want) == 120
    assert encode_record(_doc_record()) == want


def test_a_file_is_the_documented_layout(tmp_path):
    root = PayloadRoot(tmp_path)
    with StepRecordWriter(root, "step_000000.rfs") as w:
        w.append(_doc_record())
        ids = np.array([8, 9, 1, 2, 3])
        mask = np.array([1, 1, 0, 1, 1], bool)
        spans = np.array([[1, 3]])
        w.append(
            StepRecord(
                ids=ids, mask=mask, spans=spans, group="p0", shared_prefix=2, policy_version=7
            )
        )
    data = (tmp_path / "step_000000.rfs").read_bytes()
    magic, version, flags, reserved, file_id, zero = struct.unpack("<8sHHIQQ", data[:32])
    assert (magic, version, flags, reserved, zero) == (b"RFSTEPS\0", 1, 0, 0, 0)
    rec0, rec1 = encode_record(_doc_record()), data[152:]
    assert data[32:152] == rec0
    size1 = struct.unpack("<Q", data[-48:-40])[0] - 152  # the footer's index offset
    rec1 = data[152 : 152 + size1]
    rows = struct.pack("<QQQIIIIqQQ", 32, 120, 3, crc32c.crc32c(rec0), 1, 0, 0, -1, 0, 0)
    rows += struct.pack(
        "<QQQIIIIqQQ", 152, size1, 5, crc32c.crc32c(rec1), 2, 1, 0, 7, group_hash("p0"), 2
    )
    index = rows + struct.pack("<6I", 1, 3, 0, 2, 3, 5) + struct.pack("<2I", 1, 3)
    at = 152 + size1
    assert data[at : at + len(index)] == index
    head = struct.pack("<QQQQI", at, len(index), 2, file_id, crc32c.crc32c(index))
    footer = head + struct.pack("<I8s", crc32c.crc32c(head), b"RFSTEND\0")
    assert data[at + len(index) :] == footer and len(data) == at + len(index) + 48


def _segments() -> list[PayloadSegment]:
    layout = RaggedLayout(rows=9, values=20, count_bytes=1, block_rows=128)
    return [
        PayloadSegment(
            field="routed_experts",
            file="g/a.rfp",
            offset=64,
            pos=0,
            rows=4,
            dtype="uint8",
            shape=(2, 3),
            file_id=5,
        ),
        PayloadSegment(
            field="sampling_mask",
            file="g/b.rfp",
            offset=640,
            pos=2,
            rows=3,
            dtype="int32",
            first=4,
            ragged=layout,
        ),
    ]


@pytest.mark.parametrize("T", [1, 7, 1000])
def test_every_encoding_round_trips_at_its_dtype(tmp_path, T):
    rng = np.random.default_rng(T)
    columns = {
        "f32": rng.random(T).astype(np.float32),
        "f16 const": np.full(T, -1.5, np.float16),
        "f64 grid": rng.random((T, 2, 3)),
        "i64 small": rng.integers(-3, 3, T),
        "i64 wide": rng.integers(-(2**40), 2**40, T),
        "u16": rng.integers(0, 60_000, T).astype(np.uint16),
        "i8 const": np.full(T, -7, np.int8),
        "mask runs": np.arange(T) > T // 2,
        "mask bits": rng.random(T) > 0.5,
        "mask const": np.ones(T, bool),
        "not per token": rng.integers(0, 5, T + 3),
        "empty": np.zeros((0, 4), np.float32),
    }
    record = StepRecord(
        ids=rng.integers(0, 151_936, T),
        mask=rng.random(T) > 0.3,
        columns=columns,
        texts={"uid": "ünï", "note": ""},
        segments=_segments(),
        spans=np.array([[0, 1], [1, T]] if T > 1 else [[0, 1]]),  # touching, as images may
        group="prompt 17",
        shared_prefix=min(T, 5),
        policy_version=3,
    )
    with StepRecordWriter(PayloadRoot(tmp_path), "s.rfs") as w:
        w.append(record)
        w.append(StepRecord(ids=np.array([2**63 - 1]), mask=np.zeros(1, bool)))
    with StepRecordFile(PayloadRoot(tmp_path), "s.rfs") as f:
        index = f.index()
        got, big = f.read(index, 0), f.read(index, 1)
    assert big.ids.tolist() == [2**63 - 1] and big.group is None and big.policy_version is None
    assert np.array_equal(got.ids, record.ids) and got.ids.dtype == np.int64
    assert np.array_equal(got.mask, record.mask)
    for name, values in columns.items():
        assert got.columns[name].dtype == values.dtype, name
        assert got.columns[name].shape == values.shape, name
        assert np.array_equal(got.columns[name], values), name
    assert dict(got.texts) == {"uid": "ünï", "note": ""}
    assert list(got.segments) == _segments()
    assert np.array_equal(got.spans, record.spans) and index.span_counts.tolist() == [
        len(record.spans),
        0,
    ]
    assert (got.group, got.shared_prefix, got.policy_version) == ("prompt 17", min(T, 5), 3)
    assert index.tokens.tolist() == [T, 1] and index.policy_version.tolist() == [3, -1]


def _design_step(rng, per_token_advantages: bool) -> list[StepRecord]:
    out = []
    for _ in range(4):  # 4 of the 128 samples: the cost per token is the same
        T = 1024 + 7168
        adv = rng.standard_normal(T) if per_token_advantages else np.full(T, rng.standard_normal())
        out.append(
            StepRecord(
                ids=rng.integers(0, 151_936, T),
                mask=np.arange(T) >= 1024,
                columns={
                    "advantages": adv.astype(np.float32),
                    "inference_logprobs": -rng.random(T, dtype=np.float32),
                },
            )
        )
    return out


@pytest.mark.parametrize("per_token", [False, True])
def test_the_design_step_costs_its_arrays_bytes(tmp_path, per_token):
    """Token ids as uint32 (vocabulary 151,936), float32 logprobs, the loss mask as one run, one
    advantage per sample: 8 bytes per token and a few dozen per sample; per-token advantages
    add their 4."""
    records = _design_step(np.random.default_rng(1), per_token)
    with StepRecordWriter(PayloadRoot(tmp_path), "s.rfs", id_dtype="uint32") as w:
        for r in records:
            w.append(r)
    per_token_bytes = (tmp_path / "s.rfs").stat().st_size / sum(len(r) for r in records)
    floor = 12.0 if per_token else 8.0
    assert floor < per_token_bytes < floor + 0.05, per_token_bytes


def _expanded(record: bytes, at: int, value: int) -> bytes:
    """``record`` with its first column's ``rows`` (u64 at descriptor offset 16) set."""
    return record[:at] + struct.pack("<Q", value) + record[at + 8 :]


def test_claims_no_record_can_hold_are_refused_before_allocation():
    record = encode_record(_doc_record())
    spans = np.array([[1, 3]])
    rows_at = 32 + 8 + 8 + 12  # header, ids, runs; then the descriptor's rows (at 12)
    for rows in (4, 2**40, 2**63):
        with pytest.raises(ValueError, match="does not claim its"):
            decode_record(_expanded(record, rows_at, rows), 3, spans)
    wide = encode_record(
        StepRecord(
            ids=np.arange(3),
            mask=np.ones(3, bool),
            columns={f"c{k}": np.full(3, k, np.float64) for k in range(40)},
        )
    )
    decode_record(wide, 3, np.array([[0, 3]]))  # 40 one-value columns: within 64x its bytes
    with pytest.raises(ValueError, match="header is not its index row's"):
        decode_record(record, 4, spans)
    with pytest.raises(ValueError, match="mask runs"):
        decode_record(record, 3, np.array([[0, 3]]))
    with pytest.raises(ValueError, match="run past the record's 112"):
        decode_record(record[:-8], 3, spans)
    with pytest.raises(ValueError, match="do not fit its 40 bytes"):
        decode_record(record[:40], 3, spans)


def test_string_places_whose_sum_wraps_in_32_bits_are_refused():
    """A text at offset 2**32 - 1 of length 2 ends at 1 in 32-bit arithmetic: it was read as an
    empty string."""
    record = bytearray(
        encode_record(StepRecord(ids=np.arange(2), mask=np.ones(2, bool), texts={"uid": "a"}))
    )
    text_at = 32 + 8 + 8  # header, ids, runs; no column
    struct.pack_into("<II", record, text_at + 8, 2**32 - 1, 2)
    with pytest.raises(ValueError, match="past the 4 string bytes"):
        decode_record(bytes(record), 2, np.array([[0, 2]]))


def test_bad_records_are_refused_at_write_naming_what():
    many = {f"c{k}": np.zeros(10_000) for k in range(300)}  # 24 MB from 28 KB of bytes
    with pytest.raises(PayloadInputError, match="more than 64 times"):
        encode_record(
            StepRecord(ids=np.zeros(10_000, int), mask=np.ones(10_000, bool), columns=many)
        )
    with pytest.raises(PayloadInputError, match="bool mask"):
        encode_record(StepRecord(ids=np.arange(3), mask=np.ones(3)))
    with pytest.raises(PayloadInputError, match="negative"):
        encode_record(StepRecord(ids=np.array([1, -2]), mask=np.ones(2, bool)))
    with pytest.raises(PayloadInputError, match="does not fit"):
        encode_record(StepRecord(ids=np.array([70_000]), mask=np.ones(1, bool)), id_dtype="uint16")
    with pytest.raises(PayloadInputError, match="one of"):
        encode_record(
            StepRecord(ids=np.arange(2), mask=np.ones(2, bool), columns={"s": np.array(["a", "b"])})
        )


def test_a_writer_puts_its_file_whole_or_leaves_the_old_one(tmp_path):
    root = PayloadRoot(tmp_path)
    with StepRecordWriter(root, "s.rfs") as w:
        w.append(_doc_record())
    before = (tmp_path / "s.rfs").read_bytes()
    with pytest.raises(RuntimeError), StepRecordWriter(root, "s.rfs") as w:
        w.append(_doc_record())
        w.append(_doc_record())
        assert len(os.listdir(tmp_path)) == 2  # the name and the file written aside
        raise RuntimeError("the orchestrator fails midway")
    assert os.listdir(tmp_path) == ["s.rfs"] and (tmp_path / "s.rfs").read_bytes() == before
    with pytest.raises(PayloadInputError, match="closed"):
        w.append(_doc_record())
    a, b = StepRecordWriter(root, "s.rfs"), StepRecordWriter(root, "s.rfs")
    for k in range(3):  # two writers of one name, interleaved: each writes its own file aside
        a.append(_doc_record())
        if k < 2:
            b.append(_doc_record())
    b.close()
    a.close()
    with StepRecordFile(root, "s.rfs") as f:
        assert len(f.index()) == 3  # the last to close, whole
    assert os.listdir(tmp_path) == ["s.rfs"]


def test_a_file_shorter_than_its_footer_or_not_a_step_file_is_named(tmp_path):
    root = PayloadRoot(tmp_path)
    for name, data in [("empty.rfs", b""), ("text.rfs", b"x" * 100), ("short.rfs", b"\0" * 79)]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(StepRecordError) as err, StepRecordFile(root, name) as f:
            f.index()
        assert err.value.file == name
