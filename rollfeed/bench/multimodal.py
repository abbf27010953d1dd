"""Multimodal benchmark: ``python -m rollfeed.bench multimodal [--repeats N]``.

What to store for an image, and where the vision work goes. Synthetic photographs (smooth fields,
edges and grain, so they compress like pictures, not like noise) at three sizes, processed by
Qwen2-VL's PIL image processor at its defaults (14-pixel patches, merge 2). Prints:

- bytes stored per image: the encoded image (PNG, JPEG quality 90) against its processed
  patches (``pixel_values``, float32), and the ratio;
- worker time per image: decoding and processing the encoded image (what a DataLoader worker
  does per image it reads) against reading processed patches back (a copy of their bytes);
- the vision tower's time per cp rank, cp 1 against cp 2: a row of 8 images (a GRPO group's
  prompt image 4 times and 4 others) encoded by a Qwen3-VL-shaped tower (depth 4, width 256,
  float32), each rank encoding the distinct images the row's deal gives it
  (:mod:`rollfeed.collate.image_owners`); one process runs each rank's share in turn, so the
  times are per rank, not a wall time of real ranks. Also the time without de-duplication
  (every run its own encoding).

Ratios are measured side by side in one run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import io
import math
import time

import numpy as np
import torch

from rollfeed.collate.image_owners import deal_images
from rollfeed.payload import ImageProcessorSpec

SIZES = ((224, 224), (448, 448), (896, 672))


def _photo(height: int, width: int, seed: int) -> np.ndarray:
    """``[H, W, 3]`` uint8: low-frequency colour fields, a few hard edges and film grain."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    img = np.zeros((height, width, 3))
    for c in range(3):
        for _ in range(4):
            fy, fx, ph = [*rng.uniform(0.5, 4, 2).tolist(), rng.uniform(0, 6.3)]
            img[..., c] += np.sin(2 * np.pi * (fy * y + fx * x) + ph)
    for _ in range(6):  # flat shapes with sharp borders
        cy, cx, r = rng.uniform(0, 1, 3).tolist()
        img[(y - cy) ** 2 + (x - cx) ** 2 < (0.2 * r) ** 2] += rng.uniform(-2, 2, 3)
    img = (img - img.min()) / (img.max() - img.min()) * 235 + rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _best(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def storage(spec: ImageProcessorSpec, repeats: int) -> None:
    print("bytes stored per image, and worker time per image (decode + process vs read patches)")
    head = f"{'image':>9} {'PNG':>9} {'JPEG':>9} {'patches':>10} {'patches/JPEG':>13}"
    print(f"{head} {'JPEG ms':>8} {'PNG ms':>7} {'read ms':>8} {'(JPEG)/read':>12}")
    for k, (h, w) in enumerate(SIZES):
        pixels = _photo(h, w, k)
        png, jpeg = _encode(pixels, "PNG"), _encode(pixels, "JPEG")
        patches = spec.process(jpeg).pixel_values
        raw = patches.tobytes()
        t_jpeg = _best(lambda data=jpeg: spec.process(data), repeats)
        t_png = _best(lambda data=png: spec.process(data), repeats)
        t_read = _best(lambda data=raw: np.frombuffer(bytearray(data), np.float32), repeats)
        print(
            f"{w:>4}x{h:<4} {len(png):>9,} {len(jpeg):>9,} {len(raw):>10,} "
            f"{len(raw) / len(jpeg):>12.0f}x {t_jpeg * 1e3:>8.2f} {t_png * 1e3:>7.2f} "
            f"{t_read * 1e3:>8.3f} {t_jpeg / t_read:>11.0f}x"
        )


def _tower():
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    vision = dict(
        depth=4,
        hidden_size=256,
        intermediate_size=1024,
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=256,
        num_position_embeddings=256,
        deepstack_visual_indexes=[1],
    )
    rope = {"rope_type": "default", "mrope_section": [12, 10, 10]}
    text = dict(vocab_size=256, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_experts=2, num_experts_per_tok=1,
                rope_parameters=rope)  # fmt: skip
    torch.manual_seed(0)
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
    return model.model.visual


def vision_per_rank(spec: ImageProcessorSpec, repeats: int) -> None:
    tower = _tower()
    shared = _encode(_photo(448, 448, 10), "JPEG")
    others = [_encode(_photo(*SIZES[k % 3], 20 + k), "JPEG") for k in range(4)]
    row = [shared, others[0], shared, others[1], shared, others[2], shared, others[3]]
    distinct = list(dict.fromkeys(row))
    processed = {data: spec.process(data) for data in distinct}

    def encode(images: list[bytes]) -> None:
        if not images:
            return
        pixels = torch.from_numpy(np.concatenate([processed[d].pixel_values for d in images]))
        grid = torch.tensor([processed[d].grid for d in images])
        with torch.no_grad():
            tower(pixels, grid_thw=grid)

    patches = [math.prod(processed[d].grid) for d in distinct]
    every = _best(lambda: encode(row), repeats)
    print(f"\nvision tower per cp rank: a row of {len(row)} images, {len(distinct)} distinct "
          f"({sum(patches):,} patches); every run encoded: {every * 1e3:.1f} ms")  # fmt: skip
    base = None
    for cp in (1, 2):
        owner = deal_images(patches, cp)
        times = []
        for r in range(cp):
            mine = [d for d, o in zip(distinct, owner, strict=True) if o == r]
            times.append(_best(lambda mine=mine: encode(mine), repeats))
        base = base or max(times)
        load = np.bincount(owner, weights=patches, minlength=cp).astype(int)
        shares = ", ".join(
            f"rank {r}: {t * 1e3:.1f} ms ({load[r]:,} patches)" for r, t in enumerate(times)
        )
        print(f"cp {cp}: {shares}; slowest rank {max(times) / base:.2f}x of cp 1's")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.bench multimodal")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import Qwen2VLImageProcessorPil

    spec = ImageProcessorSpec.of(Qwen2VLImageProcessorPil())
    storage(spec, args.repeats)
    vision_per_rank(spec, args.repeats)
