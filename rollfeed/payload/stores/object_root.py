"""A payload root in an object store: ``PayloadRoot("s3://bucket/prefix", ...)``.

:class:`ObjectRoot` is the second implementation of the root's read seam: the reader, the
fixed-width and ragged read plans, the record checks and the retry policy of
:meth:`PayloadRoot.run` are the local root's, unchanged; only the lease differs
(:class:`~rollfeed.payload.stores.object_lease.ObjectLease`: ranged GETs instead of ``preadv``).

Opening an object is one ranged GET of its first ``open_bytes`` bytes (the file header, and for
a small object the whole of it, which the read that opened it uses), which also returns the
object's size and ETag; the process caches size, ETag and header (at most ``max_open`` objects,
least recently used out first).
Every later read of the object carries ``If-Match: <ETag>``, so an object replaced under its key
(pruned and written again) is never read as the old record's bytes: the GET fails, the root
reopens the key once, and the record's file id then names the mismatch
(:class:`PayloadStaleFileError`).

The client (obstore: :mod:`~rollfeed.payload.stores.object_obstore`) and the threads that issue
requests are per process, created on first use and keyed by pid. obstore's runtime does not
survive ``fork`` (a child forked after its parent made a request hangs on its own first), so a
process that reads or writes an object store is started from a fork server or spawned (a
loader's workers are, :meth:`~rollfeed.loaders.LoaderOptions.start_method`); a forked child
that finds its parent's client in this root is refused with :class:`PayloadInputError` instead
of hanging. The object is picklable and carries no client, and its ``repr`` names the URL only
(never a credential).

Example::

    root = PayloadRoot("s3://rollouts/run7", endpoint="http://10.0.0.5:8333")  # an ObjectRoot
    read_fields(segments, {"routed_experts": (0, 4096)}, root=root)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from rollfeed.payload.errors import PayloadError, PayloadInputError, PayloadMissingFileError
from rollfeed.payload.format.layout import FILE_HEADER, parse_file_header
from rollfeed.payload.root import MAX_OUTPUT_BYTES, PayloadRoot, output_bound
from rollfeed.payload.stores.object_lease import ObjectEntry, ObjectLease
from rollfeed.payload.stores.object_obstore import ObstoreClient
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL

log = logging.getLogger(__name__)
T = TypeVar("T")
_MERGE_GAP = 1 << 20  # ranges of an object at most this far apart are fetched in one GET


class ObjectProcessState:
    """This process's client, request threads and cache of opened objects; never pickled.
    ``store``: the client's obstore store."""

    def __init__(self, access: StoreAccess, url: StoreURL, threads: int) -> None:
        self.pid = os.getpid()
        self.client = ObstoreClient(access, url)
        self.store = self.client.store
        self.lock = threading.Lock()
        self.files: OrderedDict[str, ObjectEntry] = OrderedDict()
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


