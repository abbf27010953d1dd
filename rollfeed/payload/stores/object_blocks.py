"""PinnedBlocks: one process's copy of parts of objects, in aligned blocks, for GETs pinned to an
ETag.

A loader worker reads its samples' records of a step one at a time, scattered over the step
file (the plan packs by length, not by position). One ranged GET each costs a round trip, and on
a store that compresses what it holds (SeaweedFS gzips compressible objects in chunks of a few
MiB) the decompression of a whole chunk: over ``python -m rollfeed.bench object_store``'s server a
sample's GET took 60-90 ms where the same bytes of an incompressible object took 2-5 ms, and a
worker spent 150-590 ms of each micro batch reading its samples. An object read by range
(:class:`~rollfeed.payload.stores.s3.ObjectFile`, pinned to the ETag of its first GET: its bytes
cannot change, another object under the key fails ``If-Match``) is read through the process's
``PinnedBlocks``: whole ``block_bytes`` blocks, each fetched once with that ETag and kept (the
last ``keep``, least recently used out first), so the samples of a step cost a GET per block,
not per sample. A range longer than a block goes to the store as it is.

The cost is bandwidth when a process needs few of a block's bytes (a rank of a wide data-parallel
world reads 1/dp of a step): up to one block per sample it reads, fetched in one GET each. Every
request goes through the store's own ``fetch`` (its retries, errors and checks), so a failure is
the typed error the plain GET raises, for the block that holds the range.

Example (blocks of 4 MiB; a sample's record at bytes [5,000,000, 5,300,000) of a step file)::

    blocks.get("run7/steps/step_000003.rfs", '"9b2c..."', 5_000_000, 5_300_000, fetch)
    -> fetch(4 MiB, 8 MiB) once; this and every later record of that block: slices of it
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from rollfeed.payload.errors import PayloadInputError

BLOCK_BYTES = 4 << 20
KEEP = 8  # blocks held per process: 32 MiB at the default block size


class PinnedBlocks:
    """Blocks of objects, keyed by ``(key, ETag, block number)`` (see the module doc); shared by a
    process's threads: a block is fetched once however many threads want it (one future per
    block in flight), and blocks are fetched concurrently (the lock guards the table only,
    never a GET)."""

    def __init__(self, *, block_bytes: int = BLOCK_BYTES, keep: int = KEEP) -> None:
        if block_bytes < 1 or keep < 1:
            raise PayloadInputError(
                f"PinnedBlocks needs block_bytes >= 1 and keep >= 1, got {block_bytes}, {keep}"
            )
        self.block_bytes, self.keep = block_bytes, keep
        self.fetched = 0  # GETs made for blocks (what the benchmark reports)
        self._blocks: OrderedDict[tuple[str, str, int], memoryview] = OrderedDict()
        self._fetching: dict[tuple[str, str, int], Future[memoryview]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # a new process starts with no blocks of its own
        return {"block_bytes": self.block_bytes, "keep": self.keep}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def serves(self, start: int, end: int, etag: str | None) -> bool:
        """Whether a GET of ``[start, end)`` pinned to ``etag`` is answered from blocks."""
        return etag is not None and 0 <= start < end and end - start <= self.block_bytes

    def get(
        self, key: str, etag: str, start: int, end: int, fetch: Callable[[int, int], memoryview]
    ) -> memoryview:
        """Bytes ``[start, end)`` of ``key`` (fewer past its end), from the blocks that hold them;
        ``fetch(lo, hi)`` is the store's GET of a missing block ``[lo, hi)`` (its bytes)."""
        b = self.block_bytes
        first, last = start // b, (end - 1) // b
        parts = []
        for n in range(first, last + 1):
            parts.append(self._block(key, etag, n, fetch))
            if len(parts[-1]) < b:  # the object ends in this block
                break
        lo = start - first * b
        whole = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))  # across a boundary
        return whole[lo : lo + end - start]

    def _block(
        self, key: str, etag: str, n: int, fetch: Callable[[int, int], memoryview]
    ) -> memoryview:
        """Block ``n``: held, or being fetched by another thread (waited for), or fetched here.
        A failed fetch is raised to every thread that waited for it and not kept: the next ask
        fetches again."""
        name = (key, etag, n)
        with self._lock:
            data = self._blocks.get(name)
            if data is not None:
                self._blocks.move_to_end(name)
                return data
            pending = self._fetching.get(name)
            if pending is None:
                pending = self._fetching[name] = Future()
                pending.set_running_or_notify_cancel()
                mine = True
            else:
                mine = False
        if not mine:
            return pending.result()
        try:
            data = fetch(n * self.block_bytes, (n + 1) * self.block_bytes)
        except BaseException as err:
            with self._lock:
                del self._fetching[name]
            pending.set_exception(err)
            raise
        with self._lock:
            del self._fetching[name]
            self.fetched += 1
            self._blocks[name] = data
            while len(self._blocks) > self.keep:
                self._blocks.popitem(last=False)
        pending.set_result(data)
        return data
