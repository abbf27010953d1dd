"""A step directory of samples with images, through the loader (DataLoader workers decode and
process the images): every rank's micro batches equal, bitwise, the single-process plan and
tensors, by handle and inline alike; the index carries the image runs the planner cuts by."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rollfeed.collate import ImageRuns, PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    LoaderOptions,
    RolloutDataset,
    Topology,
    build_dataloader,
    read_step_file,
    write_step_file,
)
from rollfeed.loaders.errors import EmptyStepError, StepFileError
from rollfeed.payload import MediaWriter, PayloadWriter
from tests.collate.test_multimodal import SPEC, _image_pairs
from tests.loaders.common import assert_bitwise
from tests.loaders.step_bytes import index_bytes, index_of, rewrite_index
from tests.models.tiny_vlm import png, vlm_sample

SEQ_LEN = 64


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("mm")
    rng = np.random.default_rng(11)
    media = MediaWriter(base / "payload")
    with (
        PayloadWriter(base / "payload", group="a") as wa,
        PayloadWriter(base / "payload", group="b") as wb,
    ):
        inline, handle = _image_pairs(rng, 10, SEQ_LEN, [wa, wb], media, png(rng, 40, 40))
    write_step_file(base / "steps", 0, handle)
    return base, inline, handle


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cp_size", "cp_layout"), [(1, "contiguous"), (2, "zigzag")])
def test_loader_workers_give_each_rank_the_single_process_multimodal_micro_batches(
    step_dir, cp_size, cp_layout
):
    base, inline, handle = step_dir
    plan = PlanConfig(seq_len=SEQ_LEN, cp_size=cp_size, cp_layout=cp_layout)
    ref_plan = prepare_batch(handle, plan, dp_size=2)
    inline_plan = prepare_batch(inline, plan, dp_size=2)
    assert ref_plan.metrics["truncated_before_image"] > 0
    config = LoaderConfig(plan=dataclasses.replace(plan, cp_size=1), image_processor=SPEC)
    for dp in range(2):
        for cp in range(cp_size):
            topology = Topology(dp_rank=dp, dp_size=2, cp_rank=cp, cp_size=cp_size)
            loader = build_dataloader(
                RolloutDataset.from_step_dir(base / "steps"),
                topology,
                config,
                root=base / "payload",
                options=LoaderOptions(num_workers=1 if cp_size > 1 else 0),
            )
            got = list(loader)
            loader.close()
            assert loader.metrics["truncated"] == ref_plan.metrics["truncated"]
            assert len(got) == len(ref_plan[dp])
            for k, (tmb, mb, mi) in enumerate(zip(got, ref_plan[dp], inline_plan[dp], strict=True)):
                kw = dict(cp_rank=cp, image_processor=SPEC)
                want = to_tensor_micro_batch(mb, root=base / "payload", **kw)
                assert_bitwise(tmb, want, (dp, cp, k))
                assert_bitwise(to_tensor_micro_batch(mi, **kw), want, (dp, cp, k, "inline"))
                assert (tmb.media is None) == mb.is_dummy


def test_step_index_carries_image_runs_and_a_text_step_keeps_its_bytes(step_dir, tmp_path):
    base, _, handle = step_dir
    index = index_of(base / "steps" / "step_000000.rfs")
    want = ImageRuns.of_samples(handle)
    assert np.array_equal(index.span_counts, want.counts)
    assert np.array_equal(index.span_spans, want.spans) and want.counts.sum() > 10
    dataset = RolloutDataset.from_step_dir(base / "steps")
    assert np.array_equal(dataset.image_runs(0).spans, want.spans)
    assert np.array_equal(RolloutDataset(handle).image_runs().spans, want.spans)
    assert [s.images for s in read_step_file(base / "steps" / "step_000000.rfs")] == [
        s.images for s in handle
    ]
    text = [dataclasses.replace(s, images=[]) for s in handle[:3]]
    write_step_file(tmp_path, 0, text)
    assert index_of(tmp_path / "step_000000.rfs").span_counts.sum() == 0
    assert RolloutDataset.from_step_dir(tmp_path).image_runs(0) is None
    assert RolloutDataset(text).image_runs() is None
    # an index whose image runs do not describe the record is refused when the record is read
    path = Path(write_step_file(tmp_path, 1, handle[:2]))
    old = index_bytes(path)
    first = handle[0].images[0]
    at = old.rindex(np.array([first.start, first.end], "<u4").tobytes())
    rewrite_index(
        path, old[:at] + np.array([first.start, first.end - 1], "<u4").tobytes() + old[at + 8 :]
    )
    with pytest.raises(StepFileError, match="marked spans"):
        RolloutDataset.from_step_dir(tmp_path)[1 << 32]


def test_cuts_at_images_are_counted_by_the_loader_and_an_empty_step_says_why(tmp_path):
    rng = np.random.default_rng(12)
    image = png(rng, 48, 48)  # 9 placeholder tokens
    media = MediaWriter(tmp_path)
    first = [
        vlm_sample(rng, [image, 12], SPEC, writer=media) for _ in range(2)
    ]  # cut: nothing left
    later = vlm_sample(rng, [4, image, 12], SPEC, writer=media)  # cut before the image: 4 tokens
    config = LoaderConfig(plan=PlanConfig(seq_len=8), image_processor=SPEC, step_timeout_s=0)
    for step, samples in enumerate([[*first, later], first]):
        write_step_file(tmp_path / "steps", step, samples)
    loader = build_dataloader(
        RolloutDataset.from_step_dir(tmp_path / "steps"), Topology(), config, root=tmp_path
    )
    (tmb,) = list(loader)
    assert tmb.media is None and int(tmb.seq_lens.sum()) == 4  # the text before the image
    m = loader.metrics
    assert (m["truncated_before_image"], m["dropped_at_image"], m["dropped"]) == (1, 2, 2)
    with pytest.raises(EmptyStepError, match="2 of them because nothing precedes the image"):
        list(loader)


def test_loader_config_takes_only_an_image_processor_spec():
    with pytest.raises(LoaderConfigError, match="image_processor"):
        LoaderConfig(plan=PlanConfig(seq_len=8), image_processor=object())
