"""Typed payload errors.

Every error is a ``ValueError`` subclass (bad data or bad input, never an internal bug) and names
what it knows of the place: the file (relative to the payload root), the field, the byte offset and
the token position. ``str(err)`` carries all of them, so a message that crosses a DataLoader worker
boundary (which re-raises from the formatted text) keeps the file name intact.
"""

from __future__ import annotations


class PayloadError(ValueError):
    """Base class: a payload record or payload bytes are not what the reader or writer needs."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        field: str | None = None,
        offset: int | None = None,
        pos: int | None = None,
    ) -> None:
        self.file, self.field, self.offset, self.pos = file, field, offset, pos
        where = [
            f"{k}={v}"
            for k, v in (("file", file), ("field", field), ("offset", offset), ("pos", pos))
            if v is not None
        ]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)

    def __reduce__(self):  # keep the attributes through pickling (worker -> main process)
        return (_rebuild, (type(self), self.args[0], self.file, self.field, self.offset, self.pos))


def _rebuild(cls, text, file, field, offset, pos):
    err = cls.__new__(cls)
    ValueError.__init__(err, text)
    err.file, err.field, err.offset, err.pos = file, field, offset, pos
    return err


class UnknownFieldError(PayloadError):
    """A field name that is not in the fields registry in use."""


class PayloadInputError(PayloadError):
    """Arrays handed to the writer are malformed (negative counts, len(values) != sum(counts))."""


class PayloadSegmentError(PayloadError):
    """A segment record is inconsistent: negative rows or offsets, overlaps, bad layout."""


class PayloadPathError(PayloadError):
    """A handle resolves outside the payload root (absolute path, ``..``, symlink escape)."""


class PayloadMissingFileError(PayloadError):
    """A payload file does not exist (after the bounded retry)."""


class PayloadTruncatedError(PayloadError):
    """A file is shorter than a segment says, or a read came back short after the bounded retry."""


class PayloadHeaderError(PayloadError):
    """A file does not start with the payload magic, or has a format version this reader refuses."""


class PayloadIndexError(PayloadError):
    """A ragged (CSR) row index is not monotonic, or points outside its region."""


class PayloadDtypeError(PayloadError):
    """A segment's dtype disagrees with its field (int vs float), or a field's segments disagree."""


class PayloadWidthError(PayloadError):
    """A ragged row is wider than the caller's fixed ``width``."""
