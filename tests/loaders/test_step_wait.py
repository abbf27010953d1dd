"""No silent wait: a pass waiting for its step file logs at INFO as it starts and again every
LOG_EVERY_S (which step, which file name, which directory, what is there), and its
StepTimeoutError names the directory, what it found there and the producer's last step seen; a
run folder given for its ``steps/`` subfolder is refused when the dataset is built, naming it."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    MicroBatchSampler,
    RolloutDataset,
    StepTimeoutError,
    Topology,
    step_wait,
    write_step_file,
)
from tests.collate.gen import inline_batch


def _samples(n: int = 4):
    return inline_batch(np.random.default_rng(3), n, 20)


def _sampler(directory, timeout_s: float, **config):
    config = LoaderConfig(plan=PlanConfig(seq_len=32), step_timeout_s=timeout_s, **config)
    return MicroBatchSampler(RolloutDataset.from_step_dir(directory), Topology(), config)


def test_run_folder_for_its_steps_subfolder_is_refused_at_build(tmp_path):
    run = tmp_path / "run2"
    write_step_file(run / "steps", 0, _samples())
    (run / "payload").mkdir()
    (run / "config.json").write_text("{}")
    with pytest.raises(LoaderConfigError) as err:
        RolloutDataset.from_step_dir(run)
    said = str(err.value)
    assert f"{run / 'steps'} holds step files (steps 0..0)" in said, said
    assert f"from_step_dir('{run / 'steps'}')" in said
    assert RolloutDataset.from_step_dir(run / "steps").lengths(0).size == 4


def test_missing_step_directory_is_refused_at_build(tmp_path):
    with pytest.raises(LoaderConfigError, match="does not exist; pass the directory"):
        RolloutDataset.from_step_dir(tmp_path / "typo")


@pytest.mark.parametrize("stream", [False, True])
def test_waiting_pass_logs_at_info_as_it_starts_and_again(tmp_path, caplog, monkeypatch, stream):
    monkeypatch.setattr(step_wait, "LOG_EVERY_S", 0.1)
    for step in (0, 1):
        write_step_file(tmp_path, step, _samples())
    sampler = _sampler(tmp_path, 0.45, start_step=2, stream=stream)
    caplog.set_level(logging.INFO, logger="rollfeed.loaders.step_wait")
    with pytest.raises(StepTimeoutError) as err:
        list(sampler)
    waits = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(waits) >= 3, waits  # as it starts, then every LOG_EVERY_S
    wanted = "step_000002.rfs" + ("" if stream else " or a later step file")
    for said in waits:
        assert said.startswith(f"waiting for step 2 ({wanted}) in {tmp_path}, for at most ")
        assert "found there: step files up to step 1 (2 files, from step 0;" in said
    said = str(err.value)
    assert said.startswith(f"step 2 ({wanted}) did not appear in {tmp_path} within ")
    assert "found there: step files up to step 1 (2 files" in said
    assert "the producer's last step seen: 1." in said
    assert err.value.step == 2 and err.value.file == str(tmp_path / "step_000002.rfs")


@pytest.mark.parametrize("holds", ["other files", "nothing"])
def test_timeout_says_what_the_directory_holds(tmp_path, holds):
    run = tmp_path / "run"
    run.mkdir()
    if holds == "other files":
        for name in ("b.json", "a.txt", "step_01.json"):
            (run / name).write_text("x")
    sampler = _sampler(run, 0.2)  # built while run holds no step file anywhere
    with pytest.raises(StepTimeoutError) as err:
        list(sampler)
    want = {
        "other files": "3 entries, none named step_NNNNNN.rfs (e.g. a.txt, b.json, step_01.json)",
        "nothing": "nothing: the directory is empty",
    }[holds]
    assert f"in {run} within" in str(err.value) and f"found there: {want};" in str(err.value)
    assert "the producer's last step seen: none" in str(err.value)


def test_a_steps_subfolder_made_after_the_build_is_refused_as_the_wait_starts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sampler = _sampler(run, 600)  # built while run holds no step file anywhere
    write_step_file(run / "steps", 0, _samples())
    t0 = time.monotonic()
    with pytest.raises(LoaderConfigError, match=r"no step file, but .*steps holds step files"):
        list(sampler)
    assert time.monotonic() - t0 < 10  # not step_timeout_s=600
