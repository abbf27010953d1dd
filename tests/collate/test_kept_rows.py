"""Kept sets in the micro batch: the label put back by handle, the canonical order inline, as
ragged rows (uncovered rows empty), and a version-2 file (which kept the sampled token in the
row) refused, naming its version."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rollfeed.collate import (
    PlanConfig,
    Sample,
    SupportSetError,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.payload import PayloadSegment, PayloadWriter

FIXTURE = Path(__file__).parents[1] / "payload" / "fixtures"


def _tokens(T: int) -> dict:
    return dict(
        loss_mask=np.ones(T, bool),
        advantages=np.zeros(T, np.float32),
        inference_logprobs=np.zeros(T, np.float32),
    )


def _tensors(sample: Sample, root=None, width=None):
    (mb,) = prepare_batch([sample], PlanConfig(seq_len=8), dp_size=1)[0]
    return to_tensor_micro_batch(mb, cp_rank=0, root=root, width=width)


def test_by_handle_and_inline_kept_sets_give_the_same_canonical_rows(tmp_path):
    tokens = np.array([11, 40, 7, 5])
    counts = np.array([3, 1, 2])  # kept sets of positions 1..3, in no particular order
    ids = np.array([9, 40, 3, 7, 5, 1], np.int32)
    logp = np.array([-2.0, -0.1, -1.0, 0.0, -0.2, -1.7], np.float32)
    with PayloadWriter(tmp_path) as w:
        segs = w.write(
            {"sampling_mask": (counts, ids), "sampling_mask_logprobs": (counts, logp)},
            pos=1,
            sampled=tokens[1:],
        )
    full = np.concatenate([[0], counts])
    inline = Sample(
        tokens,
        **_tokens(4),
        fields={"sampling_mask": (full, ids), "sampling_mask_logprobs": (full, logp)},
    )
    a, b = _tensors(inline), _tensors(Sample(tokens, **_tokens(4), payload=segs), tmp_path)
    for name in ("sampling_mask", "sampling_mask_logprobs"):
        assert a.fields[name].dtype == b.fields[name].dtype
        assert a.fields[name].equal(b.fields[name]), name
    # labels window: row j holds the kept set of token j + 1, the sampled token first; the row
    # of position S (past the sample) is empty
    mask = a.fields["sampling_mask"]
    assert mask.offsets.tolist() == [0, 3, 4, 6, 6]
    assert mask.values.tolist() == [40, 3, 9, 7, 5, 1]
    lp = a.fields["sampling_mask_logprobs"]  # sequence window: own positions, 0 has none
    assert lp.offsets.tolist() == [0, 0, 3, 4, 6]
    want = np.float32([-0.1, -1.0, -2.0, 0.0, -0.2, -1.7])
    np.testing.assert_array_equal(lp.values.numpy(), want)
    padded = _tensors(Sample(tokens, **_tokens(4), payload=segs), tmp_path, width=4)
    assert padded.fields["sampling_mask"].tolist() == [
        [40, 3, 9, -1],
        [7, -1, -1, -1],
        [5, 1, -1, -1],
        [-1, -1, -1, -1],
    ]
    assert torch.equal(padded.fields["sampling_mask"], mask.padded(4))


def test_an_inline_kept_set_without_its_sampled_token_is_refused():
    sample = Sample(
        np.array([11, 40, 7]),
        **_tokens(3),
        fields={"sampling_mask": (np.array([0, 2, 1]), np.array([3, 40, 8], np.int32))},
        uid="u",
    )
    with pytest.raises(
        SupportSetError, match=r"\[8\] at position 2 does not hold .* \(7\)"
    ) as info:
        _tensors(sample)
    assert (info.value.field, info.value.pos) == ("sampling_mask", 2)


def test_a_version_2_file_is_refused_through_the_micro_batch_naming_its_version(tmp_path):
    """The checked-in version-2 file kept each sampled token in its (ascending) row: the micro
    batch refuses it with the typed error of the read, naming the file and its version."""
    from rollfeed.payload import PayloadHeaderError

    shutil.copytree(FIXTURE / "v2", tmp_path / "v2")
    saved = json.loads((FIXTURE / "v2" / "tiny.json").read_text())
    segs = [PayloadSegment.model_validate(s) for s in saved["segments"]]
    segs = [s for s in segs if s.field == "sampling_mask"]
    tokens = np.array(saved["tokens"])
    with pytest.raises(PayloadHeaderError, match="format version 2 ") as info:
        _tensors(Sample(tokens, **_tokens(len(tokens)), payload=segs), tmp_path)
    assert info.value.file == segs[0].file
