"""Random bytes and random records: the reader answers with typed errors or correct data only."""

import contextlib
import multiprocessing
import os

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfeed.payload import (
    PayloadError,
    PayloadRoot,
    PayloadSegment,
    PayloadWriter,
    RaggedLayout,
    read_field,
)
from rollfeed.payload.layout import file_header

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
        dtype=draw(st.sampled_from(["uint8", "int32", "float32", "float16", "bool", "complex64"])),
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
        (tmp_path / name).write_bytes((file_header() if valid_head else b"") + body)
    root = PayloadRoot(tmp_path, retries=0)
    for field in {s.field for s in segs}:
        try:
            out = read_field(segs, field, [(0, 20), (5, 9)], root=root)
        except PayloadError:
            continue
        assert out is None or out.shape[0] == 24


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8)
)
def test_corrupted_real_files_raise_only_typed_errors(tmp_path, flips):
    (tmp_path / "real.rfp").unlink(missing_ok=True)  # hypothesis reuses tmp_path
    with PayloadWriter(tmp_path, name="real") as w:
        counts = np.arange(300) % 4
        segs = w.write(
            {
                "sampling_mask": (counts, np.arange(counts.sum())),
                "routed_experts": np.ones((300, 2), np.int64),
            },
            pos=0,
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
            counts = rng.integers(0, 6, rows)
            segs = w.write(
                {
                    "routed_experts": np.full((rows, 4), i % 200),
                    "sampling_mask": (counts, np.full(counts.sum(), i)),
                },
                pos=0,
            )
            queue.put(([s.model_dump_json() for s in segs], rows, counts.tolist()))
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
        assert (mask >= 0).sum(dim=1).tolist() == counts and bool((mask[mask >= 0] == i).all())
        seen, i = seen + 1, i + 1
    producer.join(30)
    assert producer.exitcode == 0 and seen == 60
