"""Ranged GETs over plain HTTP: the read path of an object-store root.

Reads run in trainer ranks and in the DataLoader workers that fork from them. obstore's requests
run on a runtime of threads that a forked child does not have: measured here, a child forked
after its parent made one obstore request hangs on its first request, even on a client of its
own. Reads therefore use this small client: SigV4-signed GETs (:mod:`rollfeed.payload.object_sign`)
over ``http.client`` keep-alive connections, one per thread, created lazily in each process
(keyed by pid), so a worker forked at any time reads; a writer's single PUTs go through it too.
Multipart uploads (large writes), listings and deletes (``prune``, ``inspect``) use obstore.

Each GET carries ``Range`` and, after the first, ``If-Match`` on the ETag seen then. A request
that times out, cannot connect, is throttled (429/503) or gets a 5xx is retried with exponential
backoff (from ``backoff_s``), at most ``request_retries`` times and within ``retry_timeout_s``;
then :class:`PayloadStoreTimeoutError`. Other statuses map to typed errors at once: 404
:class:`PayloadMissingFileError`, 412 :class:`PayloadStaleFileError`, 401/403
:class:`PayloadStoreAuthError`, 416 :class:`PayloadTruncatedError`.
"""

from __future__ import annotations

import http.client
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rollfeed.payload.errors import PayloadIOError, PayloadStoreTimeoutError
from rollfeed.payload.object_errors import status_error
from rollfeed.payload.object_sign import sign
from rollfeed.payload.store_url import StoreAccess, StoreURL

_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Got:
    """One GET's answer: the object's size and ETag, and the bytes of the range."""

    size: int
    etag: str | None
    data: bytes


class SignedHttp:
    """This process's signed GET client for one bucket (never pickled; keyed by pid by its
    owner)."""

    def __init__(self, access: StoreAccess, url: StoreURL) -> None:
        self.base = access.bucket_url(url.bucket)
        parts = urllib.parse.urlsplit(self.base)
        self.scheme, self.netloc = parts.scheme, parts.netloc
        self.creds, self.access = access.credentials(), access
        self.pid = os.getpid()
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            kind = (
                http.client.HTTPSConnection
                if self.scheme == "https"
                else http.client.HTTPConnection
            )
            conn = self._local.conn = kind(self.netloc, timeout=self.access.timeout_s)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def get(self, key: str, start: int, end: int, etag: str | None, *, where: str, rel: str) -> Got:
        """Bytes ``[start, end)`` of ``key`` (fewer when the object is shorter), with retries."""
        return self._retrying(
            lambda tries: self._once(key, start, end, etag, where=where, rel=rel),
            what=f"GET bytes [{start}, {end})",
            where=where,
            rel=rel,
            offset=start,
        )

    def put(self, key: str, data: bytes, *, where: str, rel: str) -> bool:
        """PUT ``data`` as ``key`` unless the key exists (``If-None-Match: *``); False when it
        does. A retry that finds the key takes it as the earlier attempt having landed (keys
        are one writer's own)."""
        return self._retrying(
            lambda tries: self._put_once(key, data, retried=tries > 0, where=where, rel=rel),
            what=f"PUT of {len(data)} bytes",
            where=where,
            rel=rel,
            offset=None,
        )

    def _retrying(
        self, attempt: Callable[[int], T], *, what: str, where: str, rel: str, offset: int | None
    ) -> T:
        deadline = time.monotonic() + self.access.retry_timeout_s
        tries = 0
        while True:
            try:
                return attempt(tries)
            except (OSError, http.client.HTTPException, _Retry) as err:
                self._drop()
                if tries >= self.access.request_retries or time.monotonic() >= deadline:
                    raise PayloadStoreTimeoutError(
                        f"the store did not answer {what} of {where} after {tries} retries "
                        f"({type(err).__name__}: {err}); check the endpoint, or raise "
                        "timeout_s / request_retries / retry_timeout_s",
                        file=rel,
                        offset=offset,
                    ) from None
                time.sleep(min(2.0, 0.05 * 2**tries))
                tries += 1

    def _signed(self, method: str, key: str, body: bytes = b"") -> tuple[str, dict[str, str]]:
        return sign(method, f"{self.base}/{key}", self.creds, body=body)

    def _put_once(self, key: str, data: bytes, *, retried: bool, where: str, rel: str) -> bool:
        target, headers = self._signed("PUT", key, data)
        headers["if-none-match"] = "*"
        headers["content-length"] = str(len(data))
        conn = self._conn()
        conn.request("PUT", target, body=data, headers=headers)
        resp = conn.getresponse()
        resp.read()
        if resp.status in _RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        if resp.status in (200, 201):
            return True
        if resp.status in (409, 412):
            return retried
        what = f"PUT of {len(data)} bytes"
        raise status_error(resp.status, where=where, rel=rel, what=what, offset=None)

    def _once(
        self, key: str, start: int, end: int, etag: str | None, *, where: str, rel: str
    ) -> Got:
        target, headers = self._signed("GET", key)
        headers["range"] = f"bytes={start}-{end - 1}"
        if etag is not None:
            headers["if-match"] = etag
        conn = self._conn()
        conn.request("GET", target, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status in _RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        what = f"bytes [{start}, {end})"
        if resp.status in (200, 206):
            size = len(body)
            m = _RANGE.match(resp.getheader("content-range") or "")
            if m and m.group(3) != "*":
                size = int(m.group(3))
            return Got(size=size, etag=resp.getheader("etag"), data=body)
        raise status_error(resp.status, where=where, rel=rel, what=what, offset=start)


class _Retry(PayloadIOError):
    """A throttled or failed (5xx) answer: retried like a timeout."""
