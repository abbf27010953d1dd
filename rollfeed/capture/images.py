"""The images of a captured request: stored once by handle, each tied to its placeholder run.

A request with images (the capture route's ``images``, or the images vLLM's OpenAI handlers load
from ``image_url`` content parts) holds each image as a run of the model's image placeholder
token in its prompt, one run per image in order, of the length the model's image processor makes
of it (``h * w / merge**2`` for a ``(1, h, w)`` patch grid; vLLM expands a single placeholder
to that run itself). :func:`capture_images` walks the engine's prompt ids with the images,
checks each run against the processor (other settings than the engine's would give the trainer
other positions), writes each image of the turn under the payload root once
(:class:`~rollfeed.payload.MediaWriter`: ``media/<sha256>``) and returns its
:class:`~rollfeed.payload.ImageSpan`, turn-relative like every record of the turn; the processor
settings its ``processor`` digest names are stored once beside them
(``media/<processor digest>``: the canonical JSON of the
:class:`~rollfeed.payload.ImageProcessorSpec`). Images of
earlier turns (before ``prompt_start``) were captured with their turn and are skipped.

Worked example (placeholder 9, an image of a (1, 4, 6) grid, merge 2: 6 tokens; a turn from 0)::

    capture_images([png], prompt_ids=[1, 9, 9, 9, 9, 9, 9, 2], prompt_start=0, ...)
    -> [ImageSpan(start=1, tokens=6, grid=(1, 4, 6), media=MediaRef(...), processor=...)]

Images the engine gets as decoded pictures (PIL, from vLLM's handlers) are stored as PNG, which
is lossless: the trainer's processor sees the same pixels.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollfeed.capture.errors import CaptureRequestError
from rollfeed.payload import ImageProcessorSpec, ImageSpan, MediaWriter
from rollfeed.payload.errors import PayloadMediaError


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageCapture:
    """What the capture of images needs of the served model: its image processor's settings
    and its image placeholder token."""

    processor: ImageProcessorSpec
    image_token_id: int

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> ImageCapture | None:
        """From a model directory's ``config.json`` (``image_token_id``) and
        ``preprocessor_config.json`` (the processor class and settings, run on PIL); None for a
        model without images."""
        root = Path(path)
        config, pre = root / "config.json", root / "preprocessor_config.json"
        if not (config.is_file() and pre.is_file()):
            return None
        token = json.loads(config.read_text()).get("image_token_id")
        settings = json.loads(pre.read_text())
        kind = settings.pop("image_processor_type", None)
        settings.pop("processor_class", None)
        if not isinstance(token, int) or not isinstance(kind, str):
            return None
        name = kind if kind.endswith("Pil") else f"{kind.removesuffix('Fast')}Pil"
        return cls(processor=ImageProcessorSpec(name=name, config=settings), image_token_id=token)


def encoded(image: Any) -> bytes:
    """The stored bytes of one image: encoded bytes as they are, a decoded picture as PNG."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decoded(data: bytes) -> Any:
    """The picture of encoded bytes, for the engine (``multi_modal_data``)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def capture_images(
    images: Sequence[bytes],
    *,
    prompt_ids: Sequence[int] | np.ndarray,
    prompt_start: int,
    capture: ImageCapture,
    writer: MediaWriter,
) -> list[ImageSpan]:
    """The image records of the turn from ``prompt_start`` (see the module doc); a
    :class:`~rollfeed.capture.CaptureRequestError` when the images and the placeholder runs of
    the prompt do not match."""
    ids = np.asarray(prompt_ids, np.int64)
    placeholder = ids == capture.image_token_id
    spec = capture.processor
    out, cursor = [], 0
    for k, data in enumerate(images):
        try:
            grid = spec.process(data).grid
        except PayloadMediaError as err:
            raise CaptureRequestError(f"image {k}: {err.message}") from None
        tokens = grid[1] * grid[2] // spec.merge_size**2
        found = np.flatnonzero(placeholder[cursor:])
        if not found.size:
            raise CaptureRequestError(
                f"the prompt holds placeholder runs for {k} images, the request {len(images)}; "
                f"give each image its run of token {capture.image_token_id}",
                pos=cursor,
            )
        start = cursor + int(found[0])
        run = placeholder[start : start + tokens]
        if run.size < tokens or not run.all():
            raise CaptureRequestError(
                f"image {k}'s placeholder run at {start} is not {tokens} tokens, what the model's "
                f"image processor makes of its {grid} patch grid; the engine and the capture "
                "must process images with the same settings",
                pos=start,
            )
        if start < prompt_start < start + tokens:
            raise CaptureRequestError(
                f"the turn starts at {prompt_start}, inside image {k}'s placeholder run "
                f"[{start}, {start + tokens}); start a turn at a token boundary between images",
                pos=prompt_start,
            )
        if start >= prompt_start:
            if not out:  # the settings the records name, stored once beside the images
                writer.put(spec.to_bytes())
            out.append(
                ImageSpan(
                    start=start - prompt_start,
                    tokens=tokens,
                    grid=grid,
                    media=writer.put(data),
                    processor=spec.sha256,
                )
            )
        cursor = start + tokens
    if placeholder[cursor:].any():
        at = cursor + int(np.argmax(placeholder[cursor:]))
        raise CaptureRequestError(
            f"placeholder token {capture.image_token_id} at {at} belongs to no image of the "
            f"request's {len(images)}",
            pos=at,
        )
    return out
