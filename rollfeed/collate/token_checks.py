"""TokenChecks: facts about a micro batch's values, recorded on the CPU while it is built.

:func:`rollfeed.collate.to_tensor_micro_batch` builds every micro batch from NumPy arrays on the CPU
(in a loader worker). The values a scorer must check against its model — token ids against the
vocabulary ``[0, V)``, temperatures against ``> 0`` — are cheap to find there and costly later:
reading a device tensor back waits for the device. They are recorded as plain Python values, which
``.to()``, ``.pin_memory()``, ``apply``, pickling and the workers' shared-memory transfer carry
unchanged, so a scorer compares them with its vocabulary size without touching a tensor.

Example, samples ``[5, 6, 7]`` and ``[8, 9]`` in one row of 6 (cp_size 1), no support::

    input_ids [5, 6, 7, 8, 9, 0]   labels [6, 7, -100, 9, -100, -100]
    max_id  = 9 in input_ids at row position 4 (sample 1, token 1)
    min_id  = 0 in input_ids at row position 5 (padding)
    bad_temperature = None
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollfeed.collate.micro_batch import MicroBatch
from rollfeed.payload import RaggedRows

# The payload field whose values are token ids: the recorded sampling support.
SUPPORT_FIELD = "sampling_mask"


@dataclass(frozen=True, kw_only=True, slots=True)
class Located:
    """One value and where the collator found it.

    ``tensor``: ``"input_ids"``, ``"labels"``, ``"sampling_mask"`` or ``"temperatures"``.
    ``pos``: row position in the whole packed row (for labels, the support and temperatures: the
    label coordinate, i.e. the prediction of token ``pos + 1``). ``sample``: the sample's ``uid``,
    else its index in the batch; ``None`` on padding. ``token``: index in that sample of the token
    itself (``input_ids``) or of the sampled token (the others).
    """

    value: int | float
    tensor: str
    pos: int
    sample: int | str | None = None
    token: int | None = None

    def __str__(self) -> str:
        where = f"{self.tensor} at row position {self.pos}"
        if self.sample is None:
            return f"{where} (padding)"
        return f"{where} (sample {self.sample}, token {self.token})"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenChecks:
    """What one CP rank's micro batch holds, as plain Python values.

    ``max_id``: the largest token id in this rank's ``input_ids``, real ``labels`` and support ids
    (``-1`` padding aside). ``min_id``: the smallest in ``input_ids`` and real ``labels``. Both
    ``None`` when the rank holds no id. ``bad_temperature``: the first row that is scored
    (loss-bearing, or holding a recorded support) whose temperature is not finite and ``> 0``,
    ``None`` when every such row's is; rows that are not scored may hold anything.
    """

    max_id: Located | None
    min_id: Located | None
    bad_temperature: Located | None

    @property
    def temperatures_valid(self) -> bool:
        return self.bad_temperature is None


def _locate(mb: MicroBatch, tensor: str, value: int | float, pos: int) -> Located:
    starts = np.asarray(mb.starts, np.int64)
    i = int(np.searchsorted(starts, pos, side="right")) - 1
    if i < 0 or pos >= starts[i] + len(mb.samples[i]):
        return Located(value=value, tensor=tensor, pos=pos)
    sample = mb.samples[i]
    token = pos - int(starts[i]) + (tensor != "input_ids")
    who = sample.uid if sample.uid is not None else mb.indices[i]
    return Located(value=value, tensor=tensor, pos=pos, sample=who, token=token)


def _extreme(
    mb: MicroBatch, tensor: str, values: np.ndarray, pos: np.ndarray, pick
) -> Located | None:
    if values.size == 0:
        return None
    k = int(pick(values))
    return _locate(mb, tensor, int(values[k]), int(pos[k]))


def token_checks(
    mb: MicroBatch,
    idx: np.ndarray,
    *,
    input_ids: np.ndarray,
    labels: np.ndarray,
    has_label: np.ndarray,
    loss_mask: np.ndarray,
    temperatures: np.ndarray,
    support: RaggedRows | None,
    support_whole: bool,
) -> TokenChecks:
    """The :class:`TokenChecks` of the rank holding row positions ``idx [N]``.

    ``input_ids, labels, has_label, loss_mask, temperatures``: whole-row arrays ``[S]`` in label
    coordinates (``has_label``: the row has a real label). ``support``: the support field's
    rows, ``N`` at ``idx`` or ``S`` over the whole row (``support_whole``), ``-1`` an id not
    recorded (a label slot left at the fill); ``None`` when absent.
    """
    candidates = [_extreme(mb, "input_ids", input_ids[idx], idx, np.argmax)]
    lows = [_extreme(mb, "input_ids", input_ids[idx], idx, np.argmin)]
    label_pos = idx[has_label[idx]]
    candidates.append(_extreme(mb, "labels", labels[label_pos], label_pos, np.argmax))
    lows.append(_extreme(mb, "labels", labels[label_pos], label_pos, np.argmin))
    scored = loss_mask[idx].copy()
    if support is not None:
        offsets, ids = support.offsets.numpy(), support.values.numpy()
        rows_pos = np.arange(support.n_rows) if support_whole else idx
        present = ids >= 0
        if present.any():
            k = int(np.argmax(np.where(present, ids, -1)))
            row = int(np.searchsorted(offsets, k, side="right")) - 1
            candidates.append(_locate(mb, SUPPORT_FIELD, int(ids[k]), int(rows_pos[row])))
        row_of = np.repeat(np.arange(support.n_rows), np.diff(offsets))
        with_support = np.bincount(row_of[present], minlength=support.n_rows) > 0
        scored |= with_support[idx] if support_whole else with_support
    found = [c for c in candidates if c is not None]
    low = [c for c in lows if c is not None]
    t = temperatures[idx]
    bad = scored & ~(np.isfinite(t) & (t > 0))
    bad_temperature = None
    if bad.any():
        k = int(np.argmax(bad))
        bad_temperature = _locate(mb, "temperatures", float(t[k]), int(idx[k]))
    return TokenChecks(
        # max()/min() keep the first of equal values: input_ids, then labels, then the support.
        max_id=max(found, key=lambda c: c.value) if found else None,
        min_id=min(low, key=lambda c: c.value) if low else None,
        bad_temperature=bad_temperature,
    )
