"""Kept sets in the micro batch: the canonical row order inline.

A field declared ``label="omitted"`` (the sampling mask) is stored by handle without each row's
sampled token and read back with a label slot first (:mod:`rollfeed.payload.fields`); this layer
knows the tokens and hands each row's own to the read (``read_fields(labels=)``). Inline kept
sets are brought into the same canonical order (the sampled token first, then the other ids
ascending; values of a ``label="first"`` field follow their ids) with the same function the
writer uses (:func:`rollfeed.payload.canonical_rows`), so both paths give bitwise equal rows.

Worked example (tokens ``[5, 40, 7]``; the mask row of position 1 stored by handle as
``[3, 9]``, read with ``labels`` as ``[40, 3, 9]``)::

    inline row {9, 40, 3} at position 1, logprobs {9: -2.0, 40: -0.1, 3: -1.0}
      -> mask [40, 3, 9], logprobs [-0.1, -1.0, -2.0]
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rollfeed.collate.errors import SupportSetError
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
    field. Raises :class:`SupportSetError` naming ``sample``, the field and the position."""
    spec = specs[name]
    if spec.label == "omitted":
        ids_name = name
    else:
        ids_name = next(
            (n for n in fields if specs[n].label == "omitted"),
            None,
        )
        if ids_name is None:
            raise SupportSetError(
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
        raise SupportSetError(
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
        raise SupportSetError(
            f"inline rows must hold one value per id of {ids_name!r} (the same counts)",
            sample=sample,
            field=name,
        )
    return rows.counts, values[rows.order]
