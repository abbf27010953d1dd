"""Typed model errors: :class:`~rollfeed.errors.RollfeedError` subclasses naming the value, the
bound, the fix and the place: the input ``tensor`` (``"support"``, ``"labels"``,
``"routed_experts"``, ...), the row ``pos`` in it (for a micro batch: the row position in the whole
packed row), the ``sample`` (uid or index) and the model ``layer``, as far as they are known.

Example::

    VocabularyRangeError("support[3, 1] = 130 is outside the vocabulary [0, 128)",
                         tensor="support", pos=3)
    -> "support[3, 1] = 130 is outside the vocabulary [0, 128) [tensor=support, pos=3]"
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class ModelError(RollfeedError):
    """Base class: an input, a model or a process group the scorer cannot use exactly."""

    PLACE = ("tensor", "pos", "sample", "layer")


class SupportInputError(ModelError):
    """Bad shapes, dtypes, options or ids given to a support scorer."""


class SupportLabelError(SupportInputError):
    """A scored row's label is not a member of its recorded support."""


class VocabularyRangeError(SupportInputError):
    """A token id (input, label or support id) outside the model's vocabulary ``[0, V)``."""


class TemperatureError(SupportInputError):
    """A scored row's temperature is not finite and ``> 0`` (its scores would be inf or NaN)."""


class CPGroupError(ModelError):
    """A ``cp`` group that is not valid: bad rank or size, no process group for size > 1, or a
    rank and size that disagree with the process group's own."""


class CPMismatchError(ModelError):
    """A micro batch split for another ``cp`` rank or size than the scorer's ``cp`` group, or with
    its fields read over the whole row instead of the rank's windows."""


class UlyssesShapeError(ModelError):
    """A head or sequence count that the ``cp`` group cannot split evenly."""


class PackingError(ModelError):
    """Packing metadata (positions, cu_seqlens, canonical indices) not describing the row."""


class UnpackableAttentionError(PackingError):
    """Layers whose attention packed scoring cannot reproduce exactly (the row's samples would
    leak into each other, or a feature would be dropped). ``findings``: ``(layer, feature)``
    pairs, every one that was detected; ``layer`` (the place) is the first of them."""

    def __init__(self, model: str, findings: list[tuple[str, str]]) -> None:
        self.model, self.findings = model, tuple(findings)
        by_layer: dict[str, list[str]] = {}
        for layer, feature in findings:
            by_layer.setdefault(layer, []).append(feature)
        listed = "; ".join(f"{layer}: {', '.join(f)}" for layer, f in by_layer.items())
        super().__init__(
            f"packed scoring cannot run {model} exactly: {listed}. Packed attention supports "
            "causal full attention (GQA, rope from position_ids, sliding windows, sinks, "
            "MLA); score such a model with one sample per row instead",
            layer=findings[0][0] if findings else None,
        )

    def __reduce__(self):  # keep the findings through pickling
        return (type(self), (self.model, list(self.findings)))


class RoutingReplayError(ModelError):
    """Recorded routing that does not fit the model (shape, expert id range, coverage)."""


class LMHeadError(ModelError):
    """An LM head the scorer cannot replace exactly: a bias, logits transformed after the head, a
    head weight sharded other than on the vocabulary, or a forward that does not call the head."""


class NonFiniteLogitError(ModelError):
    """A scored row whose logits are NaN or inf (a fault of the model: NaN activations or
    weights), or whose logits the temperature scales past the compute dtype's range."""


class GradientReductionError(ModelError):
    """A module whose gradient reduction :func:`~rollfeed.models.sum_gradients` cannot make a
    sum: neither the root of an FSDP2 (``fully_shard``) model nor ``DistributedDataParallel``."""
