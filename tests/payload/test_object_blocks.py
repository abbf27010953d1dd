"""PinnedBlocks: a pinned GET is answered from whole blocks, each fetched once per ETag, with the
bytes the plain GET would give (a range across a boundary, the object's end), the last ``keep``
kept."""

from __future__ import annotations

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
