"""Signed requests over plain HTTP: the read path of an object-store root, and the few other
requests the payload and the step store make.

Reads run in trainer ranks and in the DataLoader workers that fork from them. obstore's requests
run on a runtime of threads that a forked child does not have: measured here, a child forked
after its parent made one obstore request hangs on its first request, even on a client of its
own. Reads therefore use this small client: SigV4-signed requests
(:mod:`rollfeed.payload.stores.object_sign`) over ``http.client`` keep-alive connections, one per
thread, created lazily in each process (keyed by pid), so a worker forked at any time reads; a
writer's single PUTs, the step store's requests and the prune's upload listing go through it
too. Multipart uploads (large writes), object listings and deletes use obstore.

Bounds, whatever the server does. ``timeout_s`` bounds each attempt as a whole (connect,
request, headers and body: a deadline every send and receive of the connection is held to,
:mod:`rollfeed.payload.stores.object_deadline`, not a per-receive timeout a server dripping one byte
at a time would never trip); a
request that timed out, could not connect, was cut, throttled (429/503) or got a 5xx is retried
with exponential backoff (from 50 ms), at most ``request_retries`` times, every attempt ending
within ``retry_timeout_s`` of the first; then :class:`PayloadStoreTimeoutError`. A body is
never read past what was asked: a ranged GET's answer must say it holds the bytes asked for
(``Content-Range``, ``Content-Length``) before a byte of it is read, and a store that ignores
``Range`` (200 with the whole object) is named as such; other answers are read up to
64 MiB (:mod:`rollfeed.payload.stores.object_answer`). Statuses map to typed errors at once: 404
:class:`PayloadMissingFileError`, 412 :class:`PayloadStaleFileError`, 401/403
:class:`PayloadStoreAuthError`, 416 :class:`PayloadTruncatedError`.

Example::

    http = SignedHttp(access, StoreURL.parse("s3://rollouts/run7"))
    http.get("run7/g/w-000001.rfp", 0, 4096, None, where="s3://...", rel="g/w-000001.rfp")
    -> Got(size=..., etag='"9b2c..."', data=b"RFP3...")   # 4096 bytes, or fewer at the end
"""

from __future__ import annotations

import contextlib
import http.client
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from rollfeed.payload.errors import PayloadIOError, PayloadStoreTimeoutError
from rollfeed.payload.stores.object_answer import answer_body, ranged_length
from rollfeed.payload.stores.object_deadline import DeadlineHTTPConnection, DeadlineHTTPSConnection
from rollfeed.payload.stores.object_errors import status_error
from rollfeed.payload.stores.object_sign import sign
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Got:
    """One GET's answer: the object's size and ETag, and the bytes of the range."""

    size: int
    etag: str | None
    data: bytes


