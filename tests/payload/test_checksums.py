"""Checksums per block: a flipped byte inside what a checking read covers is named by that read
and by ``verify``; a flipped byte outside it is not seen by the read (it checks only the blocks
it reads) but is by ``verify``."""

import pickle

import numpy as np
import pytest

from rollfeed.cli import main
from rollfeed.payload import (
    PayloadChecksumError,
    PayloadRoot,
    PayloadWriter,
    read_field,
    read_fields,
)
from rollfeed.payload.format.checksum import crc, fixed_block_rows, ragged_table, table_entries
from rollfeed.payload.format.layout import BLOCK_ROWS, DTYPE_SIZES, ragged_bytes, values_start
from tests.payload.common import GROUP, kept_sets, same_read, stored

ROWS = 600  # several checksum blocks per region: 170 routing rows, 128 mask rows each
SHAPE = (48, 8)  # 384-byte routing rows -> blocks of 65536 // 384 = 170 rows


def write(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(2, 5, ROWS)
    ids, sampled = kept_sets(rng, counts)
    arrays = {
        "routed_experts": rng.integers(0, 200, (ROWS, *SHAPE)),
        "sampling_mask": (counts, ids),
    }
    with PayloadWriter(tmp_path, group=GROUP, name="w0") as w:
        segs = w.write(arrays, pos=0, sampled=sampled)
    return {s.field: s for s in segs}, arrays


def flip(tmp_path, at: int) -> None:
    path = tmp_path / GROUP / "w0.rfp"
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x04
    path.write_bytes(bytes(raw))


def checking(tmp_path) -> PayloadRoot:
    return PayloadRoot(tmp_path, retries=0, verify_checksums=True)


def verify_finding(tmp_path, capsys) -> str:
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    return next(x for x in out.splitlines() if x.startswith("BAD "))


def mask_value_byte(seg, value: int) -> int:
    lay = seg.ragged
    start = values_start(lay.rows, lay.count_bytes, lay.block_rows)
    return seg.offset + start + DTYPE_SIZES[seg.dtype] * value


def test_checksum_blocks_follow_the_layout_worked_example():
    counts, values = np.array([2, 0, 1]), np.array([7, 9, 4])
    body, cb = ragged_bytes(counts, values, dtype="uint8", block_rows=2)
    table = np.frombuffer(ragged_table(b"head", memoryview(body), counts, cb, 2, 1), "<u4")
    assert len(body) == 23
    assert (
        table.tolist()
        == [
            crc(b"head"),
            crc(body[0:10]),  # index block 0
            crc(body[20:22]),  # values of rows 0, 1
            crc(body[10:20]),  # index block 1 and the padding
            crc(body[22:23]),  # values of row 2
        ]
    )
    assert table_entries(True, 3, 2) == 5 and table_entries(False, 600, 170) == 5
    assert fixed_block_rows(384) == 170 and fixed_block_rows(1 << 20) == 1


@pytest.mark.parametrize("field", ["routed_experts", "sampling_mask"])
def test_a_flipped_value_byte_in_the_window_is_named_by_the_read_and_by_verify(
    tmp_path, capsys, field
):
    segs, _ = write(tmp_path)
    seg = segs[field]
    if field == "routed_experts":  # row 400 lies in block 2 (rows 340..509)
        at, block = seg.offset + 400 * 384 + 17, "rows 2"
    else:  # the last value: row 599, in block 4 (rows 512..599)
        at, block = mask_value_byte(seg, seg.ragged.values - 1), "values 4"
    flip(tmp_path, at)
    with pytest.raises(PayloadChecksumError) as info:
        read_field([seg], field, (380, ROWS), root=checking(tmp_path))
    err = info.value
    assert (err.file, err.field, err.region, err.block) == (
        f"{GROUP}/w0.rfp",
        field,
        seg.offset,
        block,
    )
    assert err.offset <= at and "checksum mismatch" in str(err)
    assert pickle.loads(pickle.dumps(err)).place == err.place
    line = verify_finding(tmp_path, capsys)
    region = 0 if field == "routed_experts" else 1
    assert f"BAD {GROUP}/w0.rfp: region {region}:" in line
    assert f"{block.split()[0]} block {block.split()[1]}" in line and f"field={field}" in line


def test_a_flipped_index_byte_is_a_checksum_error_before_the_index_is_decoded(tmp_path, capsys):
    segs, _ = write(tmp_path)
    seg = segs["sampling_mask"]
    per = 8 + BLOCK_ROWS * seg.ragged.count_bytes
    flip(tmp_path, seg.offset + 3 * per)  # block 3's value offset: the index would not chain
    with pytest.raises(PayloadChecksumError) as info:
        read_field([seg], "sampling_mask", (0, 50), root=checking(tmp_path))
    assert info.value.block == "index 3"  # the record's whole index is read: W needs every row
    line = verify_finding(tmp_path, capsys)  # verify names what is wrong with it first
    assert "region 1:" in line and "block 3" in line and "field=sampling_mask" in line


def test_a_flipped_byte_outside_a_clipped_window_is_left_to_verify(tmp_path, capsys):
    segs, arrays = write(tmp_path)
    routing, mask = segs["routed_experts"], segs["sampling_mask"]
    flip(tmp_path, routing.offset + 550 * 384)  # routing block 3
    flip(tmp_path, mask_value_byte(mask, mask.ragged.values - 1))  # mask values block 4
    got = read_fields(
        [routing, mask],
        {"routed_experts": [(0, 100), (200, 300)], "sampling_mask": (0, 300)},
        root=checking(tmp_path),
    )
    want = np.concatenate([arrays["routed_experts"][:100], arrays["routed_experts"][200:300]])
    np.testing.assert_array_equal(got["routed_experts"].values.numpy(), want)
    counts, ids = stored(*arrays["sampling_mask"])
    first = np.cumsum(counts) - counts
    mask = got["sampling_mask"].values
    assert mask.lengths().tolist() == (1 + counts[:300]).tolist()
    want = [[-1, *ids[first[r] : first[r] + counts[r]]] for r in range(300)]  # the label slot
    np.testing.assert_array_equal(mask.values.numpy(), np.concatenate(want))
    assert "rows block 3" in verify_finding(tmp_path, capsys)


def test_a_plain_read_does_not_check_and_a_checking_read_of_sound_bytes_is_exact(tmp_path):
    segs, _ = write(tmp_path)
    windows = {"routed_experts": [(590, 700), (3, 5)], "sampling_mask": [(128, 129), (0, 600)]}
    plain = read_fields(list(segs.values()), windows, root=PayloadRoot(tmp_path))
    checked = read_fields(list(segs.values()), windows, root=checking(tmp_path))
    for name in windows:
        assert same_read(plain[name].values, checked[name].values), name
        assert plain[name].widest == checked[name].widest
    before = read_field([segs["routed_experts"]], "routed_experts", (0, 1), root=tmp_path)
    flip(tmp_path, segs["routed_experts"].offset + 4)  # row 0, [0, 4]
    after = read_field([segs["routed_experts"]], "routed_experts", (0, 1), root=tmp_path)
    assert int(after[0, 0, 4]) == int(before[0, 0, 4]) ^ 0x04  # not checked unless asked


def test_a_flipped_header_or_table_byte_is_a_checksum_error(tmp_path):
    segs, _ = write(tmp_path)
    seg = segs["routed_experts"]
    table_at = seg.offset + ROWS * 384
    flip(tmp_path, table_at + 4 * 1 + 2)  # block 0's entry
    with pytest.raises(PayloadChecksumError, match="rows block 0"):
        read_field([seg], "routed_experts", (0, 1), root=checking(tmp_path))
    flip(tmp_path, table_at + 4 * 1 + 2)  # restored
    flip(tmp_path, table_at + 1)  # the header's entry
    with pytest.raises(PayloadChecksumError) as info:
        read_field([seg], "routed_experts", (0, 1), root=checking(tmp_path))
    assert info.value.block == "header"


def test_the_root_setting_survives_pickling(tmp_path):
    root = pickle.loads(pickle.dumps(checking(tmp_path)))
    assert root.verify_checksums is True
    assert PayloadRoot(tmp_path).verify_checksums is False
