"""The images of a planned micro batch as one cp rank's :class:`~rollfeed.collate.MediaBatch`.

Called by :func:`~rollfeed.collate.to_tensor_micro_batch` (in a DataLoader worker under the
loader): mRoPE positions of the whole row, cut to the rank's positions; the row's distinct images
and the deal of them over the ``cp`` ranks (:mod:`rollfeed.collate.image_owners`); and, for the
images this rank encodes only, the bytes read by handle (:func:`rollfeed.payload.read_media`, or
taken inline) and processed with the model's image processor
(:meth:`~rollfeed.payload.ImageProcessorSpec.process`). An image recorded with other processor
settings than the given ones, or whose processed grid is not its recorded grid, is an
:class:`~rollfeed.collate.ImageInputError` naming the sample and position: its placeholder run
and positions were made for another grid.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from rollfeed.collate.errors import BatchConfigError, ImageInputError
from rollfeed.collate.image_owners import deal_images
from rollfeed.collate.media_batch import MediaBatch
from rollfeed.collate.micro_batch import MicroBatch
from rollfeed.collate.mrope import mrope_positions
from rollfeed.payload import ImageProcessorSpec, ImageSpan, PayloadRoot, read_media


def media_batch(
    mb: MicroBatch,
    idx: np.ndarray,
    *,
    cp_rank: int,
    position_ids: np.ndarray,
    root: PayloadRoot | str | os.PathLike[str] | None,
    processor: ImageProcessorSpec | None,
) -> MediaBatch | None:
    """The rank's :class:`MediaBatch` (``idx [N]``: its row positions; ``position_ids [S]``: the
    row's one-axis positions), or None when no sample of ``mb`` holds an image."""
    if not any(s.images for s in mb.samples):
        return None
    if processor is None:
        raise ImageInputError(
            "the micro batch holds images; give the model's image processor "
            "(image_processor=ImageProcessorSpec.of(processor))",
            field="images",
        )
    if root is not None and not isinstance(root, PayloadRoot):
        root = PayloadRoot(root)
    mrope = np.repeat(position_ids[None], 3, axis=0)  # row padding counts like text
    mask = np.zeros(mb.length, bool)
    spans, keys, first = [], {}, []
    for k, (sample, start) in enumerate(zip(mb.samples, mb.starts, strict=True)):
        slot = mb.cu_seqlens[k + 1] - start  # the sample and its zigzag padding, counted on
        mrope[:, start : start + slot] = mrope_positions(slot, sample.images)
        for im in sample.images:
            u = keys.setdefault(im.key, len(keys))
            if u == len(first):
                first.append((mb.indices[k], im))
            spans.append((start + im.start, im.tokens, u))
            mask[start + im.start : start + im.end] = True
    grids = [im.grid for _, im in first]
    owner = deal_images([math.prod(g) for g in grids], mb.config.cp_size)
    pixels = [
        _pixels(im, sample, root=root, processor=processor)
        for (sample, im), rank in zip(first, owner, strict=True)
        if rank == cp_rank
    ]
    dim = processor.patch_dim
    return MediaBatch(
        mrope_position_ids=torch.from_numpy(np.ascontiguousarray(mrope[:, idx])),
        image_mask=torch.from_numpy(mask[idx]),
        image_spans=torch.tensor(spans, dtype=torch.int64).reshape(-1, 3),
        image_grid_thw=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        image_owner=torch.tensor(owner, dtype=torch.int64),
        pixel_values=torch.from_numpy(
            np.concatenate(pixels) if pixels else np.zeros((0, dim), np.float32)
        ),
    )


def _pixels(
    im: ImageSpan, sample: int, *, root: PayloadRoot | None, processor: ImageProcessorSpec
) -> np.ndarray:
    """``[patches, D]`` float32 of one image, checked against its record."""
    if im.processor is not None and im.processor != processor.sha256:
        raise ImageInputError(
            f"the image was recorded with processor settings {im.processor}, the given ones are "
            f"{processor.sha256}; process with the settings the rollout used (stored at "
            f"media/{im.processor})",
            sample=sample,
            field="images",
            pos=im.start,
        )
    if im.media is None:
        data, file = im.data, None
    elif root is None:
        raise BatchConfigError(
            "micro batch holds images by handle; pass root= (the payload root)",
            sample=sample,
            field="images",
        )
    else:
        data, file = read_media(root, im.media), im.media.file
    assert data is not None  # an ImageSpan holds a handle or bytes
    got = processor.process(data, file=file)
    if got.grid != im.grid:
        raise ImageInputError(
            f"the image processes to a {got.grid} patch grid, its record says {im.grid}: the "
            "processor settings differ from the rollout's",
            sample=sample,
            field="images",
            pos=im.start,
        )
    return got.pixel_values
