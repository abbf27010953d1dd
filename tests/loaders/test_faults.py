"""A killed worker fails fast and a restart loses nothing; bad step files and missing payload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollfeed.loaders import RolloutDataset, StepFileError, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from rollfeed.payload import PayloadMissingFileError
from tests.loaders.common import SEQ_LEN, write_batch
from tests.loaders.test_resume import tmb_key

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(tmp_path):
    samples = write_batch(tmp_path / "payload", 24, seed=5)
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 0, samples)
    return tmp_path


def _loader(run, **kw):
    ds = RolloutDataset.from_step_dir(run / "steps")
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    return build_dataloader(ds, topo, seq_len=SEQ_LEN, root=run / "payload", **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["thread", "plain"])
def test_sigkill_worker_raises_promptly_and_restart_repeats_nothing(run, tmp_path, mode):
    tmbs = list(_loader(run))
    ref = [tmb_key(t) for t in tmbs]
    assert len(ref) >= 5
    out = tmp_path / "killed.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.loaders.kill_worker", str(run), str(out), mode]
    subprocess.run(cmd, env=env, cwd=REPO, timeout=40, check=True)
    result = json.loads(out.read_text())
    # EOFError: killed while handing a batch's fd over (a race of torch's receive, either mode)
    assert result["error"] in ("RuntimeError", "ConnectionResetError", "EOFError"), result

    if result["error"] == "RuntimeError":
        assert re.search("killed by signal|exited unexpectedly", result["message"])
    assert result["seconds"] < 10  # prompt: no hang
    assert result["taken"] == [t.input_ids.tolist() for t in tmbs[:2]]
    fresh = _loader(run, num_workers=2)
    fresh.load_state_dict(result["state"])
    rest = [tmb_key(t) for t in fresh]
    assert rest == ref[2:]  # from the last saved state: nothing lost, nothing repeated


@pytest.mark.parametrize("thread", [False, True])
def test_malformed_step_line_names_file_and_line(run, thread):
    path = run / "steps" / "step_000001.jsonl"
    lines = (run / "steps" / "step_000000.jsonl").read_text().splitlines()
    path.write_text("\n".join([lines[0], "", lines[1][:-7], lines[2]]) + "\n")
    loader = _loader(run, num_workers=0, start_step=1, prefetch_thread=thread)
    with pytest.raises(StepFileError) as err:
        list(loader)
    assert err.value.file == str(path) and err.value.line == 3
    assert "step_000001.jsonl" in str(err.value) and "line=3" in str(err.value)


def test_invalid_sample_record_names_line(run):
    path = run / "steps" / "step_000001.jsonl"
    path.write_text('{"token_ids": [1, 2], "loss_mask": [0, 1], "advantages": [0.0]}\n')
    with pytest.raises(StepFileError, match=r"line=1") as err:
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


@pytest.mark.parametrize("thread", [True, False])
def test_missing_payload_file_surfaces_from_worker_with_file_name(run, thread):
    (victim,) = [f for f in (run / "payload" / "b").iterdir()]
    victim.unlink()
    err = _first_error(_loader(run, num_workers=2, prefetch_thread=thread))
    assert isinstance(err, PayloadMissingFileError), repr(err)
    assert f"b/{victim.name}" in str(err)
    assert any("worker" in n for n in err.__notes__)  # raised inside a worker, re-raised here
