"""Loader lifecycle: nothing silent, nothing hangs, nothing escapes.

A loader no name holds yields every micro batch; a pass over a step that is not there waits
(bounded) and then fails naming the file; a script with workers exits cleanly; an error raised in
a worker keeps its type and its place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    EmptyStepError,
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepTimeoutError,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.step_files import read_step_file, write_step_file
from rollfeed.payload import PayloadMissingFileError
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch
from tests.loaders.resume import tmb_key
from tests.loaders.test_prefetch import _wait_no_thread

REPO = Path(__file__).resolve().parents[2]
TOPO = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
CONFIG = PlanConfig(seq_len=SEQ_LEN, cp_size=2)
PAYLOAD_FIELDS_WRITTEN = {
    "routed_experts",
    "routed_expert_weights",
    "sampling_mask",
    "sampling_mask_logprobs",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("reliability")
    samples = write_batch(base / "payload", 10, seed=11)
    (base / "steps").mkdir()
    write_step_file(base / "steps", 0, samples)
    return base


def _dataset(steps: Path) -> RolloutDataset:
    return RolloutDataset.from_step_dir(steps)


def _reference(run: Path) -> list:
    samples = read_step_file(run / "steps" / "step_000000.rfs")
    ref, _ = reference(samples, dp_size=1, cp_size=2, cp_layout="contiguous", root=run / "payload")
    assert len(ref[0, 1]) >= 3
    return ref[0, 1]


def _first_error(loader) -> Exception:
    """The error a pass raises, without tracebacks: a traceback's frames would hold the test's
    loaders in a cycle, and a loader collected by the cycle collector waits out its workers."""
    try:
        list(loader)
    except Exception as err:  # the test asserts the type
        cause: BaseException | None = err
        while cause is not None:
            cause = cause.with_traceback(None).__context__
        return err
    raise AssertionError("the loader raised nothing")


@pytest.mark.parametrize(
    "options",
    [
        LoaderOptions(num_workers=2),
        LoaderOptions(num_workers=2, receive_depth=0),
        LoaderOptions(num_workers=0, receive_depth=2),
    ],
    ids=["workers", "workers-no-thread", "thread-no-workers"],
)
def test_loader_nobody_holds_yields_every_micro_batch(run, options):
    got = []
    for mb in build_dataloader(
        _dataset(run / "steps"),
        TOPO,
        LoaderConfig(plan=CONFIG),
        root=run / "payload",
        options=options,
    ):
        got.append(mb)
    ref = _reference(run)
    assert len(got) == len(ref)
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert_bitwise(a, b, k)
    _wait_no_thread()  # the pass ended: no receive thread left behind


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pass_over_missing_step_waits_then_raises_step_timeout(run, num_workers):
    loader = build_dataloader(
        _dataset(run / "steps"),
        TOPO,
        LoaderConfig(plan=CONFIG, step_timeout_s=0.4),
        root=run / "payload",
        options=LoaderOptions(num_workers=num_workers),
    )
    assert len(list(loader)) == len(_reference(run))  # step 0; step 1 is not there
    t0 = time.monotonic()
    err = _first_error(loader)
    waited = time.monotonic() - t0
    assert type(err) is StepTimeoutError, repr(err)
    assert 0.4 <= waited < 5, waited
    assert err.file == str(run / "steps" / "step_000001.rfs")
    assert "step_000001.rfs" in str(err) and "step_timeout_s=0.4" in str(err)


def test_pass_over_step_not_there_yet_yields_it_once_it_appears(run, tmp_path):
    samples = read_step_file(run / "steps" / "step_000000.rfs")
    steps = tmp_path / "steps"
    steps.mkdir()
    producer = threading.Timer(0.3, write_step_file, (steps, 0, samples))
    loader = build_dataloader(
        _dataset(steps), TOPO, LoaderConfig(plan=CONFIG, step_timeout_s=20), root=run / "payload"
    )
    producer.start()
    try:
        got = list(loader)  # the file does not exist when the pass starts
    finally:
        producer.join()
    ref = _reference(run)
    assert len(got) == len(ref)
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert_bitwise(a, b, k)


SCRIPT = """
import sys
from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from tests.loaders.common import SEQ_LEN

