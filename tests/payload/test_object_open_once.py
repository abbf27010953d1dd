"""An object-store root opens an object once however many threads of a process ask for it at
once (a loader worker's read-ahead threads): the others wait for that opening and share it, and
a failed opening reaches each of them and is not kept."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollfeed.payload import PayloadRoot
from tests.loaders.common import write_batch


def _opened_by_two_threads(root: PayloadRoot, rel: str) -> list:
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(root.store.acquire, [rel], root.retry) for _ in range(2)]
        return [j.exception() or j.result() for j in jobs]


class _Gets:
    """The process's GETs, each held until a second GET comes (bounded): two threads opening
    one object at once both reach the store only if each opens it itself."""

    def __init__(self, root: PayloadRoot, fail: bool = False) -> None:
        self.client = root.store.client.process().obstore
        self.real, self.fail, self.keys = self.client.get, fail, []
        self.second = threading.Event()
        self.client.get = self.get

    def get(self, key, *args, **kwargs):
        self.keys.append(key)
        if len(self.keys) == 2:
            self.second.set()
        self.second.wait(0.5)
        if self.fail:
            raise RuntimeError("the store went away")
        return self.real(key, *args, **kwargs)


def _written(object_store, s3_url: str, *, seed: int):
    """A fresh root over a prefix holding two samples, and the file of the first's first
    segment (not opened yet by that root)."""
    opts = object_store.options()
    samples = write_batch(PayloadRoot(f"{s3_url}/p", **opts), 2, seed=seed)
    return PayloadRoot(f"{s3_url}/p", **opts), samples[0].payload[0].file


@pytest.mark.timeout(60)
def test_two_threads_opening_one_object_get_it_once(object_store, s3_url):
    root, rel = _written(object_store, s3_url, seed=1)
    gets = _Gets(root)
    (a, first_a), (b, first_b) = _opened_by_two_threads(root, rel)
    assert len(gets.keys) == 1, gets.keys
    assert a == b and a[0].rel == rel
    assert bytes(first_a[0]) == bytes(first_b[0])  # the opening's first bytes, shared


@pytest.mark.timeout(60)
def test_a_failed_opening_reaches_each_waiter_and_is_tried_again(object_store, s3_url):
    root, rel = _written(object_store, s3_url, seed=2)
    gets = _Gets(root, fail=True)
    got = _opened_by_two_threads(root, rel)
    assert [type(g) for g in got] == [RuntimeError, RuntimeError]
    assert len(gets.keys) == 1
    gets.fail = False
    entries, _ = root.store.acquire([rel], root.retry)
    assert entries[0].rel == rel and len(gets.keys) == 2  # not kept: opened again
