"""What a failed object-store request means, as a typed :class:`PayloadError`.

obstore raises its own exceptions (``FileNotFoundError`` for a missing key, ``PreconditionError``
when an ``If-Match`` fails, ``PermissionDeniedError`` / ``UnauthenticatedError`` for a refused
credential, ``GenericError`` for the rest: 416, timeouts, connection errors after its retries).
:func:`store_error` maps each to the payload family with the place (the handle as ``file``, the
offset; the reader adds field and position) and a message naming bucket and key. Only the first
line of obstore's text is kept: it names the method, URL and status, never a credential.

A request that failed on its way to the store's credential (the STS exchange of a web identity
token, the instance metadata or container endpoint: a request that is not to the bucket) is
:class:`PayloadStoreAuthError`, as a refused key is.
"""

from __future__ import annotations

import re

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
_REQUEST = re.compile(r"Error performing [A-Z]+ (\S+)")  # the request obstore names
_RANGE = re.compile(r"Requested (\d+)\.\.(\d+), got (\d+)\.\.(\d+)")  # obstore's range check
# obstore's kinds of a failed exchange (its debug text): too slow, cut, not reached
_TIMEOUT_KINDS = ("kind: Timeout", "kind: Interrupted", "kind: Connect", "TimedOut")


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
    err: BaseException,
    *,
    where: str,
    rel: str,
    what: str,
    offset: int | None = None,
    bucket_url: str | None = None,
    bounds: str = "",
) -> PayloadError:
    """The payload error for ``err`` raised by the object client (obstore) for a request for
    ``what`` of object ``where``: its exception read as the HTTP status it stands for, a
    timeout (``bounds``: the policy's numbers, for the message), an answer that was not the
    range asked for, or, for a request that was not to ``bucket_url``
    (``<endpoint>/<bucket>``), a credential that could not be had."""
    from obstore import exceptions as ox

    detail, full = _summary(err), str(err)
    named = _REQUEST.search(detail)
    if bucket_url is not None and named and not named.group(1).startswith(bucket_url):
        return PayloadStoreAuthError(
            f"no credential for {where} ({what}): getting one failed ({detail}); give keys, a "
            "profile, or check the web identity (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN), "
            "container or instance metadata (metadata_endpoint) this process has",
            file=rel,
            offset=offset,
        )
    if got := _RANGE.search(detail):
        asked, sent = got.group(1, 2), got.group(3, 4)
        return PayloadIOError(
            f"the store answered {what} of {where} with bytes [{sent[0]}, {sent[1]}) for "
            f"[{asked[0]}, {asked[1]}): not the bytes asked for; nothing of it was read",
            file=rel,
            offset=offset,
        )
    if "non-partial response" in detail:
        return PayloadIOError(
            f"the store ignored Range: it answered {what} of {where} with 200 (the whole "
            "object); use a store (or proxy) that serves ranged GETs with 206",
            file=rel,
            offset=offset,
        )
    kinds = (
        (FileNotFoundError | ox.NotFoundError, 404),
        (ox.PreconditionError, 412),
        (ox.PermissionDeniedError | ox.UnauthenticatedError, 403),
    )
    status = next((code for kind, code in kinds if isinstance(err, kind)), 0)
    if not status and ("416" in detail or "Range Not Satisfiable" in detail):
        status = 416
    slow = any(w in full for w in _TIMEOUT_KINDS) or any(
        w in detail.lower() for w in _TIMEOUT_WORDS
    )
    if not status and slow:
        return PayloadStoreTimeoutError(
            f"the store did not answer {what} of {where} within its bounds: out of reach, too "
            f"slow or cut short ({detail}); {bounds or 'see timeout_s / request_retries'}",
            file=rel,
            offset=offset,
        )
    return status_error(status, where=where, rel=rel, what=what, offset=offset, detail=detail)
