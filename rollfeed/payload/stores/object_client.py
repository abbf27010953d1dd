"""How one process reaches an object store: the bucket and prefix, the access, and per process
the obstore client, the request threads and the cache of opened objects.

:class:`ObjectClient` is picklable and carries no client (its ``repr`` names the URL only, never a
credential); :meth:`ObjectClient.process` makes this process's state on first use, keyed by pid.
Every request an ``s3://`` root or a step store makes goes through :class:`ObstoreClient`
(obstore; the two multipart requests obstore does not offer, a step store's bounded listing, and
a profile's credentials are botocore's: :mod:`~rollfeed.payload.stores.object_botocore`).

obstore's runtime does not survive ``fork`` (a child forked after a request of its parent hangs
on its own first, on any client: :mod:`~rollfeed.payload.stores.object_runtime`), so processes
that use it start from a fork server or are spawned
(:meth:`~rollfeed.loaders.LoaderOptions.start_method`); in a child forked after a request,
building a client and every request are refused with
:class:`~rollfeed.payload.errors.PayloadInputError` instead of hanging. The obstore store is built
once from :class:`~rollfeed.payload.stores.store_url.StoreAccess`, which
holds the one retry policy (each attempt bounded as a whole by ``timeout_s``, retries with
backoff within ``retry_timeout_s``) and where credentials come from. Every failure is a typed
:class:`~rollfeed.payload.errors.PayloadError` (:func:`~rollfeed.payload.stores.object_errors.
store_error`) naming the object.

A ranged GET is held to the range before its body is read: obstore refuses an answer whose
``Content-Range`` is not the range asked for (a 206 claiming 2 GiB for 256 KiB is refused from
its headers) and a 200 (the whole object) to a ranged GET. A PUT is create-only
(``If-None-Match: *``) after a look-up of the key (a store that ignores the condition still
refuses a name taken long before); a retried PUT that finds the key holding its own bytes (the
ETag of a single PUT is the MD5 of its body) took the earlier attempt as landed.

Example::

    client = ObjectClient(StoreURL.parse("s3://rollouts/run7"), access, threads=16)
    client.process().obstore.get("run7/g/w-000001.rfp", 0, 4096, None, where="s3://...",
                                 rel="g/w-000001.rfp")
    -> Got(size=..., etag='"9b2c..."', data=<memory>)   # 4096 bytes, or fewer at the end
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from rollfeed.payload.errors import (
    PayloadIOError,
    PayloadMissingFileError,
    PayloadPathError,
)
from rollfeed.payload.stores.object_blocks import PinnedBlocks
from rollfeed.payload.stores.object_botocore import (
    SignedRequests,
    botocore_session,
    profile_provider,
)
from rollfeed.payload.stores.object_errors import store_error
from rollfeed.payload.stores.object_runtime import before_request, check_usable, forked_error
from rollfeed.payload.stores.store import PerProcess
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL

T = TypeVar("T")

PART_BYTES = 5 << 20  # S3's smallest part size


@dataclass(frozen=True, kw_only=True, slots=True)
class Got:
    """One GET's answer: the object's size and ETag, and the bytes of the range."""

    size: int
    etag: str | None
    data: memoryview


class ObstoreClient:
    """This process's obstore client for one bucket (see the module doc)."""

    def __init__(self, access: StoreAccess, url: StoreURL) -> None:
        check_usable(str(url))  # a fork after a request: no client of obstore's would answer
        self.access, self.url = access, url
        self.pid = os.getpid()
        self.bucket_url = access.bucket_url(url.bucket)
        self._session: Any = None  # botocore's, when credentials come from a profile
        provider = None
        if access.profile_name():
            self._session = botocore_session(access)
            provider = profile_provider(self._session, url)
        self.store = access.store(url, credential_provider=provider)
        self._signed: SignedRequests | None = None

    def signed(self) -> SignedRequests:
        """botocore's signed requests, with the credentials of this client (made on first use;
        call it before sharing it between threads)."""
        if self._signed is None:
            session = self._session or botocore_session(self.access)
            self._signed = SignedRequests(self.access, self.url, session)
        return self._signed

    def _error(self, raw: BaseException, where: str, rel: str, what: str, offset=None):
        a = self.access
        bounds = (
            f"each attempt is bounded by timeout_s={a.timeout_s}, all of them by "
            f"retry_timeout_s={a.retry_timeout_s} ({a.request_retries} retries): check the "
            "endpoint, or raise timeout_s / request_retries / retry_timeout_s"
        )
        return store_error(
            raw,
            where=where,
            rel=rel,
            what=what,
            offset=offset,
            bucket_url=self.bucket_url,
            bounds=bounds,
        )

    def get(self, key: str, start: int, end: int, etag: str | None, *, where: str, rel: str) -> Got:
        """Bytes ``[start, end)`` of ``key`` (fewer when the object is shorter), of the object
        whose ETag is ``etag`` when given (another is :class:`PayloadStaleFileError`)."""
        import obstore

        options: dict[str, Any] = {"range": (start, end)}
        if etag is not None:
            options["if_match"] = etag
        what = f"GET bytes [{start}, {end})"
        before_request(where)
        try:
            got = obstore.get(self.store, key, options=options)
            data, meta = memoryview(got.bytes()), got.meta
        except Exception as raw:
            raise self._error(raw, where, rel, what, start) from None
        return Got(size=int(meta["size"]), etag=meta.get("e_tag"), data=data)

    def whole(self, key: str, *, limit: int, where: str, rel: str) -> bytes | None:
        """The whole object ``key`` (one GET); ``None`` when it does not exist. An object of
        more than ``limit`` bytes (its answer's headers say) is :class:`PayloadIOError`, its
        body unread."""
        import obstore

        before_request(where)
        try:
            got = obstore.get(self.store, key)
            size = int(got.meta["size"])
            if size > limit:
                raise PayloadIOError(
                    f"object {where} has {size} bytes, more than the {limit} it may take; "
                    "nothing of it was read",
                    file=rel,
                )
            return bytes(got.bytes())
        except PayloadIOError:
            raise
        except Exception as raw:
            err = self._error(raw, where, rel, "GET")
            if isinstance(err, PayloadMissingFileError):
                return None
            raise err from None

    def head(self, key: str, *, where: str, rel: str) -> tuple[int, str | None] | None:
        """``(size, ETag)`` of ``key``; ``None`` when it does not exist."""
        import obstore

        before_request(where)
        try:
            meta = obstore.head(self.store, key)
        except FileNotFoundError:
            return None
        except Exception as raw:
            err = self._error(raw, where, rel, "HEAD")
            if isinstance(err, PayloadMissingFileError):
                return None
            raise err from None
        return int(meta["size"]), meta.get("e_tag")

    def put(self, key: str, data: bytes, *, multipart: bool, where: str, rel: str) -> None:
        """Store ``data`` as ``key``, which must not exist (:class:`PayloadPathError`);
        ``multipart``: in parts, several in flight (not conditional: the look-up alone guards
        the name)."""
        import obstore
        from obstore import exceptions as ox

        what = f"PUT of {len(data)} bytes"
        if self.head(key, where=where, rel=rel) is not None:
            raise _exists(where, rel)
        try:
            if multipart:
                obstore.put(
                    self.store,
                    key,
                    data,
                    use_multipart=True,
                    chunk_size=PART_BYTES,
                    max_concurrency=4,
                )
            else:
                obstore.put(self.store, key, data, mode="create", use_multipart=False)
        except ox.AlreadyExistsError:
            if not self._holds(key, data, where, rel):
                raise _exists(where, rel) from None
        except Exception as raw:
            raise self._error(raw, where, rel, what) from None

    def overwrite(self, key: str, data: bytes, *, where: str, rel: str) -> None:
        """Store ``data`` as ``key`` whether or not it exists (one PUT)."""
        import obstore

        before_request(where)
        try:
            obstore.put(self.store, key, data, use_multipart=False)
        except Exception as raw:
            raise self._error(raw, where, rel, f"PUT of {len(data)} bytes") from None

    def _holds(self, key: str, data: bytes, where: str, rel: str) -> bool:
        """Whether ``key`` holds ``data`` as one PUT wrote it: a retried PUT whose earlier
        attempt landed finds its own object, not another writer's."""
        got = self.head(key, where=where, rel=rel)
        return (
            got is not None
            and got[0] == len(data)
            and (got[1] or "").strip('"') == (hashlib.md5(data, usedforsecurity=False).hexdigest())
        )

    def keys(self, prefix: str, *, where: str, rel: str) -> list[dict]:
        """Metadata (``path``, ``size``, ``last_modified``, ``e_tag``) of every object under
        key ``prefix`` (every page of the listing)."""
        import obstore

        out: list[dict] = []
        before_request(where)
        try:
            for batch in obstore.list(self.store, prefix=prefix or None, chunk_size=1000):
                out += batch
        except Exception as raw:
            raise self._error(raw, where, rel, "listing") from None
        return out

    def delete(self, keys: Sequence[str], *, where: str, rel: str) -> None:
        """Delete ``keys`` (bulk requests of up to 1,000)."""
        import obstore

        before_request(where)
        try:
            obstore.delete(self.store, list(keys))
        except Exception as raw:
            raise self._error(raw, where, rel, "deleting") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectEntry:
    """One opened object: handle, key, ETag and the lease columns
    ``(size, version, file_id, header_size)``."""

    rel: str
    key: str
    etag: str | None
    columns: tuple[int, int, int, int]


