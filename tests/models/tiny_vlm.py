"""A tiny Qwen3-VL-MoE (vision tower, deepstack, MoE text model) built locally from a config, its
PIL image processor, and samples with images for it (no downloads).

Token ids below ``IMAGE_TOKEN`` are text; ``IMAGE_TOKEN`` is the image placeholder. The processor
turns a 16..48 pixel image into a ``(1, h, w)`` patch grid of 8-pixel patches (h, w in 2..6,
even), merged 2 x 2 into ``h * w / 4`` placeholder tokens.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from rollfeed.collate import Sample
from rollfeed.payload import ImageProcessorSpec, ImageSpan, MediaWriter

VOCAB = 128
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 120, 121, 122, 123
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]},
    tie_word_embeddings=False,
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0],
)
TOKENS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=VIDEO_TOKEN,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)


def tiny_vlm_config() -> Qwen3VLMoeConfig:
    return Qwen3VLMoeConfig(
        text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False, **TOKENS
    )


def tiny_qwen3_vl_moe(*, seed: int = 0, dtype: torch.dtype = torch.float64):
    """The tiny VLM, eval mode; routers widened so replaying other experts changes the output."""
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(tiny_vlm_config())
    model.set_experts_implementation("eager")  # the grouped kernels refuse float64
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    return model.to(dtype).eval()


def tiny_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )


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
