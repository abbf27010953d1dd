"""The payload root: where payload files live, and the policy every read runs under.

A :class:`PayloadRoot` is a small picklable value: a :class:`~rollfeed.payload.stores.store.Store`,
chosen from the path (a directory: :class:`~rollfeed.payload.stores.local.LocalStore`;
``s3://bucket/prefix``: :class:`~rollfeed.payload.stores.s3.S3Store`), and what does not depend
on the store: the retry policy (:meth:`PayloadRoot.run`), the checksum switch, the output bound
and prune. The store keeps its open files, clients and threads per process, so a root can be
handed to DataLoader workers and never carries a descriptor or a client across processes.

Example::

    PayloadRoot("/shared/payload")                       # a directory
    PayloadRoot("s3://rollouts/run7", endpoint="http://10.0.0.5:8333", concurrency=32)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rollfeed.payload.errors import PayloadInputError, PayloadStaleFileError, PayloadTruncatedError
from rollfeed.payload.stores.local import LocalStore
from rollfeed.payload.stores.s3 import S3Store
from rollfeed.payload.stores.store import Retry, Store, StoreLease
from rollfeed.payload.stores.store_url import is_store_url

T = TypeVar("T")
MAX_OUTPUT_BYTES = 1 << 30  # the default bound on one field's values in one read


class PayloadRoot:
    """A directory (or object-store prefix) of payload files, and how to read them.

    ``path``: a directory, or ``s3://bucket/prefix`` for an object store; ``**store_options``
    go to its store (:class:`~rollfeed.payload.stores.local.LocalStore`: ``max_open``,
    ``threads``, ``parallel_min_bytes``; :class:`~rollfeed.payload.stores.s3.S3Store`:
    ``endpoint``, credentials, ``timeout_s``, ``concurrency``, ...).

    ``retries`` / ``backoff_s``: a missing file, or a file shorter than a record needs, is reopened
    and retried with exponential backoff (shared filesystems and stores can lag; ``backoff_s``
    defaults to the store's: 20 ms local, 50 ms on an object store), then raises naming file,
    offset and the file's real size. A file replaced under its name (its file id differs from the
    record's) is reopened once, then raises :class:`PayloadStaleFileError`.
    ``verify_checksums``: every read also checks the CRC-32C of each block it reads (the whole
    blocks around its window, :mod:`rollfeed.payload.format.checksum`), raising
    :class:`~rollfeed.payload.errors.PayloadChecksumError` on a mismatch. It reads up to one block
    more at each end of a window and costs the checksum pass (``python -m rollfeed.bench payload``
    prints it).
    ``max_output_bytes``: the most bytes one field's values may take in one read (default
    1 GiB): a fixed field's ``[n, *shape]``, a ragged field's offsets and values, or its padded
    ``[n, width]`` when a width is asked for. A read past it raises
    :class:`~rollfeed.payload.errors.PayloadOutputBoundError` before that output is allocated:
    a few MiB of one file can claim tens of GiB (one row of a million kept ids read over a
    16,384-row window at ``width=10**6`` is 61 GiB; ragged, the same window lists one row many
    times only when asked to).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retries: int = 3,
        backoff_s: float | None = None,
        verify_checksums: bool = False,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        **store_options: Any,
    ) -> None:
        if retries < 0:
            raise PayloadInputError(f"PayloadRoot needs retries >= 0, got {retries}")
        self.max_output_bytes = output_bound(max_output_bytes)
        self.store: Store = (
            S3Store(path, **store_options)
            if is_store_url(path)
            else LocalStore(path, **store_options)
        )
        self.path = self.store.path
        self.retry = Retry(retries, self.store.backoff_s if backoff_s is None else backoff_s)
        self.verify_checksums = bool(verify_checksums)

    def __repr__(self) -> str:
        return f"PayloadRoot({self.path!r})"

    def close(self) -> None:
        """Let go of this process's open files and clients (reads in flight keep theirs until
        they finish; files reopen lazily on the next read)."""
        self.store.close()

    def run(self, files: Sequence[str], attempt: Callable[[StoreLease], T]) -> T:
        """``attempt(lease)`` over ``files``, retried under this root's policy.

        A :class:`PayloadTruncatedError` (a file shorter than a record needs; a short read)
        reopens the file after a backoff, up to ``retries`` times. A
        :class:`PayloadStaleFileError` (the file under the name is not the record's file)
        reopens it once. Other errors, and these once the policy is spent, propagate.
        """
        with self.store.lease(files, self.retry) as lease:
            reopened_stale: set[int] = set()
            tries = 0
            while True:
                try:
                    return attempt(lease)
                except PayloadStaleFileError as err:
                    i = lease.index(err.file)
                    if i is None or i in reopened_stale:
                        raise
                    reopened_stale.add(i)
                    lease.reopen(i)
                except PayloadTruncatedError as err:
                    i = lease.index(err.file)
                    if i is None:
                        raise
                    if tries == self.retry.retries:
                        if tries:
                            raise type(err)(
                                f"{err.message}; still so after {tries} retries",
                                file=err.file,
                                field=err.field,
                                offset=err.offset,
                                pos=err.pos,
                            ) from None
                        raise
                    self.retry.wait(tries)
                    tries += 1
                    lease.reopen(i)

    def prune(self, group: str) -> None:
        """Delete a whole group (e.g. one training step's payload directory, or its objects
        and their incomplete multipart uploads).

        On a local root the group must be a directory beneath the root, reached without
        following any symlink; a missing group is :class:`PayloadMissingFileError`, a symlink or
        a non-directory :class:`PayloadPathError`.
        """
        self.store.delete(group)
        self.close()


def output_bound(value: object) -> int:
    """``max_output_bytes`` checked: an int >= 1 (and below 2**63, the kernel's int64)."""
    if type(value) is not int or not 1 <= value < 1 << 63:
        raise PayloadInputError(
            f"max_output_bytes must be an int in [1, 2**63), got {value!r}; it bounds one "
            "field's values in one read"
        )
    return value


def as_root(root: PayloadRoot | str | os.PathLike[str]) -> PayloadRoot:
    return root if isinstance(root, PayloadRoot) else PayloadRoot(root)
