"""What a failed object-store request means, as a typed :class:`PayloadError`.

obstore raises its own exceptions (``FileNotFoundError`` for a missing key, ``PreconditionError``
when an ``If-Match`` fails, ``PermissionDeniedError`` / ``UnauthenticatedError`` for a refused
credential, ``GenericError`` for the rest: 416, timeouts, connection errors after its retries).
:func:`store_error` maps each to the payload family with the place (the handle as ``file``, the
offset; the reader adds field and position) and a message naming bucket and key. Only the first
line of obstore's text is kept: it names the method, URL and status, never a credential.
"""

from __future__ import annotations

from rollfeed.payload.errors import (
    PayloadError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadStaleFileError,
    PayloadStoreAuthError,
    PayloadStoreTimeoutError,
    PayloadTruncatedError,
)

_TIMEOUT_WORDS = ("timed out", "timeout", "error sending request", "connection", "connect")


def _summary(err: BaseException) -> str:
    text = str(err).split("\n", 1)[0]
    return text if len(text) <= 300 else text[:300] + "..."


def status_error(
    status: int,
    *,
    where: str,
    rel: str,
    what: str,
    offset: int | None = None,
    detail: str | None = None,
) -> PayloadError:
    """The payload error for an HTTP ``status`` answering a request for ``what`` of object
    ``where`` (``s3://bucket/key``, handle ``rel``); ``detail``: the client's words, if any."""
    said = detail or f"HTTP {status}"
    if status == 404:
        return PayloadMissingFileError(
            f"object {where} does not exist ({what})", file=rel, offset=offset
        )
    if status == 412:
        return PayloadStaleFileError(
            f"object {where} was replaced while it was read ({what}): its ETag changed",
            file=rel,
            offset=offset,
        )
    if status in (401, 403):
        return PayloadStoreAuthError(
            f"the store refused the credential for {where} ({what}, {said}): check the access "
            "key, secret and region (arguments or AWS_* variables)",
            file=rel,
            offset=offset,
        )
    if status == 416:
        return PayloadTruncatedError(
            f"object {where} is shorter than {what} needs (HTTP 416)", file=rel, offset=offset
        )
    return PayloadIOError(f"{what} of {where} failed: {said}", file=rel, offset=offset)


def store_error(
    err: BaseException, *, where: str, rel: str, what: str, offset: int | None = None
) -> PayloadError:
    """The payload error for ``err`` raised by the object client (obstore) for a request for
    ``what`` of object ``where``: its exception read as the HTTP status it stands for."""
    from obstore import exceptions as ox

    detail = _summary(err)
    kinds = (
        (FileNotFoundError | ox.NotFoundError, 404),
        (ox.PreconditionError, 412),
        (ox.PermissionDeniedError | ox.UnauthenticatedError, 403),
    )
    status = next((code for kind, code in kinds if isinstance(err, kind)), 0)
    if not status and ("416" in detail or "Range Not Satisfiable" in detail):
        status = 416
    if not status and any(w in detail.lower() for w in _TIMEOUT_WORDS):
        return PayloadStoreTimeoutError(
            f"the store did not answer {what} of {where} within the retry bound ({detail}); "
            "check the endpoint, or raise timeout_s / request_retries",
            file=rel,
            offset=offset,
        )
    return status_error(status, where=where, rel=rel, what=what, offset=offset, detail=detail)
