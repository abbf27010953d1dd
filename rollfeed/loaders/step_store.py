"""Step files in an object store: ``RolloutDataset.from_step_dir("s3://bucket/prefix")``.

The same objects as in a step directory (``step_000042.jsonl`` and its index
``step_000042.index.json``, :mod:`rollfeed.loaders.step_files`), under a key prefix. A PUT is
atomic, so :meth:`StepStore.write_step_file` PUTs the index first and the step file second: a
reader that sees a step file sees its index, as with ``os.replace`` on a filesystem.

Planning fetches the index only (one GET) and the step file's size and ETag (a HEAD: its
:class:`~rollfeed.loaders.step_version.StepVersion`); a worker fetches only its own lines
(one ranged GET each, one byte before the line included, as
:func:`~rollfeed.loaders.step_index_check.read_indexed_sample` checks it), each with ``If-Match`` on
that ETag, so a step object replaced after planning is refused
(:class:`~rollfeed.loaders.errors.StepReplacedError`), never read as the planned one; each line is
held to the index's CRC-32C as locally. The bounded, logged wait for the next step polls the store
(:mod:`~rollfeed.loaders.step_wait`). Every read has a bound of its own: the index GET at most
``ANSWER_BYTES`` (refused from its headers, unread), a line at most ``MAX_LINE_BYTES``, a step
without an index parsed in ranged GETs with the bounds of :mod:`~rollfeed.loaders.step_lines`.
Every request goes through the payload's object-store client
(:class:`~rollfeed.payload.stores.object_client.ObstoreClient`: obstore, and botocore's bounded
listing; the same retry policy and credentials as a payload root's),
created lazily per process (keyed by pid); a process forked after its parent used the store
is refused (:class:`PayloadInputError`), never left to hang: a loader over step files in a
store starts its workers from a fork server.

Example::

    steps = StepStore("s3://rollouts/run7/steps", endpoint="http://10.0.0.5:8333")
    steps.write_step_file(3, samples)     # PUT step_000003.index.json, then step_000003.jsonl
    steps.list_steps()                    -> [3]
"""

from __future__ import annotations

import os

