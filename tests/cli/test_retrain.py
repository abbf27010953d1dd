"""``python -m rollfeed retrain``: what it refuses before training (a step missing from the range, a
checkpoint that is not there, records that do not read back) and the trainer it starts (the
settings checkpoint K recorded, flags over them). Training itself: tests/crash (the command, from
a checkpoint of a crashed run) and tests/dist/test_train_resume.py (the trainer's --from)."""

import argparse
import json
import shutil

from rollfeed.cli import main
from rollfeed.cli.report import FINDINGS, USAGE
from rollfeed.cli.retrain import trainer_command
from tests.cli.common import write_root_and_steps


def argv(written, tmp_path, *more):
    out = ["retrain", "--steps", str(written.steps), "--root", str(written.root)]
    out += ["--checkpoints", str(tmp_path / "ckpt"), "--model", str(tmp_path / "model")]
    return [*out, "--out", str(tmp_path / "again.json"), *more]


def test_a_step_missing_from_the_range_is_a_usage_error(tmp_path, capsys):
    written = write_root_and_steps(tmp_path)  # steps 1 and 2
    assert main(argv(written, tmp_path, "--from", "0", "--to", "2")) == USAGE
    assert "step 0 (step_000000.rfs) is not in" in capsys.readouterr().err
    assert main(argv(written, tmp_path, "--from", "2", "--to", "1")) == USAGE


def test_a_checkpoint_that_is_not_there_is_a_usage_error(tmp_path, capsys):
    written = write_root_and_steps(tmp_path)
    (tmp_path / "ckpt" / "step_000001").mkdir(parents=True)  # begun, never completed
    assert main(argv(written, tmp_path, "--from", "1", "--to", "2")) == USAGE
    assert "no complete checkpoint at" in capsys.readouterr().err


def test_records_that_do_not_read_back_train_nothing(tmp_path, capsys):
    written = write_root_and_steps(tmp_path)
    (tmp_path / "ckpt" / "step_000001").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_000001" / ".metadata").write_bytes(b"")
    shutil.rmtree(written.root / "step_000002")  # the bytes step 2's records point to
    assert main(argv(written, tmp_path, "--from", "1", "--to", "2")) == FINDINGS
    out = capsys.readouterr().out
    assert "BAD step_000002.rfs" in out and "nothing trained" in out
    assert not (tmp_path / "again.json").exists()


def test_the_trainer_trains_as_checkpoint_k_recorded(tmp_path):
    recorded = {"lr": 1e-4, "clip_eps": 0.1, "correction": "icepop", "centering": False}
    recorded |= {"seq_len": 64, "dtype": "float64", "cp": 2, "max_staleness": 1}
    recorded |= {"on_stale": "drop"}
    args = argparse.Namespace(
        steps="s", root="r", checkpoints="c", model="m", out="o.json", start=3, end=5, nproc=4
    )
    flags = dict.fromkeys(("lr", "clip_eps", "correction", "seq_len", "dtype", "cp"))
    flags |= dict.fromkeys(("max_staleness", "on_stale"))
    cmd = trainer_command(argparse.Namespace(**vars(args), **flags, centering=None), recorded)
    text = " ".join(cmd)
    assert "--nproc_per_node=4 -m rollfeed.demo.trainer" in text
    assert "--from 3 --steps 6" in text  # steps 3..5
    for flag, value in (("--lr", "0.0001"), ("--clip-eps", "0.1"), ("--seq-len", "64")):
        assert f"{flag} {value}" in text
    assert "--correction icepop" in text and "--no-centering" in text and "--cp 2" in text
    assert "--max-staleness 1" in text and "--on-stale drop" in text  # the loader's bound too
    override = dict(flags, lr=0.5)
    cmd = trainer_command(argparse.Namespace(**vars(args), **override, centering=True), recorded)
    assert "--lr 0.5" in " ".join(cmd) and "--centering" in cmd
    assert json.dumps(cmd)  # plain strings
