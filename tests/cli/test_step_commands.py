"""``verify ROOT --steps DIR`` (every record of every step file read back from the root) and
``steps DIR`` (a summary per step), over a root and step files the project's writers wrote."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from rollfeed.collate import Sample
from rollfeed.loaders import write_step_file
from tests.cli.common import STEPS, run, run_json, write_root_and_steps
from tests.loaders.step_bytes import flip, record_span


@pytest.fixture
def written(tmp_path):
    return write_root_and_steps(tmp_path)


def test_verify_steps_reads_every_record_of_every_step(written, capsys):
    samples = sum(len(written.handle[s]) for s in STEPS)
    segments = sum(len(x.payload) for s in STEPS for x in written.handle[s])
    assert segments > 20
    rc, out, _ = run(capsys, "verify", written.root, "--steps", written.steps)
    assert rc == 0
    assert out == (
        f"{samples} of {samples} samples in 2 step files have readable records "
        f"({segments} segments read)\n"
    )
    rc, report = run_json(capsys, "verify", written.root, "--steps", written.steps, "--checksums")
    assert rc == 0 and report["checksums"] is True and report["findings"] == []
    assert report["totals"] == {
        "step_files": 2,
        "samples": samples,
        "sound": samples,
        "segments": segments,
        "findings": 0,
    }
    assert [(r["step"], r["samples"]) for r in report["steps"]] == [
        (s, len(written.handle[s])) for s in STEPS
    ]


def _with_record(sample: Sample, k: int, **update) -> Sample:
    """``sample`` with its ``k``-th segment record changed (a record no writer made)."""
    payload = list(sample.payload)
    payload[k] = payload[k].model_copy(update=update)
    return Sample.from_dict({**sample.to_dict(), "payload": [s.model_dump() for s in payload]})


def test_verify_steps_names_step_file_sample_field_and_position_of_a_bad_record(written, capsys):
    samples = list(written.handle[2])
    i = next(i for i, s in enumerate(samples) if i >= 2 and len(s.payload) >= 2)
    k = len(samples[i].payload) - 1
    bad = samples[i].payload[k]
    samples[i] = _with_record(samples[i], k, first=bad.first + 10_000)  # past its region
    write_step_file(written.steps, 2, samples)
    rc, out, _ = run(capsys, "verify", written.root, "--steps", written.steps)
    assert rc == 1
    [line] = [x for x in out.splitlines() if x.startswith("BAD ")]
    assert line.startswith(
        f"BAD step_000002.rfs sample {i} (uid {samples[i].uid}): {bad.field} at pos {bad.pos}: "
    )
    assert f"file={bad.file}" in line
    rc, report = run_json(capsys, "verify", written.root, "--steps", written.steps)
    [finding] = report["findings"]
    assert {k: finding[k] for k in ("step_file", "step", "sample", "field", "pos")} == {
        "step_file": "step_000002.rfs",
        "step": 2,
        "sample": i,
        "field": bad.field,
        "pos": bad.pos,
    }
    assert finding["file"] == bad.file and finding["type"].startswith("Payload")
    assert report["totals"]["sound"] == report["totals"]["samples"] - 1


def test_verify_steps_finds_records_and_indexes_that_do_not_read(written, capsys):
    step1, step2 = written.step_file(1), written.step_file(2)
    flip(step1, record_span(step1, 1)[0] + 33)  # a token id of sample 1, in place
    flip(step2, step2.stat().st_size - 49)  # the index's last byte: the loader refuses the step
    rc, report = run_json(capsys, "verify", written.root, "--steps", written.steps)
    assert rc == 1
    found = [(f["step_file"], f.get("sample"), f["type"]) for f in report["findings"]]
    assert found == [
        ("step_000001.rfs", 1, "StepFileError"),
        ("step_000002.rfs", None, "StepFileError"),
    ]
    assert "CRC-32C" in report["findings"][0]["message"]
    assert "index bytes' CRC-32C" in report["findings"][1]["message"]
    assert [r["samples"] for r in report["steps"]] == [len(written.handle[1]), 0]
    assert report["totals"]["sound"] == len(written.handle[1]) - 1


def test_verify_steps_names_every_record_of_a_missing_payload_file(written, capsys):
    gone = next(written.root.glob("step_000001/b.rfp"))
    gone.unlink()
    rel = "step_000001/b.rfp"
    expected = sum(s.file == rel for x in written.handle[1] for s in x.payload)
    rc, report = run_json(capsys, "verify", written.root, "--steps", written.steps)
    assert rc == 1 and expected > 0
    assert len(report["findings"]) == expected
    assert {(f["file"], f["type"]) for f in report["findings"]} == {
        (rel, "PayloadMissingFileError")
    }


def test_verify_steps_checksums_find_a_flipped_value_byte(written, capsys):
    sample = next(x for x in written.handle[1] if any(s.ragged is None for s in x.payload))
    seg = next(s for s in sample.payload if s.ragged is None and s.rows)
    path = written.root / seg.file
    raw = bytearray(path.read_bytes())
    raw[seg.offset + seg.first * seg.row_bytes] ^= 0x01  # a value the record reads
    path.write_bytes(bytes(raw))
    assert run(capsys, "verify", written.root, "--steps", written.steps)[0] == 0
    rc, out, _ = run(capsys, "verify", written.root, "--steps", written.steps, "--checksums")
    assert rc == 1 and f"file={seg.file}" in out and "checksum" in out
    assert "checksums checked" in out.splitlines()[-1]


def test_steps_summarises_lengths_loss_truncation_and_kept_widths(written, capsys):
    n = 12
    rc, report = run_json(capsys, "steps", written.steps, "--seq-len", n, "--root", written.root)
    assert rc == 0 and report["findings"] == []
    every = []
    for step, row in zip(STEPS, report["steps"], strict=True):
        inline = written.inline[step]  # the same samples, their kept sets inline: the oracle
        lengths = np.array([len(s) for s in inline])
        widths = np.concatenate(
            [s.fields["sampling_mask"][0] for s in inline if "sampling_mask" in s.fields]
        )
        widths = widths[widths > 0]
        every.append(widths)
        assert row["samples"] == len(inline) and row["tokens"] == lengths.sum()
        assert row["length"] == {
            "min": lengths.min(),
            "median": np.median(lengths),
            "max": lengths.max(),
        }
        assert row["loss_tokens"] == sum(int(s.loss_mask.sum()) for s in inline)
        assert row["samples_cut"] == (lengths > n).sum() > 0
        assert row["tokens_dropped"] == np.maximum(lengths - n, 0).sum()
        assert row["loss_tokens_dropped"] == sum(int(s.loss_mask[n:].sum()) for s in inline)
        assert row["support_width"] == {
            "rows": len(widths),
            "mean": round(widths.mean(), 3),
            "p99": np.percentile(widths, 99, method="inverted_cdf"),
            "max": widths.max(),
        }
    widths = np.concatenate(every)
    assert report["totals"]["support_width"]["rows"] == len(widths)
    assert report["totals"]["support_width"]["max"] == widths.max()
    assert report["totals"]["tokens"] == sum(r["tokens"] for r in report["steps"])


def test_steps_prints_one_row_per_step(written, capsys):
    rc, out, _ = run(capsys, "steps", written.steps)
    assert rc == 0
    head, titles, *rows = out.splitlines()
    samples = [s for step in STEPS for s in written.inline[step]]
    tokens = sum(len(s) for s in samples)
    assert head.endswith(f": 2 step files, {len(samples)} samples, {tokens} tokens")
    assert "cut" not in titles and "kept" not in titles  # no --seq-len, no --root
    for step, row in zip(STEPS, rows, strict=True):
        lengths = [len(s) for s in written.inline[step]]
        assert row.split()[:3] == [str(step), str(len(lengths)), str(sum(lengths))]


def test_step_commands_refuse_a_directory_without_step_files(tmp_path, written, capsys):
    (tmp_path / "nothing").mkdir()
    for argv in (
        ["steps", tmp_path / "nothing"],
        ["verify", written.root, "--steps", tmp_path / "nothing"],
    ):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == "" and "no step files found in" in err, err
    rc, _, err = run(capsys, "steps", tmp_path / "absent")
    assert rc == 2 and "does not exist: give the step directory" in err
    rc, _, err = run(capsys, "verify", written.root, "--steps", written.steps, "--group", "x")
    assert rc == 2 and "--group selects the payload files" in err
    rc, _, err = run(capsys, "steps", written.steps, "--root", tmp_path / "absent")
    assert rc == 2 and "does not exist: give the payload root directory" in err


def test_verify_steps_names_a_fifo_under_a_step_name_at_once(written, capsys):
    os.mkfifo(written.steps / "step_000003.rfs")  # open() of a FIFO waits for a writer
    t0 = time.monotonic()
    rc, report = run_json(capsys, "verify", written.root, "--steps", written.steps)
    assert time.monotonic() - t0 < 5
    assert rc == 1 and [f["step_file"] for f in report["findings"]] == ["step_000003.rfs"]
    assert "a FIFO" in report["findings"][0]["message"]
    rc, out, _ = run(capsys, "steps", written.steps)
    assert rc == 1 and "BAD step_000003.rfs: the step file is not a regular file" in out


def test_a_step_file_cut_short_is_a_finding_of_the_step(written, capsys):
    path = written.step_file(2)
    path.write_bytes(path.read_bytes()[:-100])  # its footer and part of its index gone
    rc, report = run_json(capsys, "verify", written.root, "--steps", written.steps)
    assert rc == 1
    [finding] = report["findings"]
    assert finding["step_file"] == "step_000002.rfs" and "sample" not in finding
    assert "footer" in finding["message"]
    assert report["steps"][1]["samples"] == 0  # no sample of the step is read


def test_step_commands_name_the_conversion_of_a_json_lines_directory(tmp_path, written, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "step_000000.jsonl").write_text(written.handle[1][0].to_json() + "\n")
    rc, _, err = run(capsys, "steps", tmp_path / "old")
    assert rc == 2 and "python -m rollfeed steps convert" in err, err