from rollfeed.collate import Sample
from rollfeed.loaders.errors import StepMissingError
from rollfeed.loaders.step_files import parse_step_name, step_file_name
from rollfeed.loaders.step_index import (
    StepIndex,
    index_of_lines,
    index_path,
    step_index_bytes,
    step_index_from_bytes,
)
from rollfeed.loaders.step_index_check import read_indexed_sample
from rollfeed.loaders.step_lines import ParsedStep, parse_step
from rollfeed.loaders.step_open import Pread
from rollfeed.loaders.step_version import StepVersion, replaced_error
from rollfeed.loaders.step_wait import describe_steps, wait_for_step
from rollfeed.payload.errors import PayloadInputError, PayloadStaleFileError
from rollfeed.payload.stores.object_answer import ANSWER_BYTES
from rollfeed.payload.stores.object_blocks import PinnedBlocks
from rollfeed.payload.stores.object_client import ObstoreClient
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class StepStore:
    """Step files under ``s3://bucket/prefix`` (picklable; clients are made per process).

    ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
    ``profile``, ``metadata_endpoint``: as for :class:`~rollfeed.payload.stores.s3.S3Store`
    (``None``: found where the AWS libraries look).
    """

    def __init__(self, url: str, **access: object) -> None:
        self.url = StoreURL.parse(url)
        self.access = StoreAccess(**access)  # type: ignore[arg-type]
        self._client: ObstoreClient | None = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "access": self.access}

    def __setstate__(self, state: dict) -> None:
        self.url, self.access, self._client = state["url"], state["access"], None

    def __repr__(self) -> str:
        return f"StepStore({str(self.url)!r})"

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _reader(self) -> ObstoreClient:
        client = self._client
        if client is not None and client.pid != os.getpid():
            raise PayloadInputError(
                f"this process was forked from one that used the step store {self.url}: "
                "obstore's runtime does not survive fork (the first request would hang); start "
                "it from a fork server or spawn it (multiprocessing.get_context('forkserver'))"
            )
        if client is None:
            # a worker's sample reads: a GET per block of the step, not per sample
            client = self._client = ObstoreClient(self.access, self.url, blocks=PinnedBlocks())
        return client

    def _get(self, name: str, start: int, end: int, etag: str | None = None) -> bytes:
        key = self.url.key(name)
        got = self._reader().get(key, start, end, etag, where=self.where(name), rel=name)
        return bytes(got.data)

    def version(self, name: str) -> StepVersion | None:
        """Size and ETag of object ``name``; ``None`` when it does not exist."""
        got = self._reader().head(self.url.key(name), where=self.where(name), rel=name)
        return None if got is None else StepVersion.of_etag(*got)

    def size(self, name: str) -> int | None:
        """Bytes of object ``name``; ``None`` when it does not exist."""
        version = self.version(name)
        return None if version is None else version.size

    def read_all(self, name: str) -> bytes | None:
        """The whole object ``name`` (one GET, at most ``ANSWER_BYTES``: a larger one is refused
        from its headers, unread); ``None`` when it does not exist."""
        key, where = self.url.key(name), self.where(name)
        return self._reader().whole(key, limit=ANSWER_BYTES, where=where, rel=name)

    def _pinned(self, step: int, version: StepVersion) -> Pread:
        """``pread(n, offset)`` of step ``step``'s object, refused unless it is ``version``."""
        name = step_file_name(step)

        def pread(n: int, at: int) -> bytes:
            try:
                return self._get(name, at, at + n, version.etag)
            except PayloadStaleFileError:  # If-Match failed: another object under the key
                raise replaced_error(step, self.where(name), version, "another ETag") from None

        return pread

    def list_steps(self) -> list[int]:
        """Sorted step numbers of the step files present under the prefix (every page of a
        bounded listing: :mod:`~rollfeed.payload.stores.object_botocore`)."""
        prefix = f"{self.url.prefix}/" if self.url.prefix else ""
        signed, where = self._reader().signed(), self.where(prefix)
        steps, token = [], None
        while True:
            query = {"list-type": "2", "prefix": prefix, "delimiter": "/"}
            if token:
                query["continuation-token"] = token
            tree = signed.xml("GET", "", what="LIST", where=where, query=query)
            for el in tree.iter(f"{_NS}Key"):
                step = parse_step_name((el.text or "")[len(prefix) :])
                if step is not None:
                    steps.append(step)
            token = tree.findtext(f"{_NS}NextContinuationToken")
            if tree.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return sorted(steps)

    def wait_for_step(
        self, step: int, *, timeout_s: float, exact: bool = True, poll_s: float = 0.05
    ) -> int:
        """Step ``step`` once its file exists (``exact=False``: the first step from ``step`` on
        that has one); logs while it waits and raises :class:`StepTimeoutError` after
        ``timeout_s`` (the store is polled, each request within the client's own bounds:
        :mod:`rollfeed.loaders.step_wait`)."""
        name = step_file_name(step)

        def find() -> int | None:
            if exact:
                return step if self.size(name) is not None else None
            return next((s for s in self.list_steps() if s >= step), None)

        return wait_for_step(
            find,
            step,
            exact=exact,
            where=str(self.url),
            file=self.where(name),
            describe=lambda: describe_steps(self.list_steps()),
            timeout_s=timeout_s,
            poll_s=poll_s,
        )

    def step_version(self, step: int) -> StepVersion:
        """Step ``step``'s object's version; :class:`StepMissingError` when it does not exist."""
        name = step_file_name(step)
        version = self.version(name)
        if version is None:
            raise StepMissingError(
                f"step {step} has no step file {name} under {self.url}; list the steps present "
                "with list_steps(), or wait for it (stream=True)",
                file=self.where(name),
                step=step,
            )
        return version

    def read_index(self, step: int) -> StepIndex | None:
        """Step ``step``'s checked index, or ``None`` when it has none (:meth:`read_versioned_index`
        without the version)."""
        got = self.read_versioned_index(step)
        return None if got is None else got[0]

    def read_versioned_index(self, step: int) -> tuple[StepIndex, StepVersion] | None:
        """Step ``step``'s checked index (one GET, plus one for the step file's size and ETag)
        and the version it was checked against, or ``None`` when it has no index."""
        name = step_file_name(step)
        iname = index_path(name).name
        text = self.read_all(iname)
        if text is None:
            return None
        version = self.step_version(step)
        index = step_index_from_bytes(
            text,
            self.where(name),
            self.where(iname),
            size=version.size,
            pread=self._pinned(step, version),
        )
        return index, version

    def read_sample(self, index: StepIndex, version: StepVersion, step: int, i: int) -> Sample:
        """Sample ``i`` of step ``step``: a ranged GET of its line only, of ``version`` only."""
        pinned = self._pinned(step, version)
        return read_indexed_sample(pinned, index, i, file=self.where(step_file_name(step)))

    def read_step_file(self, step: int) -> tuple[ParsedStep, StepVersion]:
        """Every sample of step ``step`` (the whole object, parsed in ranged GETs of a few MiB
        with the bounds of :mod:`~rollfeed.loaders.step_lines`) and its version."""
        version = self.step_version(step)
        where = self.where(step_file_name(step))
        return parse_step(self._pinned(step, version), version.size, file=where), version

    def write_step_file(self, step: int, samples: list[Sample] | tuple[Sample, ...]) -> str:
        """PUT step ``step``'s index, then its step file; returns the step file's URL."""
        name = step_file_name(step)
        lines = [(s.to_json() + "\n").encode("utf-8") for s in samples]
        index = index_of_lines(lines, samples)
        client = self._reader()
        for obj, data in (
            (index_path(name).name, step_index_bytes(index)),
            (name, b"".join(lines)),
        ):
            client.overwrite(self.url.key(obj), data, where=self.where(obj), rel=obj)
        return self.where(name)
