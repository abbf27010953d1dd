import os

import numpy as np

from rollfeed.cli import main
from rollfeed.payload import PayloadWriter


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
