"""The reader and the writer: nothing silent, nothing hangs, nothing escapes.

Each test is one behaviour: a crafted or stale record, a swapped symlink, a FIFO, a full disk or
threads sharing a root end either in exactly the written bytes or in a typed ``PayloadError``
naming the place. The writer's own arrays are the oracle for every read.
"""

import errno
import json
import os
import random
import shutil
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from rollfeed.cli import main
from rollfeed.payload import (
    PAYLOAD_FIELDS,
    PayloadDtypeError,
    PayloadError,
    PayloadField,
    PayloadIndexError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadRegionError,
    PayloadRoot,
    PayloadSegment,
    PayloadSegmentError,
    PayloadStaleFileError,
    PayloadTruncatedError,
    PayloadWriter,
    RaggedLayout,
    read_field,
    read_fields,
    register_field,
)
from rollfeed.payload.format.layout import (
    DTYPE_CODES,
    FILE_HEADER_V1,
    MAGIC,
    REGION_HEADER,
    REGION_HEADER_V1,
    REGION_MAGIC_V1,
    index_table,
    ragged_bytes,
)

GROUP = "step_000001"
ROWS, SHAPE = 6, (3, 4)


def fast_root(path, **kw) -> PayloadRoot:
    return PayloadRoot(path, retries=0, **kw)


def routing(seed: int, rows: int = ROWS) -> np.ndarray:
    """Routing ids ``[rows, 3, 4]`` in ``[0, 200)`` that differ from seed to seed."""
    return np.random.default_rng(seed).integers(0, 200, (rows, *SHAPE))


def write(root, name="w0", group=GROUP, seed=0, rows=ROWS, ragged=False):
    """Two regions (routing, then a mask) in one file; returns the segments by field."""
    counts = 1 + np.arange(rows) % 3
    ids = np.arange(counts.sum()) + 1000 * seed  # each row's first id is its sampled token
    arrays = {"routed_experts": routing(seed, rows), "sampling_mask": (counts, ids)}
    with PayloadWriter(root, group=group, name=name) as w:
        segs = w.write(arrays, pos=0, sampled=ids[np.cumsum(counts) - counts])
    return {s.field: s for s in segs}


def read_routing(seg, root, window=(0, ROWS)):
    return read_field([seg], "routed_experts", window, root=root)


# -- item 4: offset arithmetic never wraps ------------------------------------------------------


