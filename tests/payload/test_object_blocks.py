"""PinnedBlocks: a pinned GET is answered from whole blocks, each fetched once per ETag, with the
bytes the plain GET would give (a range across a boundary, the object's end), the last ``keep``
kept."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.stores.object_blocks import PinnedBlocks

DATA = bytes(range(256)) * 40  # 10,240 bytes


def _store(data: bytes = DATA):
    calls: list[tuple[int, int]] = []

    def fetch(start: int, end: int) -> memoryview:
        calls.append((start, end))
        return memoryview(data[start:end])

    return fetch, calls


def test_ranges_come_from_blocks_fetched_once() -> None:
    fetch, calls = _store()
    blocks = PinnedBlocks(block_bytes=4096, keep=2)
    for start, end in ((10, 300), (300, 4000), (4000, 4200), (9000, 10_240), (10_000, 10_300)):
        got = blocks.get("k", '"e1"', start, end, fetch)
        assert bytes(got) == DATA[start:end], (start, end)
    assert calls == [(0, 4096), (4096, 8192), (8192, 12288)]  # each block once
    assert blocks.fetched == 3
    blocks.get("k", '"e1"', 0, 10, fetch)  # block 0 was let go (keep 2): fetched again
    blocks.get("k", '"e2"', 8200, 8300, fetch)  # another ETag: another object's block
    assert calls[3:] == [(0, 4096), (8192, 12288)]


def test_what_blocks_serve_and_their_bounds() -> None:
    blocks = PinnedBlocks(block_bytes=4096)
    assert blocks.serves(0, 4096, '"e"') and not blocks.serves(0, 4097, '"e"')
    assert not blocks.serves(0, 10, None) and not blocks.serves(5, 5, '"e"')
    with pytest.raises(PayloadInputError, match="block_bytes >= 1"):
        PinnedBlocks(block_bytes=0)


def test_two_blocks_are_fetched_at_once_and_one_block_once() -> None:
    both = threading.Barrier(2, timeout=10)  # each GET waits until the other one has started
    calls: list[tuple[int, int]] = []

    def fetch(start: int, end: int) -> memoryview:
        calls.append((start, end))
        both.wait()
        return memoryview(DATA[start:end])

    blocks = PinnedBlocks(block_bytes=4096)
    with ThreadPoolExecutor(6) as pool:  # three threads want block 0, three block 1
        wanted = [(10, 300), (0, 4096), (100, 200), (5000, 6000), (4096, 8192), (8000, 8100)]
        got = [pool.submit(blocks.get, "k", '"e"', a, b, fetch) for a, b in wanted]
        for (a, b), future in zip(wanted, got, strict=True):
            assert bytes(future.result(20)) == DATA[a:b]
    assert sorted(calls) == [(0, 4096), (4096, 8192)] and blocks.fetched == 2


def test_a_failed_fetch_reaches_every_waiter_and_is_tried_again() -> None:
    started, go = threading.Event(), threading.Event()
    calls: list[int] = []

    def fetch(start: int, end: int) -> memoryview:
        calls.append(start)
        if len(calls) == 1:
            started.set()
            assert go.wait(10)
            raise PayloadInputError("the store said no")
        return memoryview(DATA[start:end])

    blocks = PinnedBlocks(block_bytes=4096)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(blocks.get, "k", '"e"', 0, 10, fetch)
        assert started.wait(10)
        second = pool.submit(blocks.get, "k", '"e"', 20, 30, fetch)  # waits on the first GET
        pending = blocks._fetching[("k", '"e"', 0)]
        while not pending._condition._waiters:  # type: ignore[attr-defined]  # until it waits
            time.sleep(0.001)
        go.set()
        for future in (first, second):
            with pytest.raises(PayloadInputError, match="said no"):
                future.result(10)
    assert calls == [0] and blocks.fetched == 0
    assert bytes(blocks.get("k", '"e"', 0, 10, fetch)) == DATA[:10] and calls == [0, 0]
