"""MediaBatch: the images of one micro batch as one ``cp`` rank feeds them to the model.

A micro batch whose samples hold images carries, beside its token tensors, one
:class:`MediaBatch` (``TensorMicroBatch.media``; ``None`` for a text-only micro batch, which is
then exactly what it is without images). For a row of ``S`` tokens split over ``cp`` ranks
(``N = S / cp`` tokens here, in the order of ``TensorMicroBatch.positions``):

- ``mrope_position_ids [3, N]`` int64: the three mRoPE axes of this rank's tokens
  (:mod:`rollfeed.collate.mrope`, restarting at every sample; padding counts on like text);
  ``TensorMicroBatch.position_ids`` stays the one-axis position that sample boundaries and
  attention read;
- ``image_mask [N]`` bool: this rank's placeholder tokens (``mm_token_type_ids`` is its int form);
- ``image_spans [R, 3]`` int64: every placeholder run of the *whole* row, in row order, as
  ``(row start, tokens, image)``, ``image`` indexing the row's distinct images;
- ``image_grid_thw [U, 3]`` int64: each distinct image's patch grid (the vision tower's
  ``grid_thw``), ``image_owner [U]`` int64: the cp rank that encodes it
  (:mod:`rollfeed.collate.image_owners`);
- ``pixel_values [P, D]`` float32: the processed patches of the images this rank encodes, image
  after image in index order (``P`` their patches; ``[0, D]`` when it encodes none).

Worked example: a row of 12 tokens holding sample A (an image of 4 tokens at 1..4) and sample B
(the same image at 8..11), cp 2, contiguous::

    image_spans [[1, 4, 0], [8, 4, 0]]   image_grid_thw [[1, 4, 4]]   image_owner [0]
    rank 0: image_mask [0, 1, 1, 1, 1, 0]   pixel_values [16, D]   (it encodes image 0)
    rank 1: image_mask [0, 0, 1, 1, 1, 1]   pixel_values [0, D]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MediaBatch:
    """The images of one micro batch as one cp rank holds them; see the module doc."""

    mrope_position_ids: torch.Tensor
    image_mask: torch.Tensor
    image_spans: torch.Tensor
    image_grid_thw: torch.Tensor
    image_owner: torch.Tensor
    pixel_values: torch.Tensor

    @property
    def mm_token_type_ids(self) -> torch.Tensor:
        """``[N]`` int32: 1 on placeholder tokens, 0 elsewhere (the processors' token types)."""
        return self.image_mask.to(torch.int32)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MediaBatch:
        """A copy with ``fn`` applied to every tensor, in :meth:`tensors` order."""
        return MediaBatch(**{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)})
