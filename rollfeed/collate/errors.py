"""Typed collate errors.

Every error is a :class:`~rollfeed.errors.RollfeedError` (a ``ValueError``: bad input, never an
internal bug) and names what it knows of the place: the sample (its index in the batch, or its
``uid``), the field and the token position.
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class CollateError(RollfeedError):
    """Base class: samples or batch options are not what planning needs."""

    PLACE = ("sample", "field", "pos")


class SampleLengthError(CollateError):
    """A per-token array (or an inline field) does not have the sample's length T."""


class SampleDtypeError(CollateError):
    """A per-token array or inline field has the wrong dtype or the wrong kind (int vs float)."""


class DuplicateFieldError(CollateError):
    """A field is given both inline and by handle in one sample."""


class SegmentRangeError(CollateError):
    """A payload segment lies outside the sample's token range ``[0, T]``."""


class OverlongError(CollateError):
    """A sample is longer than ``seq_len`` under ``overlong="error"``."""


class BatchConfigError(CollateError):
    """Batch options are inconsistent (sizes < 1, unknown layout, seq_len not divisible, ...)."""


class SampleValueError(CollateError):
    """A per-token value cannot be trained on: a NaN or infinite advantage or inference logprob,
    or a temperature that is not finite and > 0, on a loss-bearing token; a negative token id."""


class MeshAxisError(RollfeedError):
    """A ``DeviceMesh`` dimension name that is not in the axis table, or axes that are ambiguous
    together (:mod:`rollfeed.collate.mesh_axes`)."""

    PLACE = ("axis",)


class SupportSetError(CollateError):
    """An inline kept set (a field declared with a ``label``) does not hold the token sampled
    from it, or the values aligned with it (mask logprobs) do not follow its rows."""


class ImageInputError(CollateError):
    """An image cannot be made into the model's input as recorded: no image processor given for
    a micro batch with images, processor settings other than the ones its rollout recorded, or a
    processed patch grid other than the recorded one (the placeholder run would not match)."""


class SharedPrefixError(CollateError):
    """Samples planned to share a prefix do not: claimed prefix keys that contradict each other,
    tokens or recorded routes that differ over the claimed prefix, or a sample with images among
    them (samples with images are not packed as trees). A loader reading a step file names the
    file and step, and the sample by its number in the step."""

    PLACE = ("file", "step", "sample", "field", "pos")
