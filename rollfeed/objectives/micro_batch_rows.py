"""micro_batch_rows: a micro batch's kept sets and mask logprobs as rows aligned slot for slot.

``fields["sampling_mask"]`` is read over the ``labels`` window (row ``j`` is the kept set of label
``j``, this rank's ``N`` rows, the label first), ``fields["sampling_mask_logprobs"]`` over the
``sequence`` window (row ``p`` belongs to the token at row position ``p``, all ``S`` rows). Label
``j`` is the token at position ``positions[j] + 1``, so its mask logprobs are row
``positions[j] + 1`` of the field (none for ``positions[j] + 1 = S``, one past the row).

Either field is :class:`~rollfeed.collate.RaggedRows` (as the collator gives it) or padded
(``[n, W]`` from a collator given ``width=``, ids padded with ``-1``, logprobs with ``-inf``);
a padded kept set is taken as rows of ``W`` slots, as the scorers
take it, so the rows align with :attr:`rollfeed.models.SupportScores.support_logprobs`.

Example, ``S = 4``, cp 1: ``sampling_mask = [[6, 2], [7, -1], [-1, -1], [-1, -1]]``,
``sampling_mask_logprobs`` rows ``[[], [-0.1, -2.4], [-0.01, -inf], []]`` (position 0 is no label)
-> support rows of 2 slots, mask logprobs ``[[-0.1, -2.4], [-0.01, -inf], [], []]`` filled to
``[-inf, -inf]`` where a row has none (ragged: ``-inf`` written into the support's own slots).
"""

from __future__ import annotations

import torch

from rollfeed.collate import RaggedRows, TensorMicroBatch
from rollfeed.objectives.errors import ObjectiveInputError


def micro_batch_rows(mb: TensorMicroBatch) -> tuple[RaggedRows, RaggedRows]:
    """``(support, mask_logprobs)`` of this rank's ``N`` label rows (module doc); a micro batch
    without a field gives empty rows for it. Ragged in, ragged out: work and memory grow with the
    kept ids, never with ``N`` times the widest row, also when some rows have no mask logprobs
    (a sample written without them)."""
    n = mb.labels.numel()
    device = mb.labels.device
    support = _rows(mb.fields.get("sampling_mask"), n, device, torch.int32)
    field = mb.fields.get("sampling_mask_logprobs")
    if field is None:
        return support, _rows(None, n, device, torch.float32)
    held = field.n_rows if isinstance(field, RaggedRows) else field.shape[0]
    if mb.fields_whole or held != mb.seq_len:
        raise ObjectiveInputError(
            f"sampling_mask_logprobs must hold the micro batch's {mb.seq_len} rows (its sequence "
            f"window), got {held}{' (fields read whole)' if mb.fields_whole else ''}",
            tensor="sampling_mask_logprobs",
        )
    positions = mb.positions.to(device)
    outside = (positions < 0) | (positions >= mb.seq_len)
    if bool(outside.any()):
        j = int(torch.nonzero(outside)[0])
        raise ObjectiveInputError(
            f"positions[{j}] = {int(positions[j])} is outside the micro batch's {mb.seq_len} "
            "positions",
            tensor="positions",
            pos=j,
        )
    index = positions.long() + 1  # row S: one past the micro batch, no label
    if not isinstance(field, RaggedRows):
        blank = torch.full((1, field.shape[1]), float("-inf"), dtype=field.dtype, device=device)
        padded = torch.cat([field, blank])[index]
        short = support.width() - padded.shape[1]
        if short > 0:
            padded = torch.nn.functional.pad(padded, (0, short), value=float("-inf"))
        return support, RaggedRows.from_padded(padded, like=support)
    past = RaggedRows(torch.cat([field.offsets, field.offsets[-1:]]), field.values)
    taken = past.take(index)
    if torch.equal(taken.lengths(), support.lengths()):
        return support, taken
    return support, _aligned(taken, support)


def _aligned(taken: RaggedRows, support: RaggedRows) -> RaggedRows:
    """``taken``'s values in ``support``'s rows, slot for slot: a row's values in its first
    slots, ``-inf`` in the slots it does not reach (a row with none, or trimmed trailing
    ``-inf``); ``[nnz]`` of the support, no ``[N, W]``."""
    held, want = taken.lengths(), support.lengths()
    long = held > want
    if bool(long.any()):
        j = int(torch.nonzero(long)[0])
        raise ObjectiveInputError(
            f"sampling_mask_logprobs row of label {j} holds {int(held[j])} values for a kept set "
            f"of {int(want[j])} ids",
            tensor="sampling_mask_logprobs",
            pos=j,
        )
    row = taken.row_index()
    slot = support.offsets[row] + (torch.arange(taken.nnz, device=row.device) - taken.offsets[row])
    values = torch.full((support.nnz,), float("-inf"), dtype=taken.dtype, device=row.device)
    return support.with_values(values.index_copy(0, slot, taken.values))


def _rows(
    field: RaggedRows | torch.Tensor | None, n: int, device: torch.device, dtype: torch.dtype
) -> RaggedRows:
    if field is None:
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=device)
        return RaggedRows(offsets, torch.zeros(0, dtype=dtype, device=device))
    if isinstance(field, RaggedRows):
        return field
    width = field.shape[1]
    offsets = torch.arange(n + 1, dtype=torch.int64, device=device) * width
    return RaggedRows(offsets, field.reshape(-1))
