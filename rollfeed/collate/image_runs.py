"""Image runs: where each sample's placeholder tokens lie, and the cut that never splits an image.

An image stands for a run of placeholder tokens ``[start, end)`` (its
:class:`~rollfeed.payload.ImageSpan`); half a run cannot be embedded (the vision tower gives all
of an image's tokens or none). A sample longer than ``seq_len`` is therefore cut at ``seq_len``
unless that position falls inside a run; then it is cut *before* that image, and when nothing
precedes the image (a run starting at token 0) it is dropped. The planner counts both
(``truncated_before_image``, ``dropped_at_image``).

A step's image runs are a :class:`~rollfeed.collate.runs.Runs` table (runs may touch: two images
back to back). Worked example (``seq_len=8``)::

    lengths [12, 10, 6]   runs [[[2, 6], [6, 10]], [[0, 9]], [[1, 4]]]
    cuts    [6, 0, 6]     # sample 0 cut before its second image, sample 1 dropped, sample 2 whole
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from rollfeed.collate.runs import Runs
from rollfeed.collate.sample import Sample
from rollfeed.payload import ImageSpan


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ImageRuns(Runs):
    """Every sample's image placeholder runs, in token order (see the module doc)."""

    ADJACENT: ClassVar[bool] = True

    @classmethod
    def of_images(cls, images: Sequence[Sequence[ImageSpan]]) -> ImageRuns:
        """The runs of each sample's ``images``, in order."""
        spans = [(im.start, im.end) for each in images for im in each]
        return cls(
            counts=np.fromiter(map(len, images), np.int64, len(images)),
            spans=np.array(spans, np.int64).reshape(-1, 2),
        )

    @classmethod
    def of_samples(cls, samples: Sequence[Sample]) -> ImageRuns:
        return cls.of_images([s.images for s in samples])

    def cuts(self, lengths: np.ndarray, seq_len: int) -> np.ndarray:
        """``[n]`` int64: the tokens each sample keeps under ``seq_len`` (0: dropped); see the
        module doc."""
        kept = np.minimum(np.asarray(lengths, np.int64), seq_len)
        owner = self.owner
        at = kept[owner]
        split = (self.spans[:, 0] < at) & (self.spans[:, 1] > at)
        kept[owner[split]] = self.spans[split, 0]
        return kept


def image_cut(images: Sequence[ImageSpan], length: int) -> int:
    """The tokens a sample with ``images`` keeps when cut at ``length``: ``length``, or the start
    of the image whose run it would split."""
    for im in images:
        if im.start < length < im.end:
            return im.start
    return length
