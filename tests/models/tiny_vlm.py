"""Samples with images for the tiny Qwen3-VL-MoE (:mod:`rollfeed.demo.tiny_vlm`: the model and
its PIL image processor, built locally from a config; re-exported here under the tests' names).

Token ids below ``IMAGE_TOKEN`` are text; ``IMAGE_TOKEN`` is the image placeholder. The processor
turns a 16..48 pixel image into a ``(1, h, w)`` patch grid of 8-pixel patches (h, w in 2..6,
even), merged 2 x 2 into ``h * w / 4`` placeholder tokens.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image

from rollfeed.collate import Sample
from rollfeed.demo.tiny_vlm import (
    IMAGE_TOKEN,
    TOKENS,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    tiny_vlm_config,
)
from rollfeed.demo.tiny_vlm import tiny_image_processor as tiny_processor
from rollfeed.demo.tiny_vlm import tiny_vlm as tiny_qwen3_vl_moe
from rollfeed.payload import ImageProcessorSpec, ImageSpan, MediaWriter

__all__ = [
    "IMAGE_TOKEN",
    "TOKENS",
    "VIDEO_TOKEN",
    "VISION_END",
    "VISION_START",
    "VOCAB",
    "image_span",
    "one_thread",
    "png",
    "processor_spec",
    "tiny_processor",
    "tiny_qwen3_vl_moe",
    "tiny_vlm_config",
    "vlm_sample",
]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread while the tiny model runs: on a busy machine more threads only wait
    on each other (10-100x slower forwards measured on 2 shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def processor_spec() -> ImageProcessorSpec:
    return ImageProcessorSpec.of(tiny_processor())


def png(rng: np.random.Generator, height: int | None = None, width: int | None = None) -> bytes:
    h = int(rng.integers(16, 49)) if height is None else height
    w = int(rng.integers(16, 49)) if width is None else width
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_span(
    data: bytes, start: int, spec: ImageProcessorSpec, writer: MediaWriter | None = None
) -> ImageSpan:
    """The image record of ``data`` at ``start``: by handle through ``writer``, else inline."""
    grid = spec.process(data).grid
    tokens = grid[1] * grid[2] // spec.merge_size**2
    media = None if writer is None else writer.put(data)
    return ImageSpan(
        start=start,
        tokens=tokens,
        grid=grid,
        media=media,
        data=None if writer is not None else data,
        processor=spec.sha256,
    )


def vlm_sample(
    rng: np.random.Generator,
    pieces: list[int | bytes],
    spec: ImageProcessorSpec,
    *,
    writer: MediaWriter | None = None,
    prompt: int | None = None,
    uid: str | None = None,
    **fields,
) -> Sample:
    """A sample of text runs (an int: that many random text tokens) and images (bytes: the
    image's placeholder run); the loss on the tokens from ``prompt`` (default: the last text
    run)."""
    ids, images = [], []
    for piece in pieces:
        if isinstance(piece, bytes):
            im = image_span(piece, len(ids), spec, writer)
            images.append(im)
            ids += [IMAGE_TOKEN] * im.tokens
        else:
            ids += rng.integers(0, IMAGE_TOKEN, piece).tolist()
    T = len(ids)
    start = T - pieces[-1] if prompt is None and isinstance(pieces[-1], int) else prompt or 0
    return Sample(
        np.array(ids),
        loss_mask=np.arange(T) >= start,
        advantages=rng.standard_normal(T).astype(np.float32),
        inference_logprobs=-rng.random(T, dtype=np.float32),
        images=images,
        uid=uid,
        **fields,
    )