run = sys.argv[1]
topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
loader = build_dataloader(RolloutDataset.from_step_dir(run + "/steps"), topo,
                          LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN, cp_size=2)),
                          root=run + "/payload",
                          options=LoaderOptions(num_workers=2))
it = iter(loader)
next(it)                       # a pass still running at exit, its thread receiving ahead
print("done")
"""


@pytest.mark.timeout(60)
def test_script_with_workers_exits_without_traceback(run, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(run)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr


@pytest.fixture
def missing_payload(tmp_path):
    samples = write_batch(tmp_path / "payload", 8, seed=12)
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 0, samples)
    (victim,) = list((tmp_path / "payload" / "b").iterdir())
    data = victim.read_bytes()
    victim.unlink()
    return tmp_path, victim, data


@pytest.mark.parametrize(
    "options",
    [dict(receive_depth=2), dict(receive_depth=0)],
    ids=["thread", "no-thread"],
)
def test_worker_error_keeps_type_and_place(missing_payload, options):
    base, victim, data = missing_payload
    name = f"b/{victim.name}"

    def loader(**kw):
        ds = _dataset(base / "steps")
        opts = LoaderOptions(**kw)
        return build_dataloader(
            ds, TOPO, LoaderConfig(plan=CONFIG), root=base / "payload", options=opts
        )

    failing = loader(num_workers=2, **options)
    err = _first_error(failing)
    assert type(err) is PayloadMissingFileError, repr(err)
    assert err.file == name
    assert err.field in PAYLOAD_FIELDS_WRITTEN
    assert name in str(err)
    here = _first_error(loader(num_workers=0))  # the same read in this process
    assert (type(err), err.file, err.field, err.offset, err.pos, err.message) == (
        type(here),
        here.file,
        here.field,
        here.offset,
        here.pos,
        here.message,
    )
    assert any("worker process" in note for note in err.__notes__)  # where it was raised
    state = failing.state_dict()  # the failed micro batch is not counted as handed out
    victim.write_bytes(data)
    ref = [tmb_key(t) for t in loader(num_workers=0)]
    done = state["micro_batches"]
    assert [tmb_key(t) for t in failing] == ref[done:]  # its next pass reads that one again
    resumed = loader(num_workers=2, **options)
    resumed.load_state_dict(state)
    assert [tmb_key(t) for t in resumed] == ref[done:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pass_over_a_step_file_with_no_samples_is_an_empty_step_error_and_the_next_pass_goes_on(
    run, tmp_path, num_workers
):
    steps = tmp_path / "steps"
    steps.mkdir()
    write_step_file(steps, 0, [])
    write_step_file(steps, 1, read_step_file(run / "steps" / "step_000000.rfs"))
    loader = build_dataloader(
        _dataset(steps),
        TOPO,
        LoaderConfig(plan=CONFIG, step_timeout_s=0.1),
        root=run / "payload",
        options=LoaderOptions(num_workers=num_workers),
    )
    err = _first_error(loader)
    assert isinstance(err, EmptyStepError)
    assert err.file == str(steps / "step_000000.rfs")
    assert "no samples" in str(err)
    assert (loader.state_dict()["step"], loader.state_dict()["micro_batches"]) == (1, 0)
    got = list(loader)  # the empty step counts as done: the next pass is step 1, whole
    for k, (a, b) in enumerate(zip(got, _reference(run), strict=True)):
        assert_bitwise(a, b, f"micro batch {k}")


def test_step_whose_samples_are_all_dropped_as_overlong_is_an_empty_step_error(run):
    samples = read_step_file(run / "steps" / "step_000000.rfs")
    shortest = min(len(s) for s in samples)
    config = PlanConfig(seq_len=(shortest - 1) // 2 * 2, cp_size=2, overlong="drop")
    loader = build_dataloader(
        RolloutDataset(samples), TOPO, LoaderConfig(plan=config), root=run / "payload"
    )
    err = _first_error(loader)
    assert isinstance(err, EmptyStepError)
    assert f"all {len(samples)} samples were dropped" in str(err)
