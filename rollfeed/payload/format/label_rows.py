"""The canonical order of kept-set rows: the sampled token first, then the other ids ascending.

One function, used by the writer (which then stores a ``label="omitted"`` field without the
first id of each row) and by the inline path of the micro batch builder, so a field written by
handle and the same field carried inline come out bitwise equal.

Worked example (three rows, sampled tokens ``[40, 7, 5]``)::

    counts [3, 1, 0], ids [7, 40, 3, 7], sampled [40, 7, 5]
    -> counts [3, 1, 0], order [1, 2, 0, 3]   (rows [40, 3, 7] and [7]; ids[order])
    aligned values (logprobs) v: v[order] keeps them on their ids.

A row holding its sampled token more than once keeps one (the first); its other copies leave the
row (and their aligned values with them), so the token stands once, at column 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.fields import PayloadField, lookup_field
from rollfeed.payload.format.layout import check_ragged


@dataclass(frozen=True, kw_only=True, slots=True)
class CanonicalRows:
    """``counts [R]``: row lengths after the order (repeated sampled tokens dropped);
    ``order [sum(counts)]``: the index into the given ids (and any values aligned with them) of
    each canonical entry, row after row; ``missing``: the rows ``[k]`` with at least one id that do
    not hold their sampled token (their ids keep ascending order, with no sampled token first)."""

    counts: np.ndarray
    order: np.ndarray
    missing: np.ndarray


def canonical_rows(counts: np.ndarray, ids: np.ndarray, sampled: np.ndarray) -> CanonicalRows:
    """The canonical order of CSR rows ``(counts [R], ids [sum(counts)])`` whose sampled tokens
    are ``sampled [R]`` (see the module doc). Pure NumPy, one sort."""
    counts = np.asarray(counts, np.int64)
    ids = np.asarray(ids)
    sampled = np.asarray(sampled, np.int64)
    row = np.repeat(np.arange(counts.size), counts)
    hit = ids == sampled[row]
    # The first hit of each row is its label; a later hit is a repeat, dropped.
    hits = np.flatnonzero(hit)
    first = np.ones(hits.size, bool)
    first[1:] = row[hits[1:]] != row[hits[:-1]]
    label = np.zeros(ids.size, bool)
    label[hits[first]] = True
    keep = ~hit | label
    order = np.lexsort((ids, ~label, row))  # by row, the label first, then ids ascending
    order = order[keep[order]]
    member = np.zeros(counts.size, bool)
    member[row[hits]] = True
    dropped = np.bincount(row[hit & ~label], minlength=counts.size)
    return CanonicalRows(
        counts=counts - dropped,
        order=order,
        missing=np.flatnonzero((counts > 0) & ~member),
    )


def canonical_arrays(
    arrays: Mapping[str, np.ndarray | tuple[np.ndarray, np.ndarray]],
    sampled: np.ndarray | None,
    fields: Mapping[str, PayloadField],
) -> Mapping[str, np.ndarray | tuple[np.ndarray, np.ndarray]]:
    """The writer's ``arrays`` with the kept-set fields (``PayloadField.label``) in canonical
    order, the ``label="omitted"`` one without its sampled tokens ``sampled [rows]``; a row
    without its sampled token (or empty), a missing ``sampled`` or misaligned values are a
    :class:`PayloadInputError` naming the field and the row."""
    kept = {n: lookup_field(n, fields).label for n in arrays}
    kept = {n: label for n, label in kept.items() if label is not None}
    if not kept:
        return arrays
    omitted = [n for n, label in kept.items() if label == "omitted"]
    first = min(kept)
    if len(omitted) != 1:
        raise PayloadInputError(
            f"kept-set fields {sorted(kept)} follow the ids of one label='omitted' field written "
            f"in the same call; got {len(omitted)} of them: write them together",
            field=first,
        )
    ids_name = omitted[0]
    for name in kept:
        if not (isinstance(arrays[name], tuple) and len(arrays[name]) == 2):
            raise PayloadInputError(
                f"ragged field {name!r} needs a (counts, values) pair", field=name
            )
    try:
        counts, ids = check_ragged(*arrays[ids_name], is_int=True)
    except PayloadInputError as err:
        raise err.with_place(field=ids_name) from None
    if ids.size and ids.dtype.kind not in "iu":
        raise PayloadInputError(
            f"field {ids_name!r} holds integer values, got dtype {ids.dtype}", field=ids_name
        )
    if sampled is None:
        raise PayloadInputError(
            f"field {ids_name!r} stores kept sets without their sampled token: pass sampled= "
            "(the sampled token of each row)",
            field=ids_name,
        )
    sampled = np.asarray(sampled)
    if sampled.shape != counts.shape or (sampled.size and sampled.dtype.kind not in "iu"):
        raise PayloadInputError(
            f"sampled must be integer [rows] = {list(counts.shape)}, got {sampled.dtype} "
            f"{list(sampled.shape)}",
            field=ids_name,
        )
    rows = canonical_rows(counts, ids, sampled)
    bad = np.union1d(rows.missing, np.flatnonzero(counts == 0))
    if bad.size:
        r = int(bad[0])
        held = ids[int(counts[:r].sum()) :][: int(counts[r])].tolist()
        raise PayloadInputError(
            f"row {r} of {ids_name!r} holds ids {held}, without its sampled token "
            f"{int(sampled[r])}: every kept set holds the token sampled from it (capture adds "
            "it, or takes the token out of the loss)",
            field=ids_name,
        )
    out = dict(arrays)
    lead = np.cumsum(rows.counts) - rows.counts  # each row's sampled token, in canonical order
    rest = np.ones(rows.order.size, bool)
    rest[lead] = False
    out[ids_name] = (rows.counts - 1, ids[rows.order[rest]])
    for name in kept:
        if name == ids_name:
            continue
        c, v = (np.asarray(a) for a in arrays[name])
        if c.shape != counts.shape or (c != counts).any() or v.ndim != 1 or v.size != ids.size:
            raise PayloadInputError(
                f"field {name!r} holds one value per id of {ids_name!r}: its counts must be "
                f"{ids_name!r}'s and its values {ids.size}",
                field=name,
            )
        out[name] = (rows.counts, v[rows.order])
    return out
