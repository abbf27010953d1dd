"""How one process reaches an object store: the bucket and prefix, the access, and per process
the signed HTTP client, the obstore client, the request threads and the cache of opened objects.

:class:`ObjectClient` is picklable and carries no client (its ``repr`` names the URL only, never a
credential); :meth:`ObjectClient.process` makes this process's state on first use, keyed by pid.
obstore's runtime does not survive ``fork``: measured here, a DataLoader worker forked after its
parent made one obstore request hangs on its first request, even on a client of its own. So reads
(and a writer's single PUTs) go through :mod:`rollfeed.payload.stores.object_http`, which a
forked child can use whatever its parent did; obstore serves multipart uploads and listings, and
is built on first use only.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from rollfeed.payload.stores.object_http import SignedHttp
from rollfeed.payload.stores.store import PerProcess
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectEntry:
    """One opened object: handle, key, ETag and the lease columns
    ``(size, version, file_id, header_size)``."""

    rel: str
    key: str
    etag: str | None
    columns: tuple[int, int, int, int]


class ObjectProcessState:
    """This process's clients, request threads and cache of opened objects; never pickled.
    ``store`` (obstore, for writes and listings) is built on first use only."""

    def __init__(self, access: StoreAccess, url: StoreURL, threads: int) -> None:
        self.pid = os.getpid()
        self.access, self.url = access, url
        self.http = SignedHttp(access, url)
        self.lock = threading.Lock()
        self.files: OrderedDict[str, ObjectEntry] = OrderedDict()
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._store: Any = None

    @property
    def store(self) -> Any:
        with self.lock:
            if self._store is None:
                self._store = self.access.store(self.url)
            return self._store

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
        """This process's state (never the parent's in a forked child: it would hang)."""
        return self._here(lambda: ObjectProcessState(self.access, self.url, self.threads))

    def where(self, rel: str) -> str:
        """``s3://bucket/key`` of handle ``rel`` (confined to the prefix)."""
        return f"s3://{self.url.bucket}/{self.url.key(rel)}"
