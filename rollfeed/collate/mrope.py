"""mRoPE positions: the three position axes (temporal, height, width) of a sample with images.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate each query and key by three positions. Text tokens have
all three equal, counting on from the position before them; an image's placeholder tokens form its
``t x h x w`` grid of merged patches (``ImageSpan.llm_grid``) and take, from the current position
``p``, ``(p + i, p + j, p + k)`` for grid cell ``(i, j, k)``; the text after the image resumes at
``p + max(h, w)`` (an image's ``t`` is 1). This is what transformers' ``get_rope_index`` computes
for those families, one sample at a time; positions depend only on the sample's own tokens, so a
truncated sample's positions are a prefix of the whole sample's, and in a packed row they
restart at every sample.

Worked example (2 text tokens, an image of 2 x 3 merged tokens, 2 text tokens)::

    mrope_positions(10, [ImageSpan(start=2, tokens=6, grid=(1, 4, 6), ...)])
    t: [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]
    h: [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
    w: [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollfeed.payload import ImageSpan


def mrope_positions(length: int, images: Sequence[ImageSpan], start: int = 0) -> np.ndarray:
    """``[3, length]`` int64 positions of a sample of ``length`` tokens whose images are
    ``images`` (in token order, inside the sample), counting from ``start``."""
    out = np.empty((3, length), np.int64)
    at, p = 0, start
    for im in images:
        n = im.start - at
        out[:, at : im.start] = p + np.arange(n)
        p += n
        t, h, w = im.llm_grid
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        out[:, im.start : im.end] = p + grid.reshape(3, -1)
        p += max(h, w)
        at = im.end
    out[:, at:] = p + np.arange(length - at)
    return out
