"""Which ``cp`` rank encodes which image of a packed row: the vision tower's work spread over cp.

A row's images are first made distinct (the same bytes at the same grid, e.g. the prompt image
of a GRPO group packed into one row, or an image repeated in every turn of a conversation, is
one vision input: encoded once, its embeddings placed at each of its runs), then dealt to the
``cp`` ranks largest first, each to the rank with the fewest patches so far (ties: the lower
rank). Every rank of the group computes the same deal from the row alone.

Worked example (distinct images of 64, 16, 48 and 16 patches, cp 2)::

    deal_images([64, 16, 48, 16], 2) -> [0, 1, 1, 0]    # 64 -> 0, 48 -> 1, 16 -> 1, 16 -> 0 (tie)
"""

from __future__ import annotations

from collections.abc import Sequence


def deal_images(patches: Sequence[int], cp_size: int) -> list[int]:
    """``[U]``: the cp rank that encodes each distinct image (see the module doc)."""
    load = [0] * cp_size
    owner = [0] * len(patches)
    for u in sorted(range(len(patches)), key=lambda u: -patches[u]):
        rank = min(range(cp_size), key=lambda r: (load[r], r))
        owner[u] = rank
        load[rank] += patches[u]
    return owner