def test_record_with_first_near_2_to_62_is_refused_not_wrapped(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    crafted = seg.model_copy(update={"first": 2**62 - 1, "rows": 1})
    with pytest.raises(PayloadTruncatedError, match="end at byte") as info:
        read_field([crafted], "routed_experts", (0, 1), root=fast_root(tmp_path))
    assert (info.value.file, info.value.field, info.value.pos) == (seg.file, seg.field, 0)


def test_huge_offset_is_a_typed_error_not_einval(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    # offset + first * row bytes wraps to a negative int64: preadv said EINVAL
    crafted = seg.model_copy(update={"offset": 2**62 - 10, "first": 2**61, "rows": 1})
    with pytest.raises(PayloadTruncatedError) as info:
        read_field([crafted], "routed_experts", (0, 1), root=fast_root(tmp_path))
    assert info.value.offset == 2**62 - 10 and info.value.file == seg.file


# -- item 5: every record is held to the region header it points into --------------------------


def _lies(seg_fixed, seg_ragged):
    row = int(np.prod(SHAPE))
    lay = seg_ragged.ragged
    return [
        ("offset one row late", seg_fixed.model_copy(update={"offset": seg_fixed.offset + row})),
        ("int8 for uint8", seg_fixed.model_copy(update={"dtype": "int8"})),
        ("shape transposed", seg_fixed.model_copy(update={"shape": (4, 3)})),
        ("rows past the region", seg_fixed.model_copy(update={"first": 2})),
        ("fixed record on the mask region",
         seg_fixed.model_copy(update={"offset": seg_ragged.offset, "rows": 2})),
        ("region rows",
         seg_ragged.model_copy(update={"ragged": lay.model_copy(update={"rows": 7})})),
        ("block rows",
         seg_ragged.model_copy(update={"ragged": lay.model_copy(update={"block_rows": 64})})),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(7))
def test_record_disagreeing_with_its_region_header_is_refused(tmp_path, case):
    segs = write(
        tmp_path
    )  # the mask region follows the routing one: a record sliding on lands in it
    what, lie = _lies(segs["routed_experts"], segs["sampling_mask"])[case]
    with pytest.raises(PayloadRegionError, match="region header") as info:
        read_field([lie], lie.field, (0, ROWS), root=fast_root(tmp_path))
    assert info.value.file == lie.file and info.value.field == lie.field, what
    assert info.value.offset == lie.offset and info.value.pos == 0, what


def test_offset_true_in_json_is_refused(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    record = json.loads(seg.model_dump_json())
    for key, bad in (("offset", True), ("rows", 2.0), ("pos", "0"), ("first", False)):
        with pytest.raises(PayloadSegmentError, match=key):
            PayloadSegment.from_json(json.dumps({**record, key: bad}))


# -- item 6: a rewritten file is never read as the old bytes ------------------------------------


def test_rewritten_file_after_prune_is_never_read_as_the_old_bytes(tmp_path):
    trainer = PayloadRoot(tmp_path)  # long-lived: keeps its descriptors between steps
    old = write(tmp_path, seed=1)["routed_experts"]
    np.testing.assert_array_equal(read_routing(old, trainer).numpy(), routing(1))
    PayloadRoot(tmp_path).prune(GROUP)  # the orchestrator re-runs the step
    new = write(tmp_path, seed=2)["routed_experts"]
    assert (new.file, new.offset) == (old.file, old.offset)  # the same record but for its bytes
    np.testing.assert_array_equal(read_routing(new, trainer).numpy(), routing(2))
    with pytest.raises(PayloadStaleFileError, match="replaced") as info:
        read_routing(old, trainer)
    assert info.value.file == old.file and info.value.field == "routed_experts"


# -- item 7: threads sharing a root --------------------------------------------------------------


def test_threads_sharing_a_root_over_more_files_than_max_open_read_exact_bytes(tmp_path):
    files = 12
    segs = [write(tmp_path, name=f"w{i}", seed=i)["routed_experts"] for i in range(files)]
    segs = [s.model_copy(update={"pos": i * ROWS}) for i, s in enumerate(segs)]
    want = np.concatenate([routing(i) for i in range(files)])
    # parallel_min_bytes=0: the reads of one window also share the root's pool of threads
    root = PayloadRoot(tmp_path, max_open=3, retries=0, parallel_min_bytes=0)
    fds_before = len(os.listdir("/proc/self/fd"))
    failures, peak = [], [0]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and not failures:
            a = rng.randrange(files - 2)
            b = rng.randrange(a + 1, files + 1)
            try:
                got = read_field(segs, "routed_experts", (a * ROWS, b * ROWS), root=root)
                if not np.array_equal(got.numpy(), want[a * ROWS : b * ROWS]):
                    failures.append(f"wrong bytes for files {a}..{b}")
            except Exception as err:  # any error is a failure here
                failures.append(repr(err))
            peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures[:3]
    # cached <= max_open, plus the files of the reads in flight (6 threads x <= 12 files)
    assert peak[0] - fds_before <= 3 + 6 * files
    assert len(os.listdir("/proc/self/fd")) - fds_before <= 3
    root.close()
    assert len(os.listdir("/proc/self/fd")) <= fds_before


# -- item 8: a failed write hands out nothing and the next one is whole -------------------------


def _fail_once(monkeypatch, code=errno.ENOSPC):
    """Make the first write system call (whichever the writer uses) fail with ``code``."""
    armed = [True]
    for name in ("write", "pwrite", "pwritev"):
        real = getattr(os, name)

        def failing(*args, _real=real):
            if armed[0]:
                armed[0] = False
                raise OSError(code, os.strerror(code))
            return _real(*args)

        monkeypatch.setattr(os, name, failing)


def test_retry_after_enospc_on_first_write_gives_a_readable_file(tmp_path, monkeypatch):
    data = routing(3)
    with PayloadWriter(tmp_path, group=GROUP, name="w0") as w:
        with monkeypatch.context() as m:
            _fail_once(m)
            with pytest.raises(PayloadIOError, match="ENOSPC") as info:
                w.write({"routed_experts": data}, pos=0)
        assert info.value.file == w.file
        segs = w.write({"routed_experts": data}, pos=0)
    np.testing.assert_array_equal(read_routing(segs[0], fast_root(tmp_path)).numpy(), data)


def test_failed_write_is_cut_back_and_the_next_write_appends_cleanly(tmp_path, monkeypatch):
    with PayloadWriter(tmp_path, group=GROUP, name="w0") as w:
        first = w.write({"routed_experts": routing(4)}, pos=0)
        size = os.path.getsize(tmp_path / w.file)
        with monkeypatch.context() as m:
            _fail_once(m, errno.EIO)
            with pytest.raises(PayloadIOError, match="EIO"):
                w.write({"routed_experts": routing(5)}, pos=0)
        assert os.path.getsize(tmp_path / w.file) == size
        second = w.write({"routed_experts": routing(6)}, pos=0)
    root = fast_root(tmp_path)
    np.testing.assert_array_equal(read_routing(first[0], root).numpy(), routing(4))
    np.testing.assert_array_equal(read_routing(second[0], root).numpy(), routing(6))


# -- items 9-11, reader side: FIFOs, memory claims, symlink swaps -------------------------------


def test_fifo_in_root_is_refused_at_once(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    fifo = tmp_path / GROUP / "fifo.rfp"
    os.mkfifo(fifo)
    outcome = []

    def attempt() -> None:
        try:
            read_routing(seg.model_copy(update={"file": f"{GROUP}/fifo.rfp"}), fast_root(tmp_path))
        except Exception as err:  # recorded and asserted below
            outcome.append(err)

    th = threading.Thread(target=attempt, daemon=True)
    started = time.monotonic()
    th.start()
    th.join(5)
    if th.is_alive():  # release a reader blocked in open() before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not th.is_alive() and time.monotonic() - started < 5
    assert isinstance(outcome[0], PayloadPathError) and "FIFO" in str(outcome[0])


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except PayloadError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_zero_row_record_claiming_huge_shape_allocates_nothing(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    huge = seg.model_copy(update={"rows": 0, "shape": (4096, 4095)})  # 16 MiB rows
    root = fast_root(tmp_path)
    with pytest.raises(PayloadRegionError, match="row shape"):
        read_field([huge], "routed_experts", (0, 8), root=root)
    assert _peak_bytes(lambda: read_field([huge], "routed_experts", (0, 8), root=root)) < 4 << 20


def test_csr_record_claiming_more_values_than_its_file_holds_allocates_nothing(tmp_path):
    seg = write(tmp_path)["sampling_mask"]
    lay = seg.ragged.model_copy(update={"values": 2**28})
    crafted = seg.model_copy(update={"ragged": lay})
    root = fast_root(tmp_path)
    with pytest.raises(PayloadTruncatedError, match="values ends at byte"):
        read_field([crafted], "sampling_mask", (0, ROWS), root=root)
    peak = _peak_bytes(lambda: read_field([crafted], "sampling_mask", (0, ROWS), root=root))
    assert peak < 4 << 20


def test_ragged_record_claiming_a_huge_block_allocates_nothing(tmp_path):
    seg = write(tmp_path)["sampling_mask"]
    crafted = seg.model_copy(
        update={"ragged": seg.ragged.model_copy(update={"block_rows": 1 << 24})}
    )
    root = fast_root(tmp_path)
    with pytest.raises(PayloadSegmentError, match="larger than both 128"):
        read_field([crafted], "sampling_mask", (0, ROWS), root=root)
    assert (
        _peak_bytes(lambda: read_field([crafted], "sampling_mask", (0, ROWS), root=root)) < 4 << 20
    )
    rows = np.array([3], np.int64)  # the index table itself refuses such a block (verify uses it)
    with pytest.raises(PayloadIndexError, match="larger than both 128") as info:
        index_table(0 * rows, rows, rows, rows, count_bytes=4, block_rows=1 << 24)
    assert info.value.request == 0


def test_symlink_swapped_during_reads_never_returns_bytes_from_outside(tmp_path_factory):
    inside, outside = tmp_path_factory.mktemp("inside"), tmp_path_factory.mktemp("outside")
    seg = write(inside, seed=7)["routed_experts"]
    # Outside: the same file (same file id, so no id check can tell) with other routing rows:
    # only the open itself stands between the reader and it.
    raw = bytearray((inside / seg.file).read_bytes())
    body = slice(seg.offset, seg.offset + ROWS * int(np.prod(SHAPE)))
    raw[body] = (routing(8).astype(np.uint8)).tobytes()
    (outside / GROUP).mkdir()
    (outside / seg.file).write_bytes(bytes(raw))
    name = inside / seg.file
    os.link(name, inside / GROUP / "keep")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.symlink(outside / seg.file, inside / GROUP / "tmp")
            os.replace(inside / GROUP / "tmp", name)
            os.link(inside / GROUP / "keep", inside / GROUP / "tmp")
            os.replace(inside / GROUP / "tmp", name)

    th = threading.Thread(target=swap)
    th.start()
    root, counts = fast_root(inside), {"inside": 0, "outside": 0, "refused": 0}
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            root.close()  # open again on every read
            try:
                got = read_routing(seg, root).numpy()
            except (PayloadPathError, PayloadMissingFileError):
                counts["refused"] += 1
                continue
            counts["inside" if np.array_equal(got, routing(7)) else "outside"] += 1
    finally:
        stop.set()
        th.join()
    assert counts["outside"] == 0, counts
    assert counts["inside"] > 0 and counts["refused"] > 0, counts


# -- untyped errors from crafted records, prune, messages, dtypes -------------------------------


@pytest.mark.parametrize(
    ("handle", "match"),
    [(GROUP, "a directory"), (f"{GROUP}/w0.rfp\0x", "NUL")],
)
def test_record_naming_a_directory_or_holding_a_nul_byte_is_a_typed_error(tmp_path, handle, match):
    seg = write(tmp_path)["routed_experts"].model_copy(update={"file": handle})
    with pytest.raises(PayloadPathError, match=match):
        read_routing(seg, fast_root(tmp_path))


def test_short_file_message_names_the_real_size_with_no_retries(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    size = os.path.getsize(tmp_path / seg.file)
    long = seg.model_copy(update={"rows": 1000})
    with pytest.raises(PayloadTruncatedError, match=f"the file has {size} bytes") as info:
        read_field([long], "routed_experts", (0, 1000), root=fast_root(tmp_path))
    assert "-1" not in str(info.value)


def test_prune_of_a_missing_group_is_a_typed_error(tmp_path):
    with pytest.raises(PayloadMissingFileError, match="nothing to prune") as info:
        PayloadRoot(tmp_path).prune("step_000009")
    assert info.value.file == "step_000009"


def test_prune_refuses_a_symlinked_group_and_leaves_its_target(tmp_path):
    seg = write(tmp_path)["routed_experts"]
    os.symlink(tmp_path / GROUP, tmp_path / "step_link")
    with pytest.raises(PayloadPathError, match="not a directory"):
        PayloadRoot(tmp_path).prune("step_link")
    with pytest.raises(PayloadPathError):
        PayloadRoot(tmp_path).prune("step_link/sub")
    with pytest.raises(PayloadPathError):
        PayloadRoot(tmp_path).prune("../outside")
    assert (tmp_path / seg.file).exists()


def test_writer_never_creates_its_file_through_a_symlinked_group(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "step_link")
    w = PayloadWriter(tmp_path, group="step_link", name="w0")
    with pytest.raises(PayloadPathError, match="symlink") as info:
        w.write({"routed_experts": routing(0)}, pos=0)
    w.close()
    assert info.value.file == "step_link/w0.rfp"
    assert not (tmp_path / "real" / "w0.rfp").exists()  # readers would refuse its records


def test_writer_refuses_a_dtype_override_it_cannot_read_back(tmp_path):
    table = dict(PAYLOAD_FIELDS)
    register_field("tool_call_id", PayloadField(fill=-7, window="inputs"), fields=table)
    for dtypes in (
        {"routed_experts": "float32"},  # an int field read back as floats: refused by readers
        {"routed_experts": "uint64"},  # not a stored dtype
        {"sampling_mask": "int16"},  # ragged values take the narrowest width of each region
        {"tool_call_id": "uint8"},  # cannot hold the fill -7
        {"routed_experts": "not-a-dtype"},
    ):
        name = next(iter(dtypes))
        with pytest.raises(PayloadDtypeError, match="cannot be read back") as info:
            PayloadWriter(tmp_path, dtypes=dtypes, fields=table)
        assert info.value.field == name and dtypes[name] in str(info.value)
    ok = PayloadWriter(tmp_path, dtypes={"routed_experts": "uint16"})  # what capture uses
    assert ok.dtypes == {"routed_experts": "uint16"}


# -- format versions ----------------------------------------------------------------------------


def _version_1_file(path, data: np.ndarray, counts: np.ndarray, values: np.ndarray):
    """A version-1 file as the old writer laid it out: 16-byte file header, 40-byte region
    headers (``RGN1``, no file id, no row shape), then the name and the body."""
    regions, offsets = [], {}
    at = FILE_HEADER_V1.size
    body_m, cb = ragged_bytes(counts, values, dtype=np.dtype("int32"))
    for name, kind, cb_, dtype, block, rows, nvalues, body in (
        ("routed_experts", 0, 0, "uint8", 0, len(data), data.size, data.astype("u1").tobytes()),
        ("sampling_mask", 1, cb, "int32", 128, len(counts), len(values), body_m),
    ):
        head = REGION_HEADER_V1.pack(
            REGION_MAGIC_V1, kind, cb_, DTYPE_CODES.index(dtype), len(name), block, rows,
            nvalues, len(body),
        ) + name.encode()  # fmt: skip
        offsets[name] = at + len(head)
        regions.append(head + body)
        at += len(head) + len(body)
    path.write_bytes(FILE_HEADER_V1.pack(MAGIC, 1, 0, 0) + b"".join(regions))
    return offsets, cb


def test_version_1_files_stay_readable_beside_version_2_files(tmp_path):
    old_data, counts, values = routing(9), np.array([2, 0, 1, 3, 1, 0]), np.arange(7) + 50
    (tmp_path / GROUP).mkdir()
    offsets, cb = _version_1_file(tmp_path / GROUP / "old.rfp", old_data, counts, values)
    common = dict(file=f"{GROUP}/old.rfp", pos=0, rows=ROWS)
    old = [
        PayloadSegment(field="routed_experts", offset=offsets["routed_experts"], dtype="uint8",
                       shape=SHAPE, **common),
        PayloadSegment(field="sampling_mask", offset=offsets["sampling_mask"], dtype="int32",
                       ragged=RaggedLayout(rows=ROWS, values=7, count_bytes=cb, block_rows=128),
                       **common),
    ]  # fmt: skip
    new = [s.model_copy(update={"pos": ROWS}) for s in write(tmp_path, name="new", seed=3).values()]
    root = fast_root(tmp_path)
    got = read_field(old + new, "routed_experts", (0, 2 * ROWS), root=root)
    np.testing.assert_array_equal(got.numpy(), np.concatenate([old_data, routing(3)]))
    mask = read_field(old + new, "sampling_mask", (0, ROWS), root=root)
    # rows as stored, after column 0 (the sampled token's place: version 1 kept it in the row)
    assert mask[:, :4].tolist() == [[-1, 50, 51, -1], [-1] * 4, [-1, 52, -1, -1],
                                    [-1, 53, 54, 55], [-1, 56, -1, -1], [-1] * 4]  # fmt: skip
    assert torch.equal(mask, read_field(old, "sampling_mask", (0, ROWS), root=root))
    bad = old[0].model_copy(update={"dtype": "int8"})
    with pytest.raises(PayloadRegionError, match="dtype"):
        read_field([bad], "routed_experts", (0, ROWS), root=root)


def test_version_2_files_stay_readable_beside_version_3_files(tmp_path):
    """A file the version-2 writer wrote (checked in): rows whole (the sampled token included,
    ids ascending, 4-byte values), read after column 0 like version-3 rows; checksums hold."""
    fixture = Path(__file__).parent / "fixtures"
    shutil.copytree(fixture / "v2", tmp_path / "v2")
    saved = json.loads((fixture / "v2" / "tiny.json").read_text())
    old = [PayloadSegment.model_validate(s) for s in saved["segments"]]
    assert {s.dtype for s in old if s.ragged} == {"int32", "float32"}
    new = [write(tmp_path, name="new", rows=4)["sampling_mask"].model_copy(update={"pos": 10})]
    windows = {"sampling_mask": (2, 14), "sampling_mask_logprobs": (2, 7)}
    windows["routed_experts"] = (0, 6)
    for root in (fast_root(tmp_path), fast_root(tmp_path, verify_checksums=True)):
        got = read_fields(old + new, windows, root=root)
        mask = got["sampling_mask"].values
        assert mask[:5].tolist() == [[-1, 3, 40, -1], [-1, 7, -1, -1], [-1, 7, 300, 70000],
                                     [-1, 7, -1, -1], [-1, 9, 65000, -1]]  # fmt: skip
        assert mask[5:8].tolist() == [[-1] * 4] * 3
        assert mask[8:].tolist() == [[-1] * 4, [-1, 2, -1, -1], [-1, 4, 5, -1], [-1] * 4]
        lp = got["sampling_mask_logprobs"].values.numpy()
        want = np.float32([-1.5, -0.3, -2.5])  # version 2: ascending ids, as stored
        np.testing.assert_array_equal(lp[2], want)
        routing = got["routed_experts"].values
        assert routing.reshape(-1).tolist() == (np.arange(36) % 8).tolist()
    assert main(["verify", str(tmp_path)]) == 0


def test_a_region_header_disagreeing_on_row_flags_or_value_width_is_refused(tmp_path):
    """A version-3 mask region whose header does not say its rows omit the sampled token, and a
    version-2 region claiming narrow values (which version 2 never wrote), are not read."""
    seg = write(tmp_path)["sampling_mask"]
    path = tmp_path / seg.file
    flags_at = seg.offset - len(seg.field) - REGION_HEADER.size + 46
    raw = bytearray(path.read_bytes())
    assert raw[flags_at] == 1  # rows omit their sampled token
    raw[flags_at] = 0
    path.write_bytes(bytes(raw))
    with pytest.raises(PayloadRegionError, match="row flags 0") as info:
        read_field([seg], "sampling_mask", (0, ROWS), root=fast_root(tmp_path))
    assert info.value.file == seg.file and info.value.offset == seg.offset
    shutil.copytree(Path(__file__).parent / "fixtures" / "v2", tmp_path / "v2")
    saved = json.loads((tmp_path / "v2" / "tiny.json").read_text())
    old = PayloadSegment.model_validate(saved["segments"][0])  # the mask, int32 values
    raw = bytearray((tmp_path / old.file).read_bytes())
    raw[old.offset - len(old.field) - REGION_HEADER.size + 6] = DTYPE_CODES.index("uint8")
    (tmp_path / old.file).write_bytes(bytes(raw))
    narrow = old.model_copy(update={"dtype": "uint8"})
    with pytest.raises(PayloadRegionError, match="values of uint8 in a version-2 region"):
        read_field([narrow], "sampling_mask", (2, 7), root=fast_root(tmp_path))
