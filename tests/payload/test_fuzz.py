"""Random bytes and random records: the reader answers with typed errors or correct data only."""

import contextlib
import multiprocessing
import os

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfeed.payload import (
    PAYLOAD_FIELDS,
    PayloadError,
    PayloadRoot,
    PayloadSegment,
    PayloadWriter,
    RaggedLayout,
    RaggedRows,
    read_field,
)
from rollfeed.payload.format.layout import file_header
from rollfeed.payload.read.checks import RecordTable, explain, plausible
from rollfeed.payload.segment import STORED_DTYPES

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ints = st.integers(-(2**40), 2**40) | st.integers(-3, 300)


@st.composite
def records(draw):
    field = draw(
        st.sampled_from(
            ["routed_experts", "routed_expert_weights", "sampling_mask", "sampling_mask_logprobs"]
        )
    )
    ragged = None
    if draw(st.booleans()):
        ragged = RaggedLayout(
            rows=draw(ints),
            values=draw(ints),
            count_bytes=draw(st.sampled_from([0, 1, 2, 3, 4])),
            block_rows=draw(ints),
        )
    return PayloadSegment(
        field=field,
        file=draw(st.sampled_from(["f.rfp", "g.rfp", "missing.rfp", "../f.rfp"])),
        offset=draw(ints),
        pos=draw(st.integers(-2, 50)),
        rows=draw(ints),
        dtype=draw(
            st.sampled_from(
                ["uint8", "uint16", "uint24", "int32", "float32", "float16", "bool", "complex64"]
            )
        ),
        shape=tuple(draw(st.lists(st.integers(-1, 4), max_size=2))),
        first=draw(ints),
        ragged=ragged,
    )


@FUZZ
@given(
    body=st.binary(max_size=600),
    segs=st.lists(records(), min_size=1, max_size=3),
    valid_head=st.booleans(),
)
def test_random_bytes_and_records_raise_only_typed_errors(tmp_path, body, segs, valid_head):
    for name in ("f.rfp", "g.rfp"):
        (tmp_path / name).write_bytes((file_header(7) if valid_head else b"") + body)
    root = PayloadRoot(tmp_path, retries=0)
    for field in {s.field for s in segs}:
        try:
            out = read_field(segs, field, [(0, 20), (5, 9)], root=root)
        except PayloadError:
            continue
        if out is not None:  # ragged: RaggedRows of 24 rows; fixed: [24, *shape]
            assert (out.n_rows if isinstance(out, RaggedRows) else len(out)) == 24


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8)
)
def test_corrupted_real_files_raise_only_typed_errors(tmp_path, flips):
    (tmp_path / "real.rfp").unlink(missing_ok=True)  # hypothesis reuses tmp_path
    with PayloadWriter(tmp_path, name="real") as w:
        counts = 1 + np.arange(300) % 4
        segs = w.write(
            {
                "sampling_mask": (counts, np.arange(counts.sum()) * 97),  # 3-byte ids
                "routed_experts": np.ones((300, 2), np.int64),
            },
            pos=0,
            sampled=(np.cumsum(counts) - counts) * 97,
        )
    path = tmp_path / "real.rfp"
    raw = bytearray(path.read_bytes())
    for where, byte in flips:
        raw[where % len(raw)] = byte
    path.write_bytes(bytes(raw))
    for field in ("sampling_mask", "routed_experts"):
        with contextlib.suppress(PayloadError):
            read_field(segs, field, (0, 300), root=PayloadRoot(tmp_path, retries=0))


def _produce(root: str, queue, n: int) -> None:
    rng = np.random.default_rng(7)
    with PayloadWriter(root, group="live") as w:
        for i in range(n):
            rows = int(rng.integers(1, 400))
            counts = rng.integers(1, 6, rows)
            ids = np.full(counts.sum(), i)
            ids[np.cumsum(counts) - counts] = 1000 + i  # each row's sampled token, then i's
            segs = w.write(
                {"routed_experts": np.full((rows, 4), i % 200), "sampling_mask": (counts, ids)},
                pos=0,
                sampled=np.full(rows, 1000 + i),
            )
            queue.put(([s.model_dump_json() for s in segs], rows, (counts - 1).tolist()))
    queue.put(None)


