"""Payload files in an object store: ``PayloadRoot("s3://bucket/prefix", ...)``'s store.

:class:`S3Store` is the second :class:`~rollfeed.payload.stores.store.Store`: the reader, the
fixed-width and ragged read plans, the record checks and the retry policy of
:meth:`~rollfeed.payload.PayloadRoot.run` are the local root's, unchanged; only the lease differs
(:class:`~rollfeed.payload.stores.object_lease.ObjectLease`: ranged GETs instead of ``preadv``).

Opening an object is one ranged GET of its first ``open_bytes`` bytes (the file header, and for
a small object the whole of it, which the read that opened it uses), which also returns the
object's size and ETag; the process caches size, ETag and header (at most ``max_open`` objects,
least recently used out first).
Every later read of the object carries ``If-Match: <ETag>``, so an object replaced under its key
(pruned and written again) is never read as the old record's bytes: the GET fails, the root
reopens the key once, and the record's file id then names the mismatch
(:class:`PayloadStaleFileError`).

The client (obstore) and the threads that issue requests are per process
(:class:`~rollfeed.payload.stores.object_client.ObjectClient`). obstore's runtime does not
survive ``fork``: in a process forked after an object-store request, building a store and using
one (the parent's or a new one) are refused (:class:`PayloadInputError`) instead of hanging
(:mod:`~rollfeed.payload.stores.object_runtime`), so a process that reads or writes an object
store is started from a fork server or spawned (a loader's workers are,
:meth:`~rollfeed.loaders.LoaderOptions.start_method`), or forked before the first request. The
store is picklable and carries no client, and its ``repr`` names the URL only (never a
credential).

Example::

    root = PayloadRoot("s3://rollouts/run7", endpoint="http://10.0.0.5:8333")  # an S3Store
    read_fields(segments, {"routed_experts": (0, 4096)}, root=root)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from rollfeed.payload.errors import (
    PayloadError,
    PayloadInputError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadTruncatedError,
)
from rollfeed.payload.format.layout import FILE_HEADER, VERSION, parse_file_header
from rollfeed.payload.stores.folder_names import object_names
from rollfeed.payload.stores.object_client import ObjectClient, ObjectEntry
from rollfeed.payload.stores.object_lease import ObjectLease
from rollfeed.payload.stores.object_prune import prune_group
from rollfeed.payload.stores.object_runtime import check_usable
from rollfeed.payload.stores.store import Listed, Retry
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL
from rollfeed.payload.write.object_writer import ObjectSink
from rollfeed.payload.write.whole_file import ObjectStaged

T = TypeVar("T")

_MERGE_GAP = 1 << 20  # ranges of an object at most this far apart are fetched in one GET


class S3Store:
    """Payload objects under ``s3://bucket/prefix``, and how to reach them.

    ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
    ``profile``, ``metadata_endpoint``: the store and where its credentials come from (each
    ``None`` found where the AWS libraries look, in the process that builds a client:
    :class:`~rollfeed.payload.stores.store_url.StoreAccess`).
    ``timeout_s``: one request's bound, as a whole (connect, headers and body, however slowly a
    store sends them); ``request_retries``: retries of a request that timed out, was cut, was
    throttled or got a 5xx (exponential backoff from 50 ms), every attempt ending within
    ``retry_timeout_s`` of the first; then a typed error (:class:`PayloadStoreTimeoutError`),
    never a hang. ``concurrency``: ranged GETs in flight per read.
    ``merge_gap``: ranges of one object at most this many bytes apart are one GET (the bytes
    between them are fetched and dropped: a request costs more than a few hundred KiB).
    ``open_bytes``: the GET that opens an object (its header, size and ETag) fetches this many of
    its first bytes, and the read that opened it uses them: an object of a request or two is
    read with that one GET. ``max_open``: objects whose size, ETag and header stay cached.
    """

    descriptors = False
    backoff_s = 0.05

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
        concurrency: int = 16,
        open_bytes: int = 256 << 10,
        merge_gap: int = _MERGE_GAP,
    ) -> None:
        if max_open < 1 or concurrency < 1 or merge_gap < 0:
            raise PayloadInputError(
                "an object-store PayloadRoot needs max_open >= 1, concurrency >= 1 and "
                f"merge_gap >= 0, got {max_open}, {concurrency}, {merge_gap}"
            )
        check_usable(url)  # refused here, not at the first request: it would hang
        access = StoreAccess(
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
        self.client = ObjectClient(StoreURL.parse(url), access, concurrency)
        self.url, self.path = self.client.url, self.client.path
        self.max_open, self.threads = max_open, concurrency
        self.merge_gap, self.open_bytes = merge_gap, open_bytes

    def __repr__(self) -> str:
        return f"S3Store({self.path!r})"

    def close(self) -> None:
        self.client.close()

    def where(self, rel: str) -> str:
        return self.client.where(rel)

    def _open(self, rel: str, retry: Retry) -> tuple[ObjectEntry, memoryview]:
        """Size, ETag and file header of object ``rel`` and its first ``open_bytes`` bytes (one
        ranged GET), after the bounded retry for a missing one."""
        key, span, where = (
            self.url.key(rel),
            max(self.open_bytes, FILE_HEADER.size),
            self.where(rel),
        )
        client = self.client.process().obstore
        got = retry.opening(rel, lambda: client.get(key, 0, span, None, where=where, rel=rel))
        try:
            file_id = parse_file_header(got.data[: FILE_HEADER.size])
        except PayloadError as err:
            raise err.with_place(file=rel) from None
        columns = (got.size, VERSION, file_id, FILE_HEADER.size)
        return ObjectEntry(rel=rel, key=key, etag=got.etag, columns=columns), got.data

    def acquire(
        self, files: Sequence[str], retry: Retry
    ) -> tuple[list[ObjectEntry], dict[int, memoryview]]:
        """Entries for ``files`` (opened when not cached) and, for those opened now, their first
        bytes by position in ``files``: a read of a small object then needs no second GET.

        An object is opened once however many threads ask for it at once (the threads of a
        loader worker's read-ahead): the first opens it, outside the lock, and the others wait
        for its opening (one future per object being opened) and share its entry and first
        bytes; a failed opening is raised to each of them and not kept."""
        proc = self.client.process()
        mine: dict[int, Future] = {}  # positions this thread opens
        theirs: dict[int, Future] = {}  # positions another thread is opening
        with proc.lock:
            held = [proc.files.get(rel) for rel in files]
            for i, entry in enumerate(held):
                if entry is not None:
                    proc.files.move_to_end(entry.rel)
                elif (pending := proc.opening.get(files[i])) is not None:
                    theirs[i] = pending
                else:
                    pending = proc.opening[files[i]] = Future()
                    pending.set_running_or_notify_cancel()
                    mine[i] = pending
        first: dict[int, memoryview] = {}
        if mine:
            try:
                opened = proc.map(lambda i: _outcome(self._open, files[i], retry), list(mine))
            except BaseException as err:  # the waiters hear of it too, never wait for ever
                opened = [err] * len(mine)
            with proc.lock:
                for i, got in zip(mine, opened, strict=True):
                    del proc.opening[files[i]]
                    if not isinstance(got, BaseException):
                        proc.files[got[0].rel] = held[i] = got[0]
                        first[i] = got[1]
                while len(proc.files) > self.max_open:
                    proc.files.popitem(last=False)
            for pending, got in zip(mine.values(), opened, strict=True):
                if isinstance(got, BaseException):
                    pending.set_exception(got)
                else:
                    pending.set_result(got)
            for got in opened:
                if isinstance(got, BaseException):
                    raise got
        for i, pending in theirs.items():  # the same object twice in files: opened above
            held[i], first[i] = pending.result()
        return held, first  # type: ignore[return-value]

    def replace(self, old: ObjectEntry, retry: Retry) -> tuple[ObjectEntry, memoryview]:
        """A newly opened entry for ``old.rel`` (and its first bytes) in place of ``old``."""
        fresh, data = self._open(old.rel, retry)
        proc = self.client.process()
        with proc.lock:
            proc.files[old.rel] = fresh
        return fresh, data

    def lease(self, files: Sequence[str], retry: Retry) -> ObjectLease:
        return ObjectLease(self, files, retry)

    def sink(self, file: str, *, fsync: bool) -> ObjectSink:
        """One object per write (a PUT returns once the object is stored: ``fsync`` adds
        nothing)."""
        return ObjectSink(self.client, file)

    def listing(self, suffix: str) -> tuple[list[Listed], list[PayloadError]]:
        """Every ``*suffix`` object under the prefix (a listing that fails raises)."""
        prefix = f"{self.url.prefix}/" if self.url.prefix else ""
        found = [
            Listed(self.url.rel(m["path"]), m["last_modified"].timestamp())
            for m in self.client.process().obstore.keys(prefix, where=self.path, rel=".")
            if m["path"].endswith(suffix)
        ]
        return sorted(found, key=lambda f: f.rel), []

    def put_blob(self, rel: str, data: bytes) -> bool:
        """Store ``data`` as object ``rel`` unless one of that name exists (then leave it as
        it is); True when this call wrote it (one conditional PUT: nothing is ever rewritten)."""
        client, where = self.client.process().obstore, self.where(rel)
        try:
            client.put(self.url.key(rel), bytes(data), multipart=False, where=where, rel=rel)
        except PayloadPathError:  # the name exists: another writer stored it
            return False
        return True

    def get_blob(self, rel: str, retry: Retry, *, size: int) -> bytes:
        """The ``size`` bytes of object ``rel`` (one GET, after the bounded retry for a missing
        one); an object of another size is :class:`PayloadTruncatedError`."""
        client, where, key = self.client.process().obstore, self.where(rel), self.url.key(rel)

        def fetch() -> bytes:
            got = client.whole(key, limit=size, where=where, rel=rel)
            if got is None:
                raise PayloadMissingFileError("object not found", file=rel)
            return got

        data = retry.opening(rel, fetch)
        if len(data) != size:
            raise PayloadTruncatedError(
                f"object holds {len(data)} bytes, its handle says {size}", file=rel, offset=0
            )
        return data

    def open_file(self, rel: str) -> ObjectFile:
        return ObjectFile(self, rel)

    def names(self, folder: str, *, after: str = "") -> list[Listed]:
        return object_names(self.client, folder, after)

    def stage(self, rel: str, *, fsync: bool = False) -> ObjectStaged:
        """One PUT on ``commit`` (a PUT returns once the object is stored: ``fsync`` adds
        nothing)."""
        return ObjectStaged(self.client, rel)

    def delete(self, group: str) -> None:
        """Delete every object of ``group`` and abort the incomplete multipart uploads under it;
        a group with neither is :class:`PayloadMissingFileError`."""
        prune_group(self.client, group)


class ObjectFile:
    """One object opened for reading: its first ``open_bytes`` bytes, then each read of at most
    a block from the process's :class:`~rollfeed.payload.stores.object_blocks.PinnedBlocks`
    (whole blocks, each fetched once: a worker's records of a step, scattered over its file,
    cost a GET per block, not per record), a longer one in a ranged GET of its own; every GET
    with ``If-Match`` on the ETag seen at open, so the bytes all come from one object
    (``stamp``: that ETag)."""

    def __init__(self, store: S3Store, rel: str) -> None:
        self.store, self.rel, self.key = store, rel, store.url.key(rel)
        got = self._get(0, store.open_bytes, None)
        self.size, self.etag = got.size, got.etag
        # the bytes held and where they start, one value: threads read at once (positional)
        self._held: tuple[int, bytes | memoryview] = (0, got.data)
        self.stamp = f"ETag {got.etag}"

    def _get(self, start: int, end: int, etag: str | None):
        where = self.store.where(self.rel)
        return self.store.client.process().obstore.get(
            self.key, start, end, etag, where=where, rel=self.rel
        )

    def read(self, at: int, n: int) -> bytes:
        end = min(self.size, at + n)
        blocks = self.store.client.process().blocks
        start, data = self._held
        held = start <= at and at + n <= start + len(data)
        if not held and blocks.serves(at, end, self.etag):
            fetch = lambda a, b: self._get(a, b, self.etag).data  # noqa: E731
            return bytes(blocks.get(self.key, self.etag, at, end, fetch))  # type: ignore[arg-type]
        if not held:
            end = min(self.size, at + max(n, self.store.open_bytes))
            start, data = at, self._get(at, end, self.etag).data if end > at else b""
            self._held = (start, data)
        return bytes(data[at - start : at - start + n])

    def close(self) -> None:
        self._held = (0, b"")


def _outcome(fn: Callable[..., T], *args: Any) -> T | BaseException:
    """``fn(*args)``, or the error it raised (each opening's own error reaches its waiters)."""
    try:
        return fn(*args)
    except BaseException as err:  # handed to the future, then raised by acquire
        return err
