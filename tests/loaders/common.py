"""Shared helpers of the loader tests: data, the single-process reference, bitwise comparison."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rollfeed.collate import PlanConfig, TensorMicroBatch, prepare_batch, to_tensor_micro_batch
from rollfeed.payload import PayloadRoot, PayloadWriter, RaggedRows
from tests.collate.gen import make_batch

SEQ_LEN = 48  # a multiple of 2 * 4 (zigzag with cp 4)


def write_batch(root, n: int, seed: int, seq_len: int = SEQ_LEN):
    """By-handle samples (routing over two files, ragged masks) written under ``root``."""
    rng = np.random.default_rng(seed)
    with PayloadWriter(root, group="a") as wa, PayloadWriter(root, group="b") as wb:
        _, handle = make_batch(rng, n, seq_len, [wa, wb])
    return handle


def reference(samples, *, dp_size, cp_size, cp_layout, root, seq_len=SEQ_LEN, **kw):
    """``{(dp, cp): [TensorMicroBatch per micro step]}`` and the plan, in one process."""
    config = PlanConfig(seq_len=seq_len, cp_size=cp_size, cp_layout=cp_layout, **kw)
    plan = prepare_batch(samples, config, dp_size=dp_size)
    root = root if isinstance(root, PayloadRoot) else PayloadRoot(root)
    out = {
        (dp, cp): [to_tensor_micro_batch(mb, cp_rank=cp, root=root) for mb in plan[dp]]
        for dp in range(dp_size)
        for cp in range(cp_size)
    }
    return out, plan


def tensor_bytes(t: torch.Tensor | RaggedRows) -> tuple:
    """dtype, shape and bytes (a ragged field's: of its offsets and of its values)."""
    if isinstance(t, RaggedRows):
        return (*tensor_bytes(t.offsets), *tensor_bytes(t.values))
    return (t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes())


def assert_bitwise(a: TensorMicroBatch, b: TensorMicroBatch, where) -> None:
    """Every tensor equal in dtype, shape and bytes; every other attribute equal."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("fields", "coverage"):
            assert sorted(x) == sorted(y), (where, sorted(x), sorted(y))
            for k in x:
                assert tensor_bytes(x[k]) == tensor_bytes(y[k]), (where, k)
        elif isinstance(x, torch.Tensor):
            assert tensor_bytes(x) == tensor_bytes(y), (where, f.name)
        elif f.name == "media" and x is not None and y is not None:
            for g in dataclasses.fields(x):
                got, want = getattr(x, g.name), getattr(y, g.name)
                assert tensor_bytes(got) == tensor_bytes(want), (where, g.name)
        else:
            assert x == y, (where, f.name, x, y)
