"""to_tensor_micro_batch: one CP rank's tensors for one planned micro batch.

Token streams are laid out on the whole row first (labels, loss mask, advantages, logprobs,
temperatures and policy versions shifted to label coordinates there, so no label crosses a sample
or a rank boundary), then cut to the rank's positions. Payload fields are read over each field's
window (:func:`rollfeed.collate.cp.field_ranges`): by handle with one
:func:`rollfeed.payload.read_fields` call per micro batch (every field's ranges grouped per file),
and cut from inline arrays with the same rules, so the two give bitwise equal tensors:

- uncovered positions (padding, a sample's position 0 for ``labels`` fields, row position ``S``)
  read as the field's fill, and as empty rows of a ragged field;
- a ragged field is :class:`~rollfeed.payload.RaggedRows` over the window (a kept set with its
  sampled token first: the read puts it in the label slot), or ``[n, width]`` padded with the
  fill when ``width`` is given; a row of the micro batch wider than ``width``, in the window or
  not (every CP rank decides alike), is a :class:`~rollfeed.payload.PayloadWidthError`;
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
from rollfeed.collate.kept_rows import canonical_inline
from rollfeed.collate.micro_batch import MicroBatch
from rollfeed.collate.tensor_batch import IGNORE_INDEX, TensorMicroBatch
from rollfeed.collate.to_tensor_media import media_batch
from rollfeed.collate.token_checks import SUPPORT_FIELD, token_checks
from rollfeed.collate.versions import NO_VERSION, token_versions
from rollfeed.payload import FieldRead, ImageProcessorSpec, PayloadRoot, RaggedRows, read_fields
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


def _inline_ragged(mb, spec, rows, idx) -> tuple[RaggedRows, int, int | None]:
    """The inline rows over the window (``idx``), with the widest inline row of the micro batch
    (window or not) and its row position."""
    lengths = np.zeros(mb.length + 1, np.int64)
    widest, where = 0, None
    for _, at, (counts, _) in rows:
        lengths[at : at + len(counts)] = counts
        if counts.size and int(counts.max()) > widest:
            widest, where = int(counts.max()), at + int(np.argmax(counts))
    values = np.concatenate([v for *_, (_, v) in rows]).astype(spec.ragged_dtype, copy=False)
    whole = RaggedRows.from_lengths(torch.from_numpy(lengths), torch.from_numpy(values))
    return whole.take(torch.from_numpy(idx)), widest, where


def _merge(handle, inline, owned) -> torch.Tensor:
    """Inline rows where an inline sample sits, by-handle rows elsewhere (both read fill there)."""
    dtype = torch.promote_types(handle.dtype, inline.dtype)
    keep = torch.from_numpy(owned).reshape(-1, *[1] * (handle.dim() - 1))
    return torch.where(keep, inline.to(dtype), handle.to(dtype))


def _merge_rows(handle: RaggedRows, inline: RaggedRows, owned: np.ndarray) -> RaggedRows:
    """Inline rows where an inline sample sits (``owned [n]``), by-handle rows elsewhere."""
    n = handle.n_rows
    both = RaggedRows(
        torch.cat([handle.offsets, inline.offsets[1:] + handle.nnz]),
        torch.cat([handle.values, inline.values]),
    )
    return both.take(torch.from_numpy(np.where(owned, np.arange(n) + n, np.arange(n))))


def _read_handles(mb, segments, ranges, *, whole, root, fields) -> dict[str, FieldRead]:
    """Every by-handle field of the micro batch over its own window, in one read; each kept
    set's label slot holds the token sampled there."""
    if not segments:
        return {}
    if root is None:
        raise BatchConfigError(
            "micro batch holds payload segments; pass root= (the payload root)",
            field=min(segments),
        )
    windows = {n: field_ranges(ranges, fields[n].window, mb.length, whole=whole) for n in segments}
    tokens = np.zeros(mb.length + 1, np.int64)  # row position S: past the row, never covered
    for sample, start in zip(mb.samples, mb.starts, strict=True):
        tokens[start : start + len(sample)] = sample.token_ids
    labels = {
        n: tokens[ranges_index(w)] for n, w in windows.items() if fields[n].label == "omitted"
    }
    every = [s for segs in segments.values() for s in segs]
    return read_fields(every, windows, root=root, fields=fields, labels=labels)