class ObjectProcessState:
    """This process's obstore client, request threads, cache of opened objects and blocks of
    objects read by range (:class:`PinnedBlocks`); never pickled. ``store``: the client's
    obstore store."""

    def __init__(self, access: StoreAccess, url: StoreURL, threads: int) -> None:
        self.pid = os.getpid()
        self.obstore = ObstoreClient(access, url)
        self.store = self.obstore.store
        self.lock = threading.Lock()
        self.files: OrderedDict[str, ObjectEntry] = OrderedDict()
        self.opening: dict[str, Future] = {}  # objects being opened (S3Store.acquire)
        self.blocks = PinnedBlocks()  # whole blocks of objects read by range (ObjectFile)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[..., T], *columns: Sequence) -> list[T]:
        """``fn`` over the rows of ``columns`` on this process's request threads (inline for
        one row); the first error raises once every call has finished."""
        if len(columns[0]) == 1:
            return [fn(*(c[0] for c in columns))]
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rollfeed-s3")
            pool = self._pool
        jobs = [pool.submit(fn, *row) for row in zip(*columns, strict=True)]
        wait(jobs)
        return [j.result() for j in jobs]

    def close(self) -> None:
        with self.lock:
            self.files.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


class ObjectClient(PerProcess):
    """Objects under ``url`` reached with ``access``, ``threads`` requests in flight at most."""

    def __init__(self, url: StoreURL, access: StoreAccess, threads: int) -> None:
        self.url, self.access, self.threads = url, access, threads
        self.path = str(url)

    def __repr__(self) -> str:
        return f"ObjectClient({self.path!r})"

    def process(self) -> ObjectProcessState:
        """This process's state (its parent's is dropped); in a process forked after an
        object-store request, :class:`PayloadInputError`
        (:mod:`~rollfeed.payload.stores.object_runtime`: obstore's runtime would hang there)."""
        return self._here(
            lambda: ObjectProcessState(self.access, self.url, self.threads),
            forked=lambda: forked_error(self.path),
        )

    def where(self, rel: str) -> str:
        """``s3://bucket/key`` of handle ``rel`` (confined to the prefix)."""
        return f"s3://{self.url.bucket}/{self.url.key(rel)}"


def _exists(where: str, rel: str) -> PayloadPathError:
    return PayloadPathError(
        f"object {where} already exists: each writer (and process) needs its own name", file=rel
    )
