"""The compiled window read against the planned NumPy reader: where the kernel takes a read it
returns bitwise the same values, dtype, shape and coverage; where the planned reader raises, or
the read is one the kernel does not take, it declines (``None``) and ``read_fields`` gives the
planned reader's answer or typed error."""

import numpy as np
import pytest
import torch

from rollfeed.collate.cp import field_ranges, rank_ranges
from rollfeed.payload import (
    PayloadError,
    PayloadRoot,
    PayloadWidthError,
    PayloadWriter,
    RaggedRows,
    read_fields,
    shift_segments,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS
from rollfeed.payload.read import compiled_read
from rollfeed.payload.read.compiled_read import read_compiled
from tests.payload.common import kept_sets, same_read

FIELDS = ("routed_experts", "routed_expert_weights", "sampling_mask", "sampling_mask_logprobs")
# Largest kept id per sample: the writer stores the ids as uint8, uint16, uint24 or int32.
VOCABS = (200, 5_000, 151_936, 1 << 25)


def micro_batch(root, rng, *, files=3, samples=8):
    """Samples from ``files`` writers packed into one row with gaps between them: some fields
    missing, some records clipped at the tail or the head, mask ids of every stored width and
    rows of up to 300 kept ids (2-byte row lengths) in some."""
    writers = [PayloadWriter(root, group="g", name=f"w{i}") for i in range(files)]
    segs, at = [], 0
    for k in range(samples):
        rows = int(rng.integers(1, 400))
        counts = rng.geometric(0.6, rows)
        if k % 4 == 3:
            counts[rng.integers(0, rows)] = 300
        ids, sampled = kept_sets(rng, counts, VOCABS[k % len(VOCABS)])
        arrays = {
            "routed_experts": rng.integers(0, 200, (rows, 2, 3)).astype(np.uint8),
            "routed_expert_weights": rng.random((rows, 2)).astype(np.float32),
            "sampling_mask": (counts, ids),
            "sampling_mask_logprobs": (counts, -rng.random(counts.sum()).astype(np.float32)),
        }
        if k % 3 == 1:
            del arrays["routed_expert_weights"]
        mine = writers[k % files].write(arrays, pos=0, sampled=sampled)
        if k % 4 == 2:  # clipped at the tail
            mine = [s.model_copy(update={"rows": s.rows // 2}) for s in mine]
        if k % 5 == 4:  # clipped at the head, as a CP rank's or a truncation's record is
            cut = rows // 3
            mine = [
                s.model_copy(update={"pos": s.pos + cut, "rows": s.rows - cut, "first": cut})
                for s in mine
            ]
        segs += shift_segments(mine, at + int(rng.integers(0, 3)))
        at += rows + 3
    for w in writers:
        w.close()
    return segs, at


def windows(rng, total):
    """Whole rows, both CP layouts' rank windows, and random lists of ranges (overlapping,
    empty, past the records)."""
    out = [[(0, total)]]
    cu = [0, total // 2 - total // 2 % 4, total - total % 4]  # two sequences
    for layout in ("contiguous", "zigzag"):
        for rank in range(2):
            out.append(rank_ranges(cu, rank, 2, layout))
            out.append(field_ranges(rank_ranges(cu, rank, 2, layout), "labels", cu[-1]))
    for _ in range(4):
        lo = np.sort(rng.integers(0, total + 20, (3, 2)), axis=1)
        out.append([(int(a), int(b)) for a, b in lo])
    return out


@pytest.fixture
def planned(monkeypatch):
    """``read_fields`` with the kernel switched off: the planned reader alone."""

    def read(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(compiled_read, "_window", None)
            return read_fields(*args, **kwargs)

    return read


def test_the_install_built_the_kernel():
    # Every other test here compares the kernel with the planned reader; without a C compiler
    # at install the kernel is absent and reads take the planned reader alone.
    assert compiled_read.COMPILED


def same_as_planned(fast, slow, where) -> None:
    """A kernel read (``read_compiled``'s answer) is bitwise the planned reader's
    (``read_fields``'): fields, values with their dtype and shape (a ragged field's offsets and
    values), coverage and widest row."""
    assert list(fast) == list(slow), where
    for name, (values, coverage, widest) in fast.items():
        want = slow[name].values
        if isinstance(values, tuple):  # ragged: offsets and values (padded by the reader)
            rows = RaggedRows(*(torch.from_numpy(a) for a in values))
            if isinstance(want, RaggedRows):
                assert torch.equal(rows.offsets, want.offsets), (name, where)
                values, want = rows.values.numpy(), want.values
            else:
                values = rows.padded(want.shape[1], fill=PAYLOAD_FIELDS[name].fill).numpy()
        want = want.numpy()
        assert values.dtype == want.dtype and values.shape == want.shape, (name, where)
        assert np.array_equal(values.view(np.uint8), want.view(np.uint8)), (name, where)
        assert np.array_equal(coverage, slow[name].coverage.numpy()), (name, where)
        assert widest == slow[name].widest, (name, where)


@pytest.mark.parametrize("seed", range(4))
def test_the_kernel_reads_bitwise_what_the_planned_reader_reads(tmp_path, planned, seed):
    rng = np.random.default_rng(seed)
    segs, total = micro_batch(tmp_path, rng)
    root = PayloadRoot(tmp_path)
    for k, ranges in enumerate(windows(rng, total)):
        wanted = dict.fromkeys(FIELDS, ranges)
        n = sum(hi - lo for lo, hi in ranges)
        # every other window: the mask's label slots hold given tokens
        labels = {"sampling_mask": rng.integers(0, 1 << 30, n)} if k % 2 else {}
        for width in (None, 400):
            fast = read_compiled(segs, wanted, root, width, PAYLOAD_FIELDS, labels)
            assert fast is not None, f"declined {ranges}"
            slow = planned(segs, wanted, root=root, width=width, labels=labels)
            same_as_planned(fast, slow, (ranges, width))
            assert isinstance(slow["sampling_mask"].values, RaggedRows) == (width is None)
            # and read_fields hands out the kernel's read
            got = read_fields(segs, wanted, root=root, width=width, labels=labels)
            for name in got:
                assert same_read(got[name].values, slow[name].values), name
                assert got[name].widest == slow[name].widest


def test_one_read_syscall_per_file_for_all_fields(tmp_path):
    rng = np.random.default_rng(7)
    segs, total = micro_batch(tmp_path, rng, files=2, samples=2)  # none clipped: read whole
    root = PayloadRoot(tmp_path)
    wanted = {key: [(0, total)] for key in ("routed_experts", "sampling_mask")}
    assert read_compiled(segs, wanted, root, None, PAYLOAD_FIELDS, {}) is not None  # files open
    own = -_read_syscalls() + (before := _read_syscalls())  # reading the counter reads too
    assert read_compiled(segs, wanted, root, None, PAYLOAD_FIELDS, {}) is not None
    # per file: routing header and rows, (its checksum table), mask header, index and values
    assert _read_syscalls() - before - own == len({s.file for s in segs})


def _read_syscalls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


MUTATIONS = {
    "offset": (-1, 1, -64, 8),
    "pos": (-1, 1),
    "rows": (-1, 1, 1000),
    "first": (-1, 1),
    "file_id": (1, -1),
}
LAYOUT = {"rows": (-1, 1), "values": (-1, 1), "count_bytes": (1, 2), "block_rows": (-1, 1)}


def test_a_mutated_record_is_declined_wherever_the_planned_reader_refuses_it(tmp_path, planned):
    rng = np.random.default_rng(11)
    segs, total = micro_batch(tmp_path, rng, files=2, samples=4)
    root = PayloadRoot(tmp_path)
    wanted = {key: [(0, total)] for key in FIELDS}
    cases = 0
    for i, s in enumerate(segs):
        mutants = [{key: getattr(s, key) + d} for key, ds in MUTATIONS.items() for d in ds]
        mutants += [{"dtype": d} for d in ("uint8", "uint16", "int32", "float32", "uint24")]
        mutants += [{"shape": (*s.shape, 1)}, {"shape": ()}, {"field": "sampling_mask"}]
        if s.ragged is not None:
            mutants += [
                {"ragged": s.ragged.model_copy(update={key: getattr(s.ragged, key) + d})}
                for key, ds in LAYOUT.items()
                for d in ds
            ]
        for update in mutants:
            mutated = [*segs[:i], s.model_copy(update=update), *segs[i + 1 :]]
            fast = read_compiled(mutated, wanted, root, None, PAYLOAD_FIELDS, {})
            try:
                slow = planned(mutated, wanted, root=root)
            except PayloadError:
                assert fast is None, f"record {i} {update}: the kernel read what is refused"
                cases += 1
                continue
            if fast is not None:  # both read it: the same bytes
                same_as_planned(fast, slow, (i, update))
    assert cases > 100  # the mutations do reach the checks


def test_reads_the_kernel_does_not_take_are_declined_and_read_as_planned(tmp_path, planned):
    rng = np.random.default_rng(5)
    segs, total = micro_batch(tmp_path, rng, files=2, samples=4)
    wanted = {key: [(0, total)] for key in FIELDS}
    checking = PayloadRoot(tmp_path, verify_checksums=True)
    assert read_compiled(segs, wanted, checking, None, PAYLOAD_FIELDS, {}) is None
    placeholders = [s.model_copy(update={"rows": 0}) for s in segs]
    assert (
        read_compiled(placeholders, wanted, PayloadRoot(tmp_path), None, PAYLOAD_FIELDS, {}) is None
    )
    root = PayloadRoot(tmp_path)
    for reads in (
        lambda: read_fields(placeholders, wanted, root=root),
        lambda: read_fields(segs, wanted, root=checking),
    ):
        got, want = reads(), None
        with pytest.MonkeyPatch.context() as m:
            m.setattr(compiled_read, "_window", None)
            want = reads()
        assert list(got) == list(want)
        assert all(same_read(got[k].values, want[k].values) for k in want)


def test_a_row_wider_than_the_static_width_is_the_planned_readers_error(tmp_path, planned):
    rng = np.random.default_rng(6)
    segs, total = micro_batch(tmp_path, rng, files=1, samples=4)
    wanted = {"sampling_mask": [(0, total)]}
    assert read_compiled(segs, wanted, PayloadRoot(tmp_path), 8, PAYLOAD_FIELDS, {}) is None
    with pytest.raises(PayloadWidthError):
        read_fields(segs, wanted, root=tmp_path, width=8)
    with pytest.raises(PayloadWidthError):
        planned(segs, wanted, root=tmp_path, width=8)
    # at the records' widest row the kernel takes it, and reads what the planned reader reads
    widest = planned(segs, wanted, root=tmp_path)["sampling_mask"].widest
    assert widest == 300  # a row of 300 kept ids (its sampled token's slot included)
    fast = read_compiled(segs, wanted, PayloadRoot(tmp_path), widest, PAYLOAD_FIELDS, {})
    assert fast is not None
    same_as_planned(fast, planned(segs, wanted, root=tmp_path, width=widest), widest)
    assert (
        read_compiled(segs, wanted, PayloadRoot(tmp_path), widest - 1, PAYLOAD_FIELDS, {}) is None
    )
