"""Typed payload errors.

Every error is a :class:`~rollfeed.errors.RollfeedError` (a ``ValueError``: bad data or bad
input, never an internal bug) and names what it knows of the place: the file (relative to the
payload root), the field, the byte offset and the token position. A failed read or write
(:class:`PayloadIOError`) is also an ``OSError``, and a store that does not answer in time
(:class:`PayloadStoreTimeoutError`) also a ``TimeoutError``, so code that handles I/O failures
the standard way handles these too::

    except OSError       -> catches PayloadIOError, PayloadStoreTimeoutError
    except TimeoutError  -> catches PayloadStoreTimeoutError
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class PayloadError(RollfeedError):
    """Base class: a payload record or payload bytes are not what the reader or writer needs."""

    PLACE = ("file", "field", "offset", "pos")


class PayloadFieldError(PayloadError):
    """A field definition or registration is invalid (fill, window, name, a second registration)."""


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


class RaggedRowsError(PayloadError):
    """A ragged value's offsets do not describe its values (not starting at 0, decreasing, not
    ending at nnz), or a padded form, row selection or aligned values that do not fit its rows."""


class PayloadOutputBoundError(PayloadError):
    """A read's output for one field would exceed the root's ``max_output_bytes``: ``rows``
    window rows of ``width`` values each (a ragged field's padded ``[n, W]`` when ``width=`` is
    given, a fixed field's row elements), or a ragged field's ``n + 1`` offsets and its values.
    Raised before anything that size is allocated; names the file and position of the record
    that sets the width (a ragged field's widest row, or its first record)."""

    PLACE = ("file", "field", "offset", "pos", "rows", "width")


class PayloadRegionError(PayloadError):
    """A record disagrees with the region header it points into (field, kind, dtype, shape, rows,
    ragged layout), or the bytes where that header should be are not one."""


class PayloadStaleFileError(PayloadError):
    """A record's file id differs from the file now under its name, even after reopening it: the
    file was replaced (e.g. pruned and written again) after the record was made."""


class PayloadIOError(PayloadError, OSError):
    """The operating system failed a read or write of a payload file (disk full, I/O error); the
    message names the file, the offset and the OS error."""


class PayloadChecksumError(PayloadError):
    """Bytes of a region differ from what its writer wrote: the CRC-32C of a block (or of the
    region header) does not match the checksum table after the region body. Names the file, the
    field, ``region`` (the byte offset of the region's body: the ``offset`` its records carry),
    ``block`` (``"header"``, ``"rows k"``, ``"index k"`` or ``"values k"``) and ``offset`` (the
    block's first byte in the file)."""

    PLACE = ("file", "field", "offset", "pos", "region", "block")


class PayloadStoreAuthError(PayloadError):
    """An object store refused the credential (HTTP 401/403): names the bucket and key; the
    credential itself never appears."""


class StepRecordError(PayloadError):
    """A step record file's bytes are not what its format says: a header, footer or index that
    does not hold, a record whose bytes or checksum disagree with its index row, or a record's
    sections that do not fit its bytes (:mod:`rollfeed.payload.format.step_layout`). Names the
    file, the byte ``offset`` and the ``record`` (0-based) where known."""

    PLACE = ("file", "offset", "record")


class PayloadStoreTimeoutError(PayloadIOError, TimeoutError):
    """An object store did not answer (timeout, connection refused, 5xx) within the retry bound;
    names the bucket, key and byte range."""


class PayloadMediaError(PayloadError):
    """A media record or media bytes are not what they claim: an image record that is malformed
    (span, grid, neither or both of handle and bytes), bytes whose SHA-256 or size differ from
    the handle's, an image that does not decode, or a processed grid other than the recorded
    one. Names the media file (``media/<sha256>``) where there is one."""
