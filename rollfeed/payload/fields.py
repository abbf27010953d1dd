"""The fields registry: which per-token side channels exist and how each is read back.

A field is a name plus a :class:`PayloadField`. ``fill`` says both the value of an uncovered
position and the value kind (an ``int`` fill means integer values, a ``float`` fill float values);
``window`` says which positions a context-parallel rank reads:

- ``inputs``: the rank's own input positions (routing, consumed in the forward);
- ``labels``: the same positions shifted one ahead (a mask sits at the sampled token's position
  and label ``j`` is token ``j + 1``, so reading one ahead replaces shift-then-shard; position
  ``S``, one past the micro batch, reads as the fill);
- ``sequence``: the whole micro batch (consumed by the loss after a CP gather).

Kept sets (``label``): the sampled token of a position is always a member of that position's kept
set, and the trainer already has it as the label. A field declared ``label="omitted"`` (the
sampling mask) therefore stores each row without it: the other ids in ascending order, so a
singleton costs no value at all. It is read back with a label slot first in each row, holding
the token the reader is given (``read_fields(labels=)``) or the fill;
:func:`rollfeed.collate.to_tensor_micro_batch` (the layer that knows the labels) gives the row's
sampled token. Every row's canonical order is the sampled token first, then the others
ascending; a field declared ``label="first"`` (the mask logprobs) holds one value per id of the
``"omitted"`` field's row and is stored whole in that order. The writer applies the order (it is
given the sampled tokens), and so does the inline path (:func:`rollfeed.payload.canonical_rows`).
Example: tokens ``[.., 40, ..]``, kept set ``{7, 40, 3}`` at the position of 40 with logprobs
``{3: -2.0, 7: -1.5, 40: -0.1}`` -> stored mask row ``[3, 7]``, logprobs row ``[-0.1, -2.0, -1.5]``;
``to_tensor_micro_batch`` gives the mask row ``[40, 3, 7]``.

Adding a field is one call, ``register_field("my_field", PayloadField(fill=0, window="inputs"))``,
or one entry in your own mapping passed as ``fields=`` to the writer and reader; nothing else
changes.
Register at import time of a module your DataLoader workers also import, so spawned workers see it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rollfeed.payload.errors import PayloadFieldError, UnknownFieldError

Window = Literal["inputs", "labels", "sequence"]
WINDOWS: tuple[Window, ...] = ("inputs", "labels", "sequence")
Label = Literal["omitted", "first"]
LABELS: tuple[Label, ...] = ("omitted", "first")


@dataclass(frozen=True, kw_only=True, slots=True)
class PayloadField:
    """How one per-token field is stored and read.

    ``ragged=False``: fixed width, each row ``[*shape]``; read back as ``[n, *shape]``.
    ``ragged=True``: a variable-length row per token (CSR); read back as
    :class:`~rollfeed.payload.RaggedRows` (or ``[n, width]`` padded with fill), values ``int32``
    for an int fill and ``float32`` for a float fill.
    ``label`` (ragged only; module doc): ``"omitted"`` for kept-set ids stored without the
    sampled token (read back with a label slot first in each row), ``"first"`` for values
    aligned with them (the sampled token's value first); ``None`` for rows stored as given.
    """

    fill: int | float
    window: Window
    ragged: bool = False
    label: Label | None = None

    def __post_init__(self) -> None:
        if isinstance(self.fill, bool) or not isinstance(self.fill, int | float):
            raise PayloadFieldError(
                f"PayloadField fill must be an int or a float, got {self.fill!r}"
            )
        if self.window not in WINDOWS:
            raise PayloadFieldError(
                f"PayloadField window must be one of {WINDOWS}, got {self.window!r}"
            )
        if isinstance(self.fill, float) and math.isnan(self.fill):
            raise PayloadFieldError(
                "PayloadField fill must not be NaN (it would never compare equal)"
            )
        if self.label is not None and (self.label not in LABELS or not self.ragged):
            raise PayloadFieldError(
                f"PayloadField label must be one of {LABELS} on a ragged field, or None; got "
                f"{self.label!r} (ragged={self.ragged})"
            )
        if self.label == "omitted" and not isinstance(self.fill, int):
            raise PayloadFieldError("PayloadField label='omitted' holds token ids: an int fill")

    @property
    def is_int(self) -> bool:
        return isinstance(self.fill, int)

    @property
    def ragged_dtype(self) -> np.dtype:
        """Stored and returned dtype of a ragged field's values."""
        return np.dtype("<i4") if self.is_int else np.dtype("<f4")


PAYLOAD_FIELDS: dict[str, PayloadField] = {
    "routed_experts": PayloadField(fill=0, window="inputs"),
    "routed_expert_weights": PayloadField(fill=0.0, window="inputs"),
    "sampling_mask": PayloadField(fill=-1, window="labels", ragged=True, label="omitted"),
    "sampling_mask_logprobs": PayloadField(
        fill=-math.inf, window="sequence", ragged=True, label="first"
    ),
}


def register_field(
    name: str, field: PayloadField, *, fields: MutableMapping[str, PayloadField] = PAYLOAD_FIELDS
) -> PayloadField:
    """Add ``name`` to a registry (the default one unless ``fields`` is given).

    Re-registering the same definition is a no-op; a different definition under a taken name is an
    error, because segments already written would be read back differently.
    """
    if not name.isidentifier():
        raise PayloadFieldError(f"payload field name must be an identifier, got {name!r}")
    old = fields.get(name)
    if old is not None and old != field:
        raise PayloadFieldError(
            f"payload field {name!r} is already registered as {old}; got {field}"
        )
    fields[name] = field
    return field


def lookup_field(name: str, fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS) -> PayloadField:
    """The field definition, or :class:`UnknownFieldError` naming the known fields."""
    try:
        return fields[name]
    except KeyError:
        raise UnknownFieldError(
            f"unknown payload field {name!r}; known: {sorted(fields)} "
            "(register it with rollfeed.payload.register_field)",
            field=name,
        ) from None
