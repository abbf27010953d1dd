"""A killed worker fails fast and a restart loses nothing; bad step files and missing payload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepFileError,
    Topology,
    WorkerTimeoutError,
    build_dataloader,
)
from rollfeed.loaders.step_files import read_step_file, write_step_file
from rollfeed.payload import PayloadMissingFileError
from tests.loaders.common import SEQ_LEN, write_batch
from tests.loaders.resume import tmb_key
from tests.loaders.step_bytes import flip, record_span

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(tmp_path):
    samples = write_batch(tmp_path / "payload", 24, seed=5)
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 0, samples)
    return tmp_path


def _loader(run, *, start_step=None, **kw):
    ds = RolloutDataset.from_step_dir(run / "steps")
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2)
    options = LoaderOptions(**kw)
    return build_dataloader(
        ds,
        topo,
        LoaderConfig(plan=config, start_step=start_step),
        root=run / "payload",
        options=options,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "how"), [("thread", "KILL"), ("plain", "KILL"), ("thread", "STOP")]
)
def test_killed_or_stopped_worker_is_a_typed_error_and_restart_repeats_nothing(
    run, tmp_path, mode, how
):
    """Default options: a SIGKILLed worker raises WorkerDiedError at once, a SIGSTOPped one
    WorkerStoppedError after stopped_s (5 s); both name the worker and the step, and the same
    loader's next pass (new workers) yields the rest of the step."""
    tmbs = list(_loader(run))
    ref = [tmb_key(t) for t in tmbs]
    assert len(ref) >= 5
    out = tmp_path / "killed.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.loaders.kill_worker", str(run), str(out), mode, how]
    subprocess.run(cmd, env=env, cwd=REPO, timeout=40, check=True)
    result = json.loads(out.read_text())
    # typed wherever torch noticed it: the SIGCHLD handler, the receive, a handover cut short
    kind, what = {"KILL": ("WorkerDiedError", "exited"), "STOP": ("WorkerStoppedError", "had")}[how]
    assert result["error"] == kind, result
    assert result["step"] == 0 and result["worker"] in (0, 1), result
    assert re.search(rf"worker [01] \(pid \d+\) {what}", result["message"]), result
    assert result["seconds"] < (10 if how == "KILL" else 25)  # prompt: no hang
    assert result["taken"] == [t.input_ids.tolist() for t in tmbs[:2]]
    # the same loader goes on with new workers after the micro batches it handed out (some
    # were on their way before the kill): nothing lost, nothing repeated
    after = 2 + result.get("after_kill", 0)
    assert result["rest"] == [t.input_ids.tolist() for t in tmbs[after:]]
    fresh = _loader(run, num_workers=2)
    fresh.load_state_dict(result["state"])
    rest = [tmb_key(t) for t in fresh]
    assert rest == ref[2:]  # from the last saved state: nothing lost, nothing repeated


@pytest.mark.parametrize("depth", [0, 2])
def test_record_rewritten_in_place_names_file_step_and_sample(run, depth):
    path = Path(
        write_step_file(run / "steps", 1, read_step_file(run / "steps" / "step_000000.rfs"))
    )
    offset, _ = record_span(path, 2)
    flip(path, offset + 32)  # a token id of sample 2: the record's CRC-32C differs
    loader = _loader(run, num_workers=0, start_step=1, receive_depth=depth)
    with pytest.raises(StepFileError) as err:
        list(loader)
    assert (err.value.file, err.value.step, err.value.sample) == (str(path), 1, 2)
    assert "step_000001.rfs" in str(err.value) and "sample=2" in str(err.value)


@pytest.mark.parametrize("depth", [0, 2])
def test_record_rewritten_in_place_read_in_a_worker_keeps_file_and_sample(run, depth):
    """A worker reads only its samples' records: a bad one is found there, and the error reaches
    the trainer with its file and sample, not rebuilt from text."""
    path = Path(
        write_step_file(run / "steps", 1, read_step_file(run / "steps" / "step_000000.rfs"))
    )
    offset, _ = record_span(path, 2)
    flip(path, offset + 32)
    err = _first_error(_loader(run, num_workers=2, start_step=1, receive_depth=depth))
    assert type(err) is StepFileError, repr(err)
    assert err.file == str(path) and err.sample == 2
    assert any("worker process" in note for note in err.__notes__)


def test_record_that_is_no_sample_names_the_sample(run):
    from rollfeed.payload import PayloadRoot, StepRecord, StepRecordWriter

    ids = np.array([1, 2])
    with StepRecordWriter(PayloadRoot(run / "steps"), "step_000001.rfs") as w:
        w.append(StepRecord(ids=ids, mask=ids > 1, columns={"advantages": np.zeros(2, "f4")}))
    with pytest.raises(StepFileError, match=r"sample=0") as err:
        list(_loader(run, start_step=1))
    assert "inference_logprobs" in str(err.value)


def _first_error(loader) -> Exception:
    """The error iterating ``loader`` raises, without its traceback: that would keep the loader and
    its workers alive until interpreter exit, where DataLoader shutdown waits out its timeouts."""
    try:
        list(loader)
    except Exception as err:  # the test asserts the type
        return err.with_traceback(None)
    raise AssertionError("the loader raised nothing")


@pytest.mark.parametrize("depth", [2, 0])
def test_missing_payload_file_surfaces_from_worker_with_file_name(run, depth):
    (victim,) = [f for f in (run / "payload" / "b").iterdir()]
    victim.unlink()
    err = _first_error(_loader(run, num_workers=2, receive_depth=depth))
    assert isinstance(err, PayloadMissingFileError), repr(err)
    assert f"b/{victim.name}" in str(err)
    assert any("worker" in n for n in err.__notes__)  # raised inside a worker, re-raised here


class _SleepyDataset(RolloutDataset):
    """Every micro batch takes 1.5 s to load: a worker that is slow (sleeping, state S), not
    stopped."""

    def __getitems__(self, indices):
        time.sleep(1.5)
        return super().__getitems__(indices)


@pytest.mark.timeout(60)
def test_slow_worker_is_waited_for_then_a_typed_timeout_never_a_stopped_one(run):
    ds = _SleepyDataset.from_step_dir(run / "steps")
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2)
    slow = LoaderOptions(num_workers=2, timeout_s=0, stopped_s=0.2)
    loader = build_dataloader(
        ds, topo, LoaderConfig(plan=config), root=run / "payload", options=slow
    )
    it = iter(loader)
    assert next(it).input_ids.tolist() == next(iter(_loader(run))).input_ids.tolist()
    it.close()
    loader.close()
    bounded = LoaderOptions(num_workers=2, timeout_s=0.5, stopped_s=0.2)
    loader = build_dataloader(
        ds, topo, LoaderConfig(plan=config), root=run / "payload", options=bounded
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"timeout_s=0\.5") as err:
        next(iter(loader))
    assert err.value.step == 0 and time.monotonic() - t0 < 10
    loader.close()
