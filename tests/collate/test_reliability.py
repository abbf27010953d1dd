"""Samples: values that cannot be trained on, sizes a record claims beyond the data it carries and
malformed records are typed errors naming sample, field and position (the collate page's loop,
dummies included, runs in tests/test_doc_blocks.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rollfeed.collate import (
    CollateError,
    Sample,
    SampleDtypeError,
    SampleLengthError,
)
from rollfeed.collate.errors import SampleValueError
from rollfeed.payload import PayloadSegment

README = Path(__file__).resolve().parents[2] / "README.md"
T = 6


def _sample(**kw) -> Sample:
    base = dict(
        token_ids=np.arange(T),
        loss_mask=np.array([0, 0, 1, 1, 0, 1], bool),
        advantages=np.full(T, 0.5, np.float32),
        inference_logprobs=np.full(T, -0.25, np.float32),
        temperatures=np.full(T, 0.7, np.float32),
        uid="s3",
    )
    return Sample(**{**base, **kw})


def _with(name: str, pos: int, value: float) -> np.ndarray:
    arr = np.full(T, 0.7 if name == "temperatures" else -0.25, np.float32)
    arr[pos] = value
    return arr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("advantages", math.nan),
        ("advantages", math.inf),
        ("inference_logprobs", -math.inf),
        ("inference_logprobs", math.nan),
        ("temperatures", 0.0),
        ("temperatures", -1.0),
        ("temperatures", math.nan),
        ("temperatures", math.inf),
    ],
)
def test_nan_advantage_on_loss_token_is_refused_naming_position(name, value):
    """Refused where loss_mask is 1 (position 3), naming sample, field and position; the same
    value where loss_mask is 0 (position 4) is allowed: that token bears no loss."""
    with pytest.raises(SampleValueError, match=rf"{name}\[3\].*loss-bearing") as err:
        _sample(**{name: _with(name, 3, value)})
    assert (err.value.sample, err.value.field, err.value.pos) == ("s3", name, 3)
    assert _sample(**{name: _with(name, 4, value)})  # off the loss: allowed


def test_advantage_overflowing_float32_on_a_loss_token_is_refused():
    """1e39 fits a JSON float but becomes inf in float32: refused, not trained on as inf."""
    record = json.loads(_sample().to_json())
    record["advantages"][5] = 1e39
    with pytest.raises(SampleValueError, match=r"advantages\[5\]") as err:
        Sample.from_json(json.dumps(record))
    assert err.value.pos == 5


def test_negative_token_id_is_refused_naming_position():
    with pytest.raises(SampleValueError, match="negative") as err:
        _sample(token_ids=np.array([3, 4, -1, 5, 6, 7]))
    assert (err.value.field, err.value.pos) == ("token_ids", 2)


def test_uint64_token_ids_beyond_int64_are_refused_not_wrapped():
    with pytest.raises(SampleValueError, match="outside int64"):
        _sample(token_ids=np.full(T, 2**63, np.uint64))


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3]",  # a JSON list
        '"a string"',
        "{not json",
        "[" * 100_000 + "]" * 100_000,  # deeper than the parser's recursion limit
        '{"token_ids": [1], "loss_mask": [0], "advantages": [0], "inference_logprobs": [0], '
        '"fields": {"sampling_mask": "counts"}}',  # a field record that is a string
        '{"token_ids": [1], "loss_mask": [0], "advantages": [0], "inference_logprobs": [0], '
        '"uid": {"a": 1}}',
    ],
    ids=["list", "string", "bad-json", "deep", "field-record-string", "uid-object"],
)
def test_malformed_sample_record_is_a_collate_error(text):
    with pytest.raises(CollateError):
        Sample.from_json(text)


def test_segments_of_one_field_disagreeing_on_row_shape_are_refused():
    """A zero-row placeholder claiming a huge row beside the field's real rows would size the
    fill of the whole micro batch."""
    live = PayloadSegment(
        field="routed_experts", file="a.rfp", offset=64, pos=0, rows=3, dtype="uint8", shape=(2, 2)
    )
    huge = live.model_copy(update={"pos": 3, "rows": 0, "dtype": "int64", "shape": (2**24 - 1,)})
    with pytest.raises(SampleDtypeError, match="row shape") as err:
        _sample(payload=[live, huge])
    assert (err.value.sample, err.value.field, err.value.pos) == ("s3", "routed_experts", 3)


_BOMBS = {
    # 25 tokens whose inline dtype is a sub-array of 2**24 int64: 3.12 GiB on parsing
    "subarray-dtype": {"dtype": "(16777216,)i8", "shape": [25, 16777216], "data": [0] * 25},
    # a string dtype of 2**28 characters per element
    "string-dtype": {"dtype": "U268435456", "shape": [25], "data": ["a"] * 25},
    # counts that sum to 2**64 wrap to 0 in int64 and match no values: W = 2**62
    "wrapping-counts": {"counts": [2**62] * 4 + [0] * 21, "values": []},
    # an empty dimension makes a huge row of no values
    "empty-dimension": {"dtype": "uint8", "shape": [25, 0, 2**40], "data": []},
}


def test_sample_claiming_huge_width_is_refused_before_allocating():
    """Each step-file line is parsed, planned and turned into tensors in a process limited to
    1 GiB of address space: every claim is a typed error, none a MemoryError."""
    script = textwrap.dedent(
        """
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from rollfeed.collate import (CollateError, PlanConfig, Sample, prepare_batch,
                                      to_tensor_micro_batch)
        base = {"token_ids": list(range(25)), "loss_mask": [0] + [1] * 24,
                "advantages": [0.5] * 25, "inference_logprobs": [-0.1] * 25}
        out = {}
        for name, field in json.loads(sys.stdin.read()).items():
            line = json.dumps({**base, "fields": {
                ("sampling_mask" if "counts" in field else "routed_experts"): field}})
            try:
                plan = prepare_batch([Sample.from_json(line)], PlanConfig(seq_len=32), dp_size=1)
                to_tensor_micro_batch(plan[0][0], cp_rank=0)
                out[name] = "accepted"
            except CollateError as err:
                out[name] = "typed " + type(err).__name__
            except BaseException as err:
                out[name] = "untyped " + type(err).__name__ + ": " + str(err)[:120]
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(_BOMBS),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=README.parent,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {
        "subarray-dtype": "typed SampleDtypeError",
        "string-dtype": "typed SampleDtypeError",
        "wrapping-counts": "typed SampleLengthError",
        "empty-dimension": "typed SampleLengthError",
    }
    assert got == want


def test_inline_data_out_of_its_dtype_range_is_refused():
    record = json.loads(_sample().to_json())
    record["fields"] = {"routed_experts": {"dtype": "uint8", "shape": [T], "data": [1] * 5 + [256]}}
    with pytest.raises(SampleValueError, match="uint8"):
        Sample.from_json(json.dumps(record))
    record["fields"]["routed_experts"]["data"] = [1.5] * T  # floats would truncate
    with pytest.raises(SampleDtypeError, match="integers"):
        Sample.from_json(json.dumps(record))


def test_ragged_row_claiming_more_values_than_given_names_the_row():
    counts = np.array([0, 1, 2**62, 2**62, 2**62, 2**62])
    with pytest.raises(SampleLengthError, match="more than the 1") as err:
        _sample(fields={"sampling_mask": (counts, np.array([7], np.int32))})
    assert (err.value.field, err.value.pos) == ("sampling_mask", 2)
