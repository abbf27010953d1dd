"""The demo's work directory and model cache are safe to share a machine with another demo."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from rollfeed.demo import tiny_model
from rollfeed.payload import PayloadWriter


class FakeSave:
    """The tokenizer / model stand-in: ``save_pretrained`` writes one file, then ``pause()``."""

    def __init__(self, name, pause=None, fail=False):
        self.name, self.pause, self.fail = name, pause, fail

    def save_pretrained(self, path):
        Path(path, self.name).write_text("{}")
        if self.pause is not None:
            self.pause()
        if self.fail:
            raise RuntimeError("build interrupted")


def fake_builders(monkeypatch, **tokenizer):
    monkeypatch.setattr(
        tiny_model, "train_tokenizer", lambda: FakeSave("tokenizer.json", **tokenizer)
    )
    monkeypatch.setattr(tiny_model, "tiny_moe_model", lambda seed: FakeSave("config.json"))


def test_two_demo_runs_get_distinct_work_directories(tmp_path):
    from rollfeed.demo.workdir import claim_workdir

    base = tmp_path / "demo"
    with claim_workdir(None, base=base) as a, claim_workdir(None, base=base) as b:
        assert a.workdir != b.workdir and a.run_id != b.run_id
        assert a.workdir.parent == base == b.workdir.parent
        assert a.workdir.is_dir() and b.workdir.is_dir() and a.fresh and b.fresh


def test_an_explicit_work_directory_in_use_is_refused_naming_it_and_the_other_run(tmp_path):
    from rollfeed.demo.workdir import DemoWorkdirInUseError, claim_workdir

    work = tmp_path / "mine"
    with claim_workdir(work, base=tmp_path / "unused") as first:
        assert first.workdir == work and not first.fresh
        with pytest.raises(DemoWorkdirInUseError) as err, claim_workdir(work, base=tmp_path):
            pass
    assert isinstance(err.value, ValueError)
    assert str(work) in str(err.value) and first.run_id in str(err.value)
    assert "--workdir" in str(err.value)  # says how to get out of the way


def test_an_explicit_work_directory_is_free_again_when_its_run_ends(tmp_path):
    from rollfeed.demo.workdir import claim_workdir

    work = tmp_path / "mine"
    with pytest.raises(RuntimeError), claim_workdir(work, base=tmp_path):
        raise RuntimeError("the run failed")
    with claim_workdir(work, base=tmp_path) as again:
        assert again.workdir == work


def test_a_fresh_run_deletes_run_directories_beyond_the_newest_five_but_no_running_one(tmp_path):
    from rollfeed.demo.workdir import claim_workdir

    base = tmp_path / "demo"
    old = [base / f"run-2024010{d}-120000-{100 + d}-abcdef" for d in range(1, 8)]  # 7 finished
    for run in old:
        (run / "payload").mkdir(parents=True)
        (run / "payload" / "w.rfp").write_bytes(b"x" * 100)
    (base / "notes").mkdir()  # not a run directory
    (tmp_path / "elsewhere").mkdir()
    (base / "run-20231231-120000-1-abcdef").symlink_to(tmp_path / "elsewhere")
    with claim_workdir(old[0], base=tmp_path) as running, claim_workdir(None, base=base) as new:
        # Newest five: the new run and old[3:]; old[1:3] go, old[0] stays while its run holds it.
        assert [p.exists() for p in old] == [True, False, False, True, True, True, True]
        assert new.pruned == (old[1], old[2]) and new.workdir.is_dir() and running.workdir.is_dir()
    assert (base / "notes").is_dir() and (tmp_path / "elsewhere").is_dir()
    assert (base / "run-20231231-120000-1-abcdef").is_symlink()


def test_demo_writers_of_two_runs_never_share_a_file(tmp_path):
    from rollfeed.demo.rollouts import writer_name
    from rollfeed.demo.workdir import new_run_id

    files = set()
    for run_id in (new_run_id(), new_run_id()):
        with PayloadWriter(tmp_path, group="step_000001", name=writer_name(run_id)) as w:
            kept = (np.array([1]), np.array([3]))
            seg = w.write({"sampling_mask": kept}, pos=0, sampled=np.array([3]))[0]
        assert run_id in seg.file
        files.add(seg.file)
    assert len(files) == 2


def test_a_half_built_tiny_model_is_never_visible_at_its_path(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    fake_builders(monkeypatch, pause=lambda: (started.set(), release.wait(10)))
    out, built = tmp_path / "tiny", []
    builder = threading.Thread(target=lambda: built.append(tiny_model.build_tiny_moe(out)))
    builder.start()
    try:
        assert started.wait(10)
        assert not out.exists()  # another demo looking now must not load half a model
    finally:
        release.set()
        builder.join(10)
    assert built == [out]
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "config.json", tiny_model._STAMP}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no build directory left behind


def test_an_interrupted_tiny_model_build_leaves_nothing_behind(tmp_path, monkeypatch):
    fake_builders(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="interrupted"):
        tiny_model.build_tiny_moe(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_a_leftover_unfinished_tiny_model_directory_is_replaced_whole(tmp_path, monkeypatch):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "model.safetensors.partial").write_text("half")  # an old build killed midway
    fake_builders(monkeypatch)
    assert tiny_model.build_tiny_moe(out) == out
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "config.json", tiny_model._STAMP}
    assert json.loads((out / tiny_model._STAMP).read_text())["seed"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_concurrent_tiny_model_builds_all_get_a_finished_model(tmp_path, monkeypatch):
    together = threading.Barrier(4, timeout=10)  # all four are mid-build at once
    fake_builders(monkeypatch, pause=together.wait)
    out, built = tmp_path / "tiny", []
    threads = [
        threading.Thread(target=lambda: built.append(tiny_model.build_tiny_moe(out)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert built == [out] * 4
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "config.json", tiny_model._STAMP}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
