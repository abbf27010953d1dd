"""A tiny Qwen3-VL-MoE with random weights and its image processor, built locally (no download).

The vision tower (2 blocks, 8-pixel patches merged 2 x 2, one deepstack level) feeds a 2-layer
MoE text model (8 experts, top-2) of 128 ids; ids 120..123 are the image, video, vision-start
and vision-end tokens. The processor resizes an image to 16..48 pixels a side, so an image is a
``(1, h, w)`` grid of 2..6 patches a side and ``h * w / 4`` placeholder tokens. Router weights
are widened so replaying other experts changes the output visibly.

Example::

    model = tiny_vlm(seed=0)                       # float64, eval mode
    spec = ImageProcessorSpec.of(tiny_image_processor())
"""

from __future__ import annotations

import torch
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

VOCAB = 128
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 120, 121, 122, 123
TOKENS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=VIDEO_TOKEN,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)
_TEXT = dict(
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
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_VISION = dict(
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


def tiny_vlm_config() -> Qwen3VLMoeConfig:
    """The tiny model's ``Qwen3VLMoeConfig``."""
    return Qwen3VLMoeConfig(
        text_config=dict(_TEXT), vision_config=dict(_VISION), tie_word_embeddings=False, **TOKENS
    )


def tiny_vlm(*, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The tiny model, eval mode, per-expert loop (which takes float64)."""
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(tiny_vlm_config())
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    return model.to(dtype).eval()


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """Its image processor (PIL; 8-pixel patches, merge 2, 16..48 pixels a side)."""
    return Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )
