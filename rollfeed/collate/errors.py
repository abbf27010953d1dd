"""Typed collate errors.

Every error is a ``ValueError`` subclass (bad input, never an internal bug) and names what it knows
of the place: the sample (its index in the batch, or its ``uid``), the field and the token position.
``str(err)`` carries all of them, so the text survives a DataLoader worker boundary.
"""

from __future__ import annotations


class CollateError(ValueError):
    """Base class: samples or batch options are not what planning needs."""

    def __init__(
        self,
        message: str,
        *,
        sample: int | str | None = None,
        field: str | None = None,
        pos: int | None = None,
    ) -> None:
        self.sample, self.field, self.pos = sample, field, pos
        where = [
            f"{k}={v}"
            for k, v in (("sample", sample), ("field", field), ("pos", pos))
            if v is not None
        ]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)

    def __reduce__(self):  # keep the attributes through pickling (worker -> main process)
        return (_rebuild, (type(self), self.args[0], self.sample, self.field, self.pos))


def _rebuild(cls, text, sample, field, pos):
    err = cls.__new__(cls)
    ValueError.__init__(err, text)
    err.sample, err.field, err.pos = sample, field, pos
    return err


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


class TurnGapError(CollateError):
    """Multi-turn assembly found a gap in an ``inputs`` field's coverage under ``gap="raise"``."""


class SampleValueError(CollateError):
    """A per-token value cannot be trained on: a NaN or infinite advantage or inference logprob,
    or a temperature that is not finite and > 0, on a loss-bearing token; a negative token id."""