def test_concurrent_reader_never_sees_incomplete_bytes(tmp_path):
    """A reader in another process reads each segment the moment it is announced."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    producer = ctx.Process(target=_produce, args=(os.fspath(tmp_path), queue, 60))
    producer.start()
    root, seen, i = PayloadRoot(tmp_path), 0, 0
    while (item := queue.get(timeout=60)) is not None:
        records, rows, counts = item
        segs = [PayloadSegment.from_json(r) for r in records]
        experts = read_field(segs, "routed_experts", (0, rows), root=root)
        mask = read_field(segs, "sampling_mask", (0, rows), root=root)
        assert torch.equal(experts, torch.full((rows, 4), i % 200, dtype=torch.uint8))
        # each row: its sampled token's slot (at the fill), then the other ids, all i
        assert mask.lengths().tolist() == [1 + c for c in counts]
        slots = torch.zeros(mask.nnz, dtype=torch.bool)
        slots[mask.offsets[:-1]] = True
        assert bool((mask.values[slots] == -1).all()) and bool((mask.values[~slots] == i).all())
        seen, i = seen + 1, i + 1
    producer.join(30)
    assert producer.exitcode == 0 and seen == 60


VALID = {
    "routed_experts": dict(dtype="uint8", shape=(2, 8), ragged=None),
    "routed_expert_weights": dict(dtype="float32", shape=(2, 8), ragged=None),
    "sampling_mask": dict(
        dtype="uint24",
        shape=(),
        ragged=RaggedLayout(rows=10, values=20, count_bytes=1, block_rows=128),
    ),
    "sampling_mask_logprobs": dict(
        dtype="float32",
        shape=(),
        ragged=RaggedLayout(rows=10, values=20, count_bytes=1, block_rows=128),
    ),
}


@st.composite
def near_valid(draw):
    """A consistent record with at most one attribute (or layout entry) replaced."""
    field = draw(st.sampled_from(sorted(VALID)))
    seg = PayloadSegment(
        field=field, file="f.rfp", offset=56, pos=3, rows=6, first=2, **VALID[field]
    )
    what = draw(
        st.sampled_from(
            ["none", "offset", "pos", "rows", "first", "dtype", "shape", "layout", "file_id"]
        )
    )
    small = st.integers(-3, 40) | st.just(1 << 62)
    if what in ("offset", "pos", "rows", "first"):
        seg = seg.model_copy(update={what: draw(small)})
    elif what == "file_id":
        ids = st.none() | st.integers(-2, 2) | st.sampled_from([(1 << 63) - 1, 1 << 63])
        seg = seg.model_copy(update={"file_id": draw(ids)})
    elif what == "dtype":
        seg = seg.model_copy(
            update={"dtype": draw(st.sampled_from(sorted(STORED_DTYPES | {"uint24"})))}
        )
    elif what == "shape":
        seg = seg.model_copy(
            update={"shape": tuple(draw(st.lists(st.integers(-1, 4), max_size=2)))}
        )
    elif what == "layout":
        if seg.ragged is None or draw(st.booleans()):
            lay = RaggedLayout(rows=10, values=20, count_bytes=1, block_rows=128)
            seg = seg.model_copy(update={"ragged": None if seg.ragged else lay})
        else:
            key = draw(st.sampled_from(["rows", "values", "count_bytes", "block_rows"]))
            lay = seg.ragged.model_copy(update={key: draw(small)})
            seg = seg.model_copy(update={"ragged": lay})
    return seg


@settings(max_examples=600, deadline=None)
@given(seg=near_valid() | records())
def test_the_fast_record_predicate_and_the_explaining_check_agree(seg):
    """The reader's one-line predicate and the check that explains a refusal apply one rule set."""
    field = PAYLOAD_FIELDS[seg.field]
    try:
        explain(seg, seg.field, field)
        explained_ok = True
    except PayloadError:
        explained_ok = False
    assert _plausible(seg) == explained_ok


def _plausible(seg: PayloadSegment) -> bool:
    """The reader's vectorised predicate on a one-record table (an integer beyond int64 cannot
    enter a table: the reader explains such a record at once)."""
    try:
        return bool(plausible(RecordTable([seg]), PAYLOAD_FIELDS[seg.field])[0])
    except OverflowError:
        return False


def test_the_unmodified_near_valid_records_are_plausible():
    for field, attrs in VALID.items():
        seg = PayloadSegment(field=field, file="f.rfp", offset=56, pos=3, rows=6, first=2, **attrs)
        assert _plausible(seg)
