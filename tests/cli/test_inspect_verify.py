"""``inspect`` and ``verify`` of a payload root: text and JSON reports, the group filter,
progress on stderr, usage errors."""

import io
import json
import os

import numpy as np
import pytest

from rollfeed.cli import main
from rollfeed.cli.progress import Progress
from rollfeed.payload import PayloadWriter
from tests.cli.common import run, run_json


def write_root(root):
    for step in (1, 2):
        with PayloadWriter(root, group=f"step_{step:06d}") as w:
            w.write(
                {
                    "routed_experts": np.ones((10, 2, 2), np.int64),
                    "sampling_mask": (1 + np.arange(10) % 3, np.arange(19)),
                },
                pos=0,
                sampled=np.array([0, 1, 3, 6, 7, 9, 12, 13, 15, 18]),  # each row's first id
            )


def test_inspect_lists_fields_and_groups(tmp_path, capsys):
    write_root(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 files, 2 groups" in out and "routed_experts" in out and "sampling_mask" in out
    assert "oldest group: step_000001" in out or "oldest group: step_000002" in out


def test_verify_passes_sound_files_and_names_bad_ones(tmp_path, capsys):
    write_root(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert "2 of 2 payload files are sound" in capsys.readouterr().out
    victim = next(p for p in tmp_path.rglob("*.rfp") if "step_000002" in str(p))
    raw = bytearray(victim.read_bytes())
    mask_body = raw.rfind(b"sampling_mask") + len(b"sampling_mask")
    raw[mask_body : mask_body + 8] = (7).to_bytes(8, "little")  # first block's value offset
    victim.write_bytes(bytes(raw))
    truncated = next(p for p in tmp_path.rglob("*.rfp") if "step_000001" in str(p))
    truncated.write_bytes(truncated.read_bytes()[:-5])
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {os.path.relpath(victim, tmp_path)}" in out and "not monotonic" in out
    assert f"BAD {os.path.relpath(truncated, tmp_path)}" in out and "past the end" in out
    assert "0 of 2 payload files are sound" in out


def corrupt_index(path):
    """The first block offset of the sampling mask's CSR index set to 7: not monotonic."""
    raw = bytearray(path.read_bytes())
    mask_body = raw.rfind(b"sampling_mask") + len(b"sampling_mask")
    raw[mask_body : mask_body + 8] = (7).to_bytes(8, "little")
    path.write_bytes(bytes(raw))


def test_inspect_json_gives_fields_groups_files_and_totals(tmp_path, capsys):
    write_root(tmp_path)
    rc, report = run_json(capsys, "inspect", tmp_path)
    assert rc == 0 and report["command"] == "inspect" and report["findings"] == []
    groups = ["step_000001", "step_000002"]
    assert [g["group"] for g in report["groups"]] == groups
    assert [(g["files"], g["rows"], g["findings"]) for g in report["groups"]] == [(1, 20, 0)] * 2
    assert [f["group"] for f in report["files"]] == groups
    assert all(f["problem"] is None and f["regions"] == 2 for f in report["files"])
    # each file: 10 routing rows and 10 kept-set rows, as written
    assert {k: v["rows"] for k, v in report["fields"].items()} == {
        "routed_experts": 20,
        "sampling_mask": 20,
    }
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.rfp"))
    assert report["totals"] == {
        "entries": 2,
        "files": 2,
        "groups": 2,
        "bytes": on_disk,
        "regions": 4,
        "rows": 40,
        "findings": 0,
    }
    assert {report["oldest_group"], report["newest_group"]} <= set(groups)


def test_verify_json_names_each_bad_file_in_its_group(tmp_path, capsys):
    write_root(tmp_path)
    victim = next(tmp_path.glob("step_000002/*.rfp"))
    corrupt_index(victim)
    rc, report = run_json(capsys, "verify", tmp_path)
    assert rc == 1
    rel = str(victim.relative_to(tmp_path))
    [finding] = report["findings"]
    assert finding["file"] == rel and finding["type"] == "PayloadIndexError"
    assert finding["field"] == "sampling_mask" and "not monotonic" in finding["message"]
    assert report["totals"]["sound"] == 1 and report["totals"]["findings"] == 1
    assert [(g["group"], g["sound"], g["findings"]) for g in report["groups"]] == [
        ("step_000001", 1, 0),
        ("step_000002", 0, 1),
    ]
    assert [f["sound"] for f in report["files"]] == [True, False]


def test_a_group_filter_covers_only_its_groups(tmp_path, capsys):
    write_root(tmp_path)
    with PayloadWriter(tmp_path, group="eval/run1") as w:
        w.write({"routed_experts": np.ones((3, 2, 2), np.int64)}, pos=0)
    corrupt_index(next(tmp_path.glob("step_000002/*.rfp")))
    rc, report = run_json(capsys, "verify", tmp_path, "--group", "step_000001")
    assert rc == 0 and [g["group"] for g in report["groups"]] == ["step_000001"]
    assert report["group_filter"] == ["step_000001"]
    rc, report = run_json(capsys, "verify", tmp_path, "--group", "step_*", "--group", "eval/*")
    assert rc == 1 and len(report["groups"]) == 3
    rc, report = run_json(capsys, "inspect", tmp_path, "--group", "eval/run?")
    assert rc == 0 and [f["group"] for f in report["files"]] == ["eval/run1"]
    rc, out, _ = run(capsys, "inspect", tmp_path, "--group", "eval/*")
    assert rc == 0 and "(groups eval/*): 1 files, 1 groups" in out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_group_filter_matching_nothing_is_a_usage_error(tmp_path, capsys, command):
    write_root(tmp_path)
    rc, out, err = run(capsys, command, tmp_path, "--group", "step_*", "--group", "stpe_1")
    assert rc == 2 and out == ""
    assert "--group stpe_1 matches no group" in err and "step_000001, step_000002" in err


def test_progress_goes_to_stderr_when_asked_never_to_stdout(tmp_path, capsys):
    write_root(tmp_path)
    rc, out, err = run(capsys, "verify", tmp_path, "--json", "--progress")
    assert rc == 0 and json.loads(out)["totals"]["files"] == 2
    assert err.splitlines()[-1].startswith("verify: 2/2 files, ")
    rc, out, err = run(capsys, "inspect", tmp_path)  # stderr is no terminal here
    assert rc == 0 and err == ""


def test_progress_on_a_terminal_rewrites_one_line():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    progress = Progress("verify", show=None, stream=screen)
    for done in range(1, 4):
        progress.update(done, 3, "files")
    progress.close()
    text = screen.getvalue()
    assert text.startswith("\rverify: 1/3 files") and text.endswith("\rverify: 3/3 files\n")
    assert "\n" not in text[:-1]
    quiet = Terminal()
    Progress("verify", show=False, stream=quiet).update(1, 3, "files")
    assert quiet.getvalue() == ""


def test_wrong_arguments_say_what_and_exit_2(tmp_path, capsys):
    write_root(tmp_path / "root")
    (tmp_path / "empty").mkdir()
    (tmp_path / "plain").write_text("x")
    cases = [
        (["verify", tmp_path / "missing"], "does not exist: give the payload root directory"),
        (["inspect", tmp_path / "plain"], "is not a directory"),
        (["verify", tmp_path / "empty", "--json"], "no payload files found under"),
        (["verify", tmp_path / "root", "--checksums"], "--checksums goes with --steps"),
        (["verify", tmp_path / "root", "--bogus"], "unrecognized arguments: --bogus"),
        (["inspect"], "the following arguments are required: root"),
        (["steps", tmp_path, "--seq-len", "0"], "expected an integer >= 1, got '0'"),
    ]
    for argv, said in cases:
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and said in err and out == "", (argv, err)