class SignedHttp:
    """This process's signed client for one bucket (never pickled; keyed by pid by its owner)."""

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
            kind = DeadlineHTTPSConnection if self.scheme == "https" else DeadlineHTTPConnection
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
            lambda deadline, tries: self._get_once(deadline, key, start, end, etag, where, rel),
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
            lambda deadline, tries: self._put_once(deadline, key, data, tries > 0, where, rel),
            what=f"PUT of {len(data)} bytes",
            where=where,
            rel=rel,
            offset=None,
        )

    def request(
        self,
        method: str,
        key: str,
        *,
        what: str,
        where: str,
        query: Mapping[str, str] | None = None,
        body: bytes = b"",
    ) -> bytes:
        """One signed request for ``key`` (``""``: the bucket itself), with retries; its answer
        (at most :data:`~rollfeed.payload.stores.object_answer.ANSWER_BYTES`), or the typed error
        its status maps to (:func:`~rollfeed.payload.stores.object_errors.status_error`)."""
        return self._retrying(
            lambda deadline, tries: self._request_once(
                deadline, method, key, query, body, what, where
            ),
            what=what,
            where=where,
            rel=key,
            offset=None,
        )

    def _retrying(
        self,
        attempt: Callable[[float, int], T],
        *,
        what: str,
        where: str,
        rel: str,
        offset: int | None,
    ) -> T:
        a = self.access
        last = time.monotonic() + a.retry_timeout_s  # no attempt runs past it
        tries = 0
        while True:
            try:
                return attempt(min(time.monotonic() + a.timeout_s, last), tries)
            except (OSError, http.client.HTTPException, _Retry) as err:
                self._drop()
                pause = min(2.0, 0.05 * 2**tries)
                if tries >= a.request_retries or time.monotonic() + pause >= last:
                    raise PayloadStoreTimeoutError(
                        f"the store did not answer {what} of {where} after {tries} retries: "
                        f"out of reach or too slow ({type(err).__name__}: {err}); each attempt "
                        f"is bounded by timeout_s="
                        f"{a.timeout_s}, all of them by retry_timeout_s={a.retry_timeout_s}: "
                        "check the endpoint, or raise timeout_s / request_retries / "
                        "retry_timeout_s",
                        file=rel,
                        offset=offset,
                    ) from None
                time.sleep(pause)
                tries += 1

    @contextlib.contextmanager
    def _exchange(self, deadline: float) -> Iterator[http.client.HTTPConnection]:
        """This thread's connection for one request and its answer, all of it by ``deadline``
        (past it, ``TimeoutError``, which is retried). A connection an exchange leaves in
        doubt (any error) is dropped, never reused."""
        conn = self._conn()
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no time left for this attempt")
            if conn.sock is None:  # connecting is bounded by the socket's timeout
                conn.timeout = left
                conn.connect()
            conn.sock.deadline = deadline  # every send and receive of this exchange
            yield conn
        except BaseException:
            self._drop()
            raise

    def _signed(
        self, method: str, key: str, body: bytes = b"", query: Mapping[str, str] | None = None
    ) -> tuple[str, dict[str, str]]:
        url = f"{self.base}/{key}" if key else self.base
        return sign(method, url, self.creds, body=body, query=query)

    def _get_once(
        self,
        deadline: float,
        key: str,
        start: int,
        end: int,
        etag: str | None,
        where: str,
        rel: str,
    ) -> Got:
        target, headers = self._signed("GET", key)
        headers["range"] = f"bytes={start}-{end - 1}"
        if etag is not None:
            headers["if-match"] = etag
        what = f"bytes [{start}, {end})"
        with self._exchange(deadline) as conn:
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
            if resp.status in (200, 206):
                n, size = ranged_length(resp, start, end, where, rel)
                data = resp.read(n)
                if len(data) != n:  # the connection ended early: retried like a cut one
                    raise http.client.IncompleteRead(data, n - len(data))
                return Got(size=size, etag=resp.getheader("etag"), data=data)
            answer_body(resp, what=what, where=where, rel=rel)  # drained: the connection stays
        if resp.status in _RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        raise status_error(resp.status, where=where, rel=rel, what=what, offset=start)

    def _put_once(
        self, deadline: float, key: str, data: bytes, retried: bool, where: str, rel: str
    ) -> bool:
        target, headers = self._signed("PUT", key, data)
        headers["if-none-match"] = "*"
        headers["content-length"] = str(len(data))
        what = f"PUT of {len(data)} bytes"
        with self._exchange(deadline) as conn:
            conn.request("PUT", target, body=data, headers=headers)
            resp = conn.getresponse()
            answer_body(resp, what=what, where=where, rel=rel)
        if resp.status in _RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        if resp.status in (200, 201):
            return True
        if resp.status in (409, 412):
            return retried
        raise status_error(resp.status, where=where, rel=rel, what=what, offset=None)

    def _request_once(
        self,
        deadline: float,
        method: str,
        key: str,
        query: Mapping[str, str] | None,
        body: bytes,
        what: str,
        where: str,
    ) -> bytes:
        target, headers = self._signed(method, key, body, query)
        if body or method in ("PUT", "POST"):
            headers["content-length"] = str(len(body))
        with self._exchange(deadline) as conn:
            conn.request(method, target, body=body or None, headers=headers)
            resp = conn.getresponse()
            text = answer_body(resp, what=what, where=where, rel=key)
        if resp.status in _RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        if resp.status >= 300:
            detail = f"HTTP {resp.status} {text[:200]!r}"
            raise status_error(resp.status, where=where, rel=key, what=what, detail=detail)
        return text


class _Retry(PayloadIOError):
    """A throttled or failed (5xx) answer: retried like a timeout."""
