"""AWS Signature Version 4 for the few S3 requests the object client does not offer.

obstore covers GET, PUT (multipart too), HEAD, LIST and DELETE of objects, but not listing and
aborting *incomplete multipart uploads*, which :meth:`ObjectRoot.prune` needs so a writer killed
mid-upload leaves nothing billed behind. Those two requests (``GET ?uploads&prefix=`` and
``DELETE <key>?uploadId=``) are signed here with the standard SigV4 scheme (as botocore does) and
sent with ``urllib``. The secret key is not logged and not part of any error text
(:class:`~rollfeed.payload.store_url.Credentials` keeps it out of its repr).

Worked example::

    creds = Credentials(access_key_id="AK", secret_access_key="SK", region="us-east-1")
    status, body = signed_request("GET", "http://127.0.0.1:8333/bucket", creds,
                                  query={"uploads": "", "prefix": "step_1/"})
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from rollfeed.payload.errors import PayloadIOError
from rollfeed.payload.object_errors import status_error
from rollfeed.payload.store_url import Credentials, StoreAccess

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _quote(s: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(s, safe=safe)


def sign(
    method: str,
    url: str,
    creds: Credentials,
    *,
    query: Mapping[str, str] | None = None,
    body: bytes = b"",
) -> tuple[str, dict[str, str]]:
    """``(request target with its encoded query, signed headers)`` for one S3 request;
    ``url``: ``<endpoint>/<bucket>[/<key>]`` (path style), ``query`` unencoded."""
    parts = urllib.parse.urlsplit(url)
    now = datetime.datetime.now(datetime.UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA256
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted((query or {}).items()))
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": stamp}
    if creds.session_token:
        headers["x-amz-security-token"] = creds.session_token
    names = sorted(headers)
    path = _quote(parts.path or "/", safe="/-_.~")
    canonical = "\n".join(
        [
            method,
            path,
            canonical_query,
            "".join(f"{k}:{headers[k]}\n" for k in names),
            ";".join(names),
            payload_hash,
        ]
    )
    scope = f"{day}/{creds.region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = _hmac(("AWS4" + creds.secret_access_key).encode(), day)
    for part in (creds.region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={creds.access_key_id}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return (f"{path}?{canonical_query}" if canonical_query else path), headers


def signed_request(
    method: str,
    url: str,
    creds: Credentials,
    *,
    query: Mapping[str, str] | None = None,
    body: bytes = b"",
    timeout_s: float = 10.0,
) -> tuple[int, bytes]:
    """Send one SigV4-signed S3 request; returns ``(HTTP status, body)`` (errors included).

    Raises ``OSError`` when the server cannot be reached.
    """
    target, headers = sign(method, url, creds, query=query, body=body)
    parts = urllib.parse.urlsplit(url)
    full = f"{parts.scheme}://{parts.netloc}{target}"
    req = urllib.request.Request(full, data=body or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def store_request(
    access: StoreAccess,
    bucket: str,
    key: str,
    method: str,
    *,
    what: str,
    where: str,
    query: Mapping[str, str] | None = None,
    body: bytes = b"",
) -> bytes:
    """One signed request for object ``key`` of ``bucket`` (``""``: the bucket itself), with its
    failures as typed payload errors: a store out of reach is
    :class:`~rollfeed.payload.errors.PayloadIOError`, an answer of 300 or more the error its
    status maps to (:func:`~rollfeed.payload.object_errors.status_error`). Returns the body."""
    url = access.bucket_url(bucket) + (f"/{key}" if key else "")
    try:
        status, text = signed_request(
            method, url, access.credentials(), query=query, body=body, timeout_s=access.timeout_s
        )
    except OSError as err:
        raise PayloadIOError(
            f"{what} of {where}: the store is out of reach ({err})", file=key
        ) from None
    if status >= 300:
        detail = f"HTTP {status} {text[:200]!r}"
        raise status_error(status, where=where, rel=key, what=what, detail=detail)
    return text


def xml_answer(text: bytes, *, what: str, where: str, rel: str) -> ET.Element:
    """The XML document of a listing's answer; anything else is a typed error."""
    try:
        return ET.fromstring(text)
    except ET.ParseError as err:
        raise PayloadIOError(
            f"{what} of {where}: the answer is not XML ({err})", file=rel
        ) from None
