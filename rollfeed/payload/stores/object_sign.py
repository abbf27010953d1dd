"""AWS Signature Version 4 for the requests the object client signs itself.

Reads, a writer's single PUTs, the step store's requests and the prune's upload listing and
aborts (``GET ?uploads&prefix=``, ``DELETE <key>?uploadId=``, which obstore does not offer) go
through :class:`~rollfeed.payload.stores.object_http.SignedHttp`, which signs each one here with the
standard SigV4 scheme (as botocore does). The secret key is not logged and not part of any error
text (:class:`~rollfeed.payload.stores.store_url.Credentials` keeps it out of its repr).

Worked example::

    creds = Credentials(access_key_id="AK", secret_access_key="SK", region="us-east-1")
    target, headers = sign("GET", "http://127.0.0.1:8333/bucket", creds,
                           query={"uploads": "", "prefix": "step_1/"})
    -> ("/bucket?prefix=step_1%2F&uploads=", {"host": ..., "authorization": "AWS4-HMAC-SHA256 ..."})
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from rollfeed.payload.errors import PayloadIOError
from rollfeed.payload.stores.store_url import Credentials

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


def xml_answer(text: bytes, *, what: str, where: str, rel: str) -> ET.Element:
    """The XML document of a listing's answer; anything else is a typed error."""
    try:
        return ET.fromstring(text)
    except ET.ParseError as err:
        raise PayloadIOError(
            f"{what} of {where}: the answer is not XML ({err})", file=rel
        ) from None
