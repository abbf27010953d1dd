"""Kept sets in the micro batch: the canonical row order inline, the label put back by handle.

A field declared ``label="omitted"`` (the sampling mask) is stored by handle without each row's
sampled token and read back with column 0 at the fill (:mod:`rollfeed.payload.fields`). This
layer knows the tokens, so it puts the sampled token there: the token at the row's own position.
Inline kept sets are brought into the same canonical order (the sampled token first, then the
other ids ascending; values of a ``label="first"`` field follow their ids) with the same function
the writer uses (:func:`rollfeed.payload.canonical_rows`), so both paths give bitwise equal rows.

Worked example (tokens ``[5, 40, 7]``; the mask row of position 1 read by handle as
``[-1, 3, 9]``, covered)::

    with_labels([[-1, 3, 9]], coverage=[True], tokens=[40]) -> [[40, 3, 9]]
    inline row {9, 40, 3} at position 1, logprobs {9: -2.0, 40: -0.1, 3: -1.0}
      -> mask [40, 3, 9], logprobs [-0.1, -1.0, -2.0]
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rollfeed.collate.errors import KeptSetError
from rollfeed.payload import PayloadField, canonical_rows


def canonical_inline(
    fields: Mapping[str, tuple[np.ndarray, np.ndarray]],
    name: str,
    specs: Mapping[str, PayloadField],
    tokens: np.ndarray,
    sample: object,
) -> tuple[np.ndarray, np.ndarray]:
    """The inline rows ``(counts [T], values)`` of kept-set field ``name`` of one sample in
    canonical order; ``tokens [T]`` its token ids (the sampled token of each row); ``fields``
    its inline fields. A ``label="first"`` field follows the sample's inline ``label="omitted"``
    field. Raises :class:`KeptSetError` naming ``sample``, the field and the position."""
    spec = specs[name]
    if spec.label == "omitted":
        ids_name = name
    else:
        ids_name = next(
            (n for n in fields if specs[n].label == "omitted"),
            None,
        )
        if ids_name is None:
            raise KeptSetError(
                "inline kept-set values follow the ids of a label='omitted' field (the sampling "
                "mask) carried inline by the same sample; add it inline too",
                sample=sample,
                field=name,
            )
    counts, ids = fields[ids_name]
    rows = canonical_rows(counts, ids, tokens)
    if rows.missing.size:
        p = int(rows.missing[0])
        held = ids[int(counts[:p].sum()) :][: int(counts[p])].tolist()
        raise KeptSetError(
            f"the kept set {held} at position {p} does not hold the token sampled there "
            f"({int(tokens[p])}); every kept set holds its sampled token (capture adds it)",
            sample=sample,
            field=ids_name,
            pos=p,
        )
    if name == ids_name:
        return rows.counts, ids[rows.order]
    mine, values = fields[name]
    if mine.shape != counts.shape or (mine != counts).any():
        raise KeptSetError(
            f"inline rows must hold one value per id of {ids_name!r} (the same counts)",
            sample=sample,
            field=name,
        )
    return rows.counts, values[rows.order]


def with_labels(values: torch.Tensor, coverage: np.ndarray, tokens: np.ndarray) -> torch.Tensor:
    """Rows ``values [n, W]`` of a ``label="omitted"`` field read by handle, with each covered
    row's sampled token (``tokens [n]``: the token at the row's position) at column 0 (the
    stored rows never hold it: the writer leaves it out)."""
    out = values.numpy().copy()
    out[coverage, 0] = tokens.astype(out.dtype)[coverage]
    return torch.from_numpy(out)