class ObjectRoot(PayloadRoot):
    """Payload objects under ``s3://bucket/prefix``, and how to read them.

    ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
    ``profile``, ``metadata_endpoint``: the store and where its credentials come from (each
    ``None`` found where the AWS libraries look, in the process that builds a client:
    :class:`~rollfeed.payload.stores.store_url.StoreAccess`).
    ``timeout_s``: one request's bound, as a whole (connect, headers and body, however slowly a
    store sends them); ``request_retries``: retries of a request that timed out, was cut, was
    throttled or got a 5xx (exponential backoff from 50 ms), every attempt ending within
    ``retry_timeout_s`` of the first; then a typed error (:class:`PayloadStoreTimeoutError`),
    never a hang.
    ``retries`` / ``backoff_s``: as for a local root, an object missing or shorter than a record
    needs is looked up again with backoff. ``concurrency``: ranged GETs in flight per read.
    ``merge_gap``: ranges of one object at most this many bytes apart are one GET (the bytes
    between them are fetched and dropped: a request costs more than a few hundred KiB).
    ``open_bytes``: the GET that opens an object (its header, size and ETag) fetches this many of
    its first bytes, and the read that opened it uses them: an object of a request or two is
    read with that one GET. ``max_output_bytes``: as for a local root.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        metadata_endpoint: str | None = None,
        timeout_s: float = 10.0,
        request_retries: int = 3,
        retry_timeout_s: float = 30.0,
        max_open: int = 4096,
        retries: int = 3,
        backoff_s: float = 0.05,
        concurrency: int = 16,
        open_bytes: int = 256 << 10,
        merge_gap: int = _MERGE_GAP,
        verify_checksums: bool = False,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        if max_open < 1 or retries < 0 or concurrency < 1 or merge_gap < 0:
            raise PayloadInputError(
                "ObjectRoot needs max_open >= 1, retries >= 0, concurrency >= 1 and "
                f"merge_gap >= 0, got {max_open}, {retries}, {concurrency}, {merge_gap}"
            )
        self.url = StoreURL.parse(url)
        self.access = StoreAccess(
            endpoint=endpoint,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            profile=profile,
            metadata_endpoint=metadata_endpoint,
            timeout_s=timeout_s,
            request_retries=request_retries,
            retry_timeout_s=retry_timeout_s,
        )
        self.path = str(self.url)
        self.max_open, self.retries, self.backoff_s = max_open, retries, backoff_s
        self.threads, self.parallel_min_bytes = concurrency, 0
        self.concurrency, self.merge_gap = concurrency, merge_gap
        self.open_bytes = open_bytes
        self.verify_checksums = bool(verify_checksums)
        self.max_output_bytes = output_bound(max_output_bytes)
        self._state = None

    def __getstate__(self) -> dict:
        keys = ("url", "access", "path", "max_open", "retries", "backoff_s", "threads")
        state = {k: getattr(self, k) for k in keys}
        state.update(parallel_min_bytes=0, concurrency=self.concurrency)
        state.update(merge_gap=self.merge_gap, verify_checksums=self.verify_checksums)
        state.update(open_bytes=self.open_bytes, max_output_bytes=self.max_output_bytes)
        return state

    def __repr__(self) -> str:
        return f"ObjectRoot({self.path!r})"

    def _proc(self) -> ObjectProcessState:  # type: ignore[override]
        state = self._state
        if state is not None and state.pid != os.getpid():
            raise PayloadInputError(
                f"this process was forked from one that used the object store {self.path}: "
                "obstore's runtime does not survive fork (the first request would hang); start "
                "it from a fork server or spawn it (multiprocessing.get_context('forkserver'))"
            )
        if state is None:
            state = self._state = ObjectProcessState(self.access, self.url, self.concurrency)
        return state

    def where(self, rel: str) -> str:
        """``s3://bucket/key`` of handle ``rel`` (confined to the prefix)."""
        return f"s3://{self.url.bucket}/{self.url.key(rel)}"

    def open_object(self, rel: str) -> tuple[ObjectEntry, memoryview]:
        """Size, ETag and file header of object ``rel`` and its first ``open_bytes`` bytes (one
        ranged GET), after the bounded retry for a missing object."""
        return self.open_many([rel])[0]

    def open_many(self, files: Sequence[str]) -> list[tuple[ObjectEntry, memoryview]]:
        """:meth:`open_object` of each of ``files``, concurrently."""
        return self._proc().map(self._open_one, list(files))

    def _open_one(self, rel: str) -> tuple[ObjectEntry, memoryview]:
        key = self.url.key(rel)
        client = self._proc().client
        for attempt in range(self.retries + 1):
            try:
                span = max(self.open_bytes, FILE_HEADER.size)
                got = client.get(key, 0, span, None, where=self.where(rel), rel=rel)
                break
            except PayloadMissingFileError as err:
                if attempt == self.retries:
                    if self.retries:
                        err = PayloadMissingFileError(
                            f"{err.message} (after {self.retries} retries)", file=rel
                        )
                    raise err from None
                time.sleep(self.backoff_s * 2**attempt)
        try:
            head = parse_file_header(got.data[: FILE_HEADER.size])
        except PayloadError as err:
            raise err.with_place(file=rel) from None
        entry = ObjectEntry(
            rel=rel,
            key=key,
            etag=got.etag,
            columns=(got.size, head.version, head.file_id or 0, head.size),
        )
        return entry, got.data

    def acquire(self, files: Sequence[str]) -> tuple[list[ObjectEntry], dict[int, memoryview]]:
        """Entries for ``files`` (opened when not cached) and, for those opened now, their first
        bytes by position in ``files``: a read of a small object then needs no second GET."""
        proc = self._proc()
        with proc.lock:
            held = [proc.files.get(rel) for rel in files]
            for entry in held:
                if entry is not None:
                    proc.files.move_to_end(entry.rel)
        at = [i for i, e in enumerate(held) if e is None]
        first: dict[int, memoryview] = {}
        if at:
            opened = self.open_many([files[i] for i in at])
            with proc.lock:
                for i, (entry, data) in zip(at, opened, strict=True):
                    proc.files[entry.rel] = held[i] = entry
                    first[i] = data
                while len(proc.files) > self.max_open:
                    proc.files.popitem(last=False)
        return held, first  # type: ignore[return-value]

    def replace(self, old: ObjectEntry) -> tuple[ObjectEntry, memoryview]:
        """A newly opened entry for ``old.rel`` (and its first bytes) in place of ``old``."""
        fresh, data = self.open_object(old.rel)
        proc = self._proc()
        with proc.lock:
            proc.files[old.rel] = fresh
        return fresh, data

    def lease(self, files: Sequence[str]) -> ObjectLease:  # type: ignore[override]
        return ObjectLease(self, files)

    def prune(self, group: str) -> None:
        """Delete every object of ``group`` (e.g. one training step) and abort the incomplete
        multipart uploads under it; a group with neither is :class:`PayloadMissingFileError`."""
        from rollfeed.payload.stores.object_prune import prune_group

        prune_group(self, group)
        self.close()
