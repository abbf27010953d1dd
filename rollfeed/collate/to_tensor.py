"""to_tensor_micro_batch: one CP rank's tensors for one planned micro batch.

Token streams are laid out on the whole row first (labels, loss mask, advantages, logprobs and
temperatures shifted to label coordinates there, so no label crosses a sample or a rank boundary),
then cut to the rank's positions. Payload fields are read over each field's window
(:func:`rollfeed.collate.cp.field_ranges`): by handle with one :func:`rollfeed.payload.read_fields`
call per micro batch (every field's ranges grouped per file), and
cut from inline arrays with the same rules, so the two give bitwise equal tensors:

- uncovered positions (padding, a sample's position 0 for ``labels`` fields, row position ``S``)
  read as the field's fill;
- a ragged field is ``[n, W]`` with ``W = max(1, widest row of the field in the micro batch)``
  (after truncation and the ``labels`` clip), or ``width`` when given; the same on every CP rank;
- fixed-width inline fields keep their dtype (the writer stores the smallest integer dtype that
  holds values and fill, e.g. uint8 routing ids: give inline arrays that dtype to match).

Fixed-width ``inputs``-window fields also get their coverage (``TensorMicroBatch.coverage``:
which rows came from records or inline rows, which are fill), the same by handle and inline.

Shapes and a worked example: :mod:`rollfeed.collate.tensor_batch`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from rollfeed.collate.cp import field_ranges, ranges_index, rank_ranges
from rollfeed.collate.errors import BatchConfigError, SampleDtypeError
from rollfeed.collate.kept_rows import canonical_inline, with_labels
from rollfeed.collate.micro_batch import MicroBatch
from rollfeed.collate.tensor_batch import IGNORE_INDEX, TensorMicroBatch
from rollfeed.collate.token_checks import SUPPORT_FIELD, token_checks
from rollfeed.payload import FieldRead, PayloadRoot, read_fields
from rollfeed.payload.errors import PayloadWidthError


def _rows(mb: MicroBatch, name: str, labels: bool):
    """(row position of the first row, data) per sample holding ``name`` inline."""
    for i, (sample, start) in enumerate(zip(mb.samples, mb.starts, strict=True)):
        data = sample.fields.get(name)
        if data is None:
            continue
        if mb.config.fields[name].label is not None:  # kept sets: the canonical row order
            fields = mb.config.fields
            data = canonical_inline(sample.fields, name, fields, sample.token_ids, mb.indices[i])
        if labels:  # position 0 of a sample is never a label
            if isinstance(data, tuple):
                data = (data[0][1:], data[1][int(data[0][:1].sum()) :])
            else:
                data = data[1:]
        yield i, start + int(labels), data


def _inline_fixed(mb, name, spec, rows, idx) -> torch.Tensor:
    dtype, shape = rows[0][2].dtype, rows[0][2].shape[1:]
    for i, _, arr in rows:
        if arr.dtype != dtype or arr.shape[1:] != shape:
            raise SampleDtypeError(
                f"inline rows {arr.dtype}{list(arr.shape[1:])} differ from another sample's "
                f"{dtype}{list(shape)} in this micro batch",
                sample=mb.indices[i],
                field=name,
            )
    full = np.full((mb.length + 1, *shape), spec.fill, dtype=dtype)
    for _, at, arr in rows:
        full[at : at + len(arr)] = arr
    return torch.from_numpy(full[idx])


def _inline_ragged(mb, name, spec, rows, idx, width) -> torch.Tensor:
    widest, where = 0, None
    for _, at, (counts, _) in rows:
        if counts.size and int(counts.max()) > widest:
            widest, where = int(counts.max()), at + int(np.argmax(counts))
    if width is not None and widest > width:
        raise PayloadWidthError(
            f"a row holds {widest} values, wider than width={width}; raise width or pass None",
            field=name,
            pos=where,
        )
    W = width if width is not None else max(1, widest)
    full = np.full((mb.length + 1, W), spec.fill, dtype=spec.ragged_dtype)
    for _, at, (counts, values) in rows:
        row = np.repeat(np.arange(at, at + len(counts)), counts)
        col = np.arange(len(values)) - np.repeat(np.cumsum(counts) - counts, counts)
        full[row, col] = values
    return torch.from_numpy(full[idx])


def _merge(name, spec, handle, inline, owned) -> torch.Tensor:
    """Inline rows where an inline sample sits, by-handle rows elsewhere (both read fill there)."""
    if spec.ragged and handle.shape[1] != inline.shape[1]:
        W = max(handle.shape[1], inline.shape[1])
        handle, inline = (
            torch.nn.functional.pad(t, (0, W - t.shape[1]), value=spec.fill)
            for t in (handle, inline)
        )
    dtype = torch.promote_types(handle.dtype, inline.dtype)
    keep = torch.from_numpy(owned).reshape(-1, *[1] * (handle.dim() - 1))
    return torch.where(keep, inline.to(dtype), handle.to(dtype))


def _read_handles(mb, segments, ranges, *, whole, root, width, fields) -> dict[str, FieldRead]:
    """Every by-handle field of the micro batch over its own window, in one read."""
    if not segments:
        return {}
    if root is None:
        raise BatchConfigError(
            "micro batch holds payload segments; pass root= (the payload root)",
            field=min(segments),
        )
    windows = {n: field_ranges(ranges, fields[n].window, mb.length, whole=whole) for n in segments}
    every = [s for segs in segments.values() for s in segs]
    return read_fields(every, windows, root=root, width=width, fields=fields)


def _field(mb, reads, name, spec, ranges, *, whole, width) -> torch.Tensor:
    window = field_ranges(ranges, spec.window, mb.length, whole=whole)
    idx = ranges_index(window)
    labels = spec.window == "labels"
    rows = list(_rows(mb, name, labels))
    inline = handle = None
    if rows:
        if spec.ragged:
            inline = _inline_ragged(mb, name, spec, rows, idx, width)
        else:
            inline = _inline_fixed(mb, name, spec, rows, idx)
    if name in reads:
        handle = reads[name].values
        if spec.label == "omitted":  # stored without each row's sampled token: put it back
            tokens = np.zeros(mb.length + 1, np.int64)
            for sample, start in zip(mb.samples, mb.starts, strict=True):
                tokens[start : start + len(sample)] = sample.token_ids
            cover = reads[name].coverage.numpy()
            handle = with_labels(handle, cover, tokens[idx])
    if inline is None:
        return handle
    if handle is None:
        return inline
    owned = np.zeros(mb.length + 1, bool)
    for _, at, data in rows:
        owned[at : at + len(data[0] if isinstance(data, tuple) else data)] = True
    return _merge(name, spec, handle, inline, owned[idx])


def _coverage(mb, reads, name, spec, ranges, *, whole) -> torch.Tensor:
    """``[n]`` bool over the field's window: a by-handle record's row or an inline row is there
    (the read's :class:`~rollfeed.payload.FieldRead` coverage, or'ed with the inline rows)."""
    idx = ranges_index(field_ranges(ranges, spec.window, mb.length, whole=whole))
    owned = np.zeros(mb.length + 1, bool)
    for _, at, data in _rows(mb, name, spec.window == "labels"):
        owned[at : at + len(data)] = True
    covered = torch.from_numpy(owned[idx])
    if name in reads:
        covered |= reads[name].coverage.to(torch.bool)
    return covered


def to_tensor_micro_batch(
    micro_batch: MicroBatch,
    *,
    cp_rank: int,
    root: PayloadRoot | str | os.PathLike[str] | None = None,
    width: int | None = None,
    whole_fields: bool = False,
) -> TensorMicroBatch:
    """The tensors of ``cp_rank`` (see :class:`TensorMicroBatch` for shapes and an example).

    CP size and layout and the field registry are read from ``micro_batch.config``, never asked.

    Args:
        micro_batch: a planned micro batch (``prepare_batch`` or ``place_micro_batch``).
        cp_rank: this rank's ``cp`` coordinate, in ``[0, cp_size)`` (else BatchConfigError).
        root: payload root for by-handle fields (not needed when every field is inline).
        width: static ragged width (default: the micro batch's widest row).
        whole_fields: read every field over the whole row (models that shard in the forward).

    ``checks`` records the largest and smallest token id and the first invalid temperature of a
    scored row (:mod:`rollfeed.collate.token_checks`).
    """
    mb, S, config = micro_batch, micro_batch.length, micro_batch.config
    fields = config.fields
    ranges = rank_ranges(mb.cu_seqlens, cp_rank, config.cp_size, config.cp_layout)
    idx = ranges_index(ranges)
    ids = np.zeros(S, np.int64)
    labels = np.full(S, IGNORE_INDEX, np.int64)
    mask = np.zeros(S, bool)
    has_label = np.zeros(S, bool)
    adv, logp = np.zeros(S, np.float32), np.zeros(S, np.float32)
    temp = np.ones(S, np.float32)
    for s, a in zip(mb.samples, mb.starts, strict=True):
        T = len(s)
        ids[a : a + T] = s.token_ids
        labels[a : a + T - 1] = s.token_ids[1:]
        has_label[a : a + T - 1] = True
        mask[a : a + T - 1] = s.loss_mask[1:]
        adv[a : a + T - 1] = s.advantages[1:]
        logp[a : a + T - 1] = s.inference_logprobs[1:]
        if s.temperatures is not None:
            temp[a : a + T - 1] = s.temperatures[1:]
    cu = np.asarray(mb.cu_seqlens, np.int64)
    pos = np.arange(S) - np.repeat(cu[:-1], np.diff(cu))
    segments = mb.segments
    names = sorted({*segments, *(k for s in mb.samples for k in s.fields)})
    reads = _read_handles(
        mb, segments, ranges, whole=whole_fields, root=root, width=width, fields=fields
    )
    out, coverage = {}, {}
    for name in names:
        t = _field(mb, reads, name, fields[name], ranges, whole=whole_fields, width=width)
        if t is not None:
            out[name] = t
        if t is not None and not fields[name].ragged and fields[name].window == "inputs":
            coverage[name] = _coverage(mb, reads, name, fields[name], ranges, whole=whole_fields)
    checks = token_checks(
        mb,
        idx,
        input_ids=ids,
        labels=labels,
        has_label=has_label,
        loss_mask=mask,
        temperatures=temp,
        support=out.get(SUPPORT_FIELD),
        support_whole=whole_fields,
    )
    return TensorMicroBatch(
        input_ids=torch.from_numpy(ids[idx]),
        position_ids=torch.from_numpy(pos[idx]),
        labels=torch.from_numpy(labels[idx]),
        loss_mask=torch.from_numpy(mask[idx]),
        advantages=torch.from_numpy(adv[idx]),
        inference_logprobs=torch.from_numpy(logp[idx]),
        temperatures=torch.from_numpy(temp[idx]),
        positions=torch.from_numpy(idx),
        seq_lens=torch.from_numpy(np.array([len(s) for s in mb.samples], np.int32)),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        seq_len=S,
        cp_rank=cp_rank,
        cp_size=config.cp_size,
        cp_layout=config.cp_layout,
        fields=out,
        fields_whole=whole_fields,
        coverage=coverage,
        checks=checks,
    )
