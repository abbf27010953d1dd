"""What a step file's pass refuses as it is planned names the step file, the step and the sample
by its number in the file (not its place in a shuffled plan); and a sample with images, which is
never packed as a tree, cannot claim a shared prefix: the writer refuses it, and a file that
claims one anyway (written below the writer) is refused as its pass plans it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollfeed.collate import OverlongError, PlanConfig, Sample, SharedPrefixError
from rollfeed.loaders import (
    LoaderConfig,
    RolloutDataset,
    StepWriter,
    Topology,
    build_dataloader,
    write_step_file,
)
from rollfeed.loaders.errors import StepFileError
from rollfeed.loaders.step_records import sample_record
from rollfeed.payload import MediaWriter, PayloadRoot, StepRecordWriter
from tests.collate.test_multimodal import SPEC
from tests.models.tiny_vlm import png, vlm_sample

SEED, STEP = 5, 3


def _first_in_plan(candidates: set[int], n: int) -> int:
    """The first of ``candidates`` (numbers in the step file) in the step's shuffled order."""
    order = np.random.default_rng([SEED, STEP]).permutation(n)
    return next(int(i) for i in order if int(i) in candidates)


def _refusal(tmp_path, plan: PlanConfig, **config) -> Exception:
    dataset = RolloutDataset.from_step_dir(tmp_path / "steps")
    config = LoaderConfig(
        plan=plan, shuffle=True, seed=SEED, start_step=STEP, step_timeout_s=0, **config
    )
    loader = build_dataloader(dataset, Topology(), config, root=tmp_path)
    with pytest.raises(Exception) as err:
        list(loader)
    return err.value


def _text(tokens) -> Sample:
    n = len(tokens)
    return Sample(
        np.asarray(tokens),
        loss_mask=np.arange(n) > 0,
        advantages=np.full(n, 0.5),
        inference_logprobs=np.full(n, -0.5),
    )


def test_an_overlong_sample_is_named_by_its_number_in_the_step_file(tmp_path):
    lengths = [5, 6, 40, 7, 5, 33]  # 2 and 5 are longer than seq_len
    samples = [_text(np.arange(1, n + 1)) for n in lengths]
    path = write_step_file(tmp_path / "steps", STEP, samples)
    err = _refusal(tmp_path, PlanConfig(seq_len=16, overlong="error"))
    assert type(err) is OverlongError, repr(err)
    want = _first_in_plan({2, 5}, len(lengths))
    assert err.sample == want and f"{lengths[want]} tokens" in err.message
    assert f"(step {STEP}, {path})" in err.message


def test_a_sample_with_images_claims_no_shared_prefix(tmp_path):
    rng = np.random.default_rng(3)
    media = MediaWriter(tmp_path)
    image = png(rng, 48, 48)  # 9 placeholder tokens
    pictured = [vlm_sample(rng, [4, image, 12], SPEC, writer=media) for _ in range(3)]
    text = [_text([11, 12, 13, 14, *rng.integers(20, 60, 16)]) for _ in range(3)]  # one prompt
    assert all(s.images for s in pictured) and not any(s.images for s in text)
    # the writer: text claims its prompt, a sample with images is refused, then kept ungrouped
    with StepWriter(tmp_path / "written", 0) as w:
        w.append(text[0], group="p", shared_prefix=4)
        with pytest.raises(StepFileError, match="shared_prefix=0") as err:
            w.append(pictured[0], group="p", shared_prefix=4)
        w.append(pictured[0], group="p")
    assert (err.value.file, err.value.step, err.value.sample) == (w.path, 0, 1)
    # a file that claims one anyway: refused as its pass is planned, the sample by its number
    records = [sample_record(s, group="t", shared_prefix=4) for s in text]
    records += [sample_record(s) for s in pictured]
    claims = {4, 5}  # 3 stays ungrouped: a sample with images in no group is fine
    for i in claims:
        records[i] = dataclasses.replace(records[i], group="t", shared_prefix=4)
    name = f"step_{STEP:06d}.rfs"
    with StepRecordWriter(PayloadRoot(tmp_path / "steps"), name) as w:
        for r in records:
            w.append(r)
    err = _refusal(tmp_path, PlanConfig(seq_len=64), image_processor=SPEC)
    assert type(err) is SharedPrefixError, repr(err)
    assert "images" in err.message and err.field == "images"
    assert (err.file, err.step) == (str(tmp_path / "steps" / name), STEP)
    assert err.sample == _first_in_plan(claims, len(records))
    # without the claims the same samples plan and load (the text as a tree)
    for i in claims:
        records[i] = dataclasses.replace(records[i], group=None, shared_prefix=0)
    with StepRecordWriter(PayloadRoot(tmp_path / "steps"), name) as w:
        for r in records:
            w.append(r)
    dataset = RolloutDataset.from_step_dir(tmp_path / "steps")
    plan = PlanConfig(seq_len=64)
    config = LoaderConfig(plan=plan, image_processor=SPEC, start_step=STEP, step_timeout_s=0)
    got = list(build_dataloader(dataset, Topology(), config, root=tmp_path))
    assert sum(int(t.seq_lens.sum()) for t in got) == sum(len(s) for s in text + pictured)