def _field(mb, reads, name, spec, ranges, *, whole, root, width):
    window = field_ranges(ranges, spec.window, mb.length, whole=whole)
    idx = ranges_index(window)
    labels = spec.window == "labels"
    rows = list(_rows(mb, name, labels))
    owned = np.zeros(mb.length + 1, bool)
    for _, at, data in rows:
        owned[at : at + len(data[0] if isinstance(data, tuple) else data)] = True
    handle = reads[name].values if name in reads else None
    if not spec.ragged:
        inline = _inline_fixed(mb, name, spec, rows, idx) if rows else None
        if inline is None or handle is None:
            return handle if inline is None else inline
        return _merge(handle, inline, owned[idx])
    widest, where = (reads[name].widest, None) if name in reads else (0, None)
    if rows:
        inline, inline_widest, inline_where = _inline_ragged(mb, spec, rows, idx)
        handle = inline if handle is None else _merge_rows(handle, inline, owned[idx])
        if inline_widest > widest:
            widest, where = inline_widest, inline_where
    if width is not None and widest > width:
        _width_error(mb, name, width, widest, where, root=root)
    return handle


def _width_error(mb, name, width, widest, where, *, root):
    """A row of ``widest`` values wider than ``width``: an inline one at row position
    ``where``, else a by-handle one, which the reader names (file, offset, position)."""
    if where is None:
        read_fields(
            mb.segments[name], {name: (0, 1)}, root=root, width=width, fields=mb.config.fields
        )
    raise PayloadWidthError(
        f"a row holds {widest} values, wider than width={width}; raise width or pass None",
        field=name,
        pos=where,
    )


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
    image_processor: ImageProcessorSpec | None = None,
) -> TensorMicroBatch:
    """The tensors of ``cp_rank`` (see :class:`TensorMicroBatch` for shapes and an example).

    CP size and layout and the field registry are read from ``micro_batch.config``, never asked.

    Args:
        micro_batch: a planned micro batch (``prepare_batch`` or ``place_micro_batch``).
        cp_rank: this rank's ``cp`` coordinate, in ``[0, cp_size)`` (else BatchConfigError).
        root: payload root for by-handle fields (not needed when every field is inline).
        width: ragged fields as ``[n, width]`` padded with their fill (default: as
            :class:`~rollfeed.payload.RaggedRows`).
        whole_fields: read every field over the whole row (models that shard in the forward).
        image_processor: the model's image processor, for micro batches with images: this
            rank's :class:`~rollfeed.collate.MediaBatch` (``media``: mRoPE positions, the
            row's images and the pixels of those this rank encodes, read by handle from
            ``root``; :mod:`rollfeed.collate.to_tensor_media`). Text-only micro batches have
            ``media=None`` and need none.

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
    versions = np.full(S, NO_VERSION, np.int32)
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
        if len(s.version_spans):
            versions[a : a + T - 1] = token_versions(s.version_spans, T)[1:]
    cu = np.asarray(mb.cu_seqlens, np.int64)
    pos = np.arange(S) - np.repeat(cu[:-1], np.diff(cu))
    segments = mb.segments
    names = sorted({*segments, *(k for s in mb.samples for k in s.fields)})
    reads = _read_handles(mb, segments, ranges, whole=whole_fields, root=root, fields=fields)
    out, coverage = {}, {}
    for name in names:
        spec = fields[name]
        t = _field(mb, reads, name, spec, ranges, whole=whole_fields, root=root, width=width)
        if t is not None:
            out[name] = t
        if t is not None and not spec.ragged and spec.window == "inputs":
            coverage[name] = _coverage(mb, reads, name, spec, ranges, whole=whole_fields)
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
    if width is not None:  # the padded form, checked against width above
        for name, t in out.items():
            if isinstance(t, RaggedRows):
                out[name] = t.padded(width, fill=fields[name].fill)
    media = media_batch(
        mb, idx, cp_rank=cp_rank, position_ids=pos, root=root, processor=image_processor
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
        versions=torch.from_numpy(versions[idx]),
        fields=out,
        fields_whole=whole_fields,
        coverage=coverage,
        step_counts=mb.step_counts,
        checks=checks,
        media=media,
    )
