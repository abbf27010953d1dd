"""The Python blocks of docs/multimodal.md run in order in one namespace, in a fresh working
directory, and do what the page says they do."""

from __future__ import annotations

import contextlib
import io

import torch

from tests.readme_blocks import README, readme_blocks

PAGE = README.parent / "docs" / "multimodal.md"


def test_multimodal_page_runs_and_shows_what_it_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in readme_blocks(PAGE.read_text()) if b.lang == "python"]
    assert len(blocks) == 4
    ns: dict = {}
    printed = []
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, f"{PAGE}:{block.line}", "exec"), ns)
        printed.append(out.getvalue().split("\n"))
    assert printed[0][0] == "(1, 4, 6) 6"
    assert printed[1][0] == "4 1"
    assert ns["tmb"].media.image_spans[:, 2].tolist() == [0, 0, 0, 0]
    assert list(ns["tmb"].media.pixel_values.shape) == [24, 384]
    assert printed[3][0] == "1 20"  # 4 samples x 5 sampled tokens
    assert printed[3][1] == "tensor(True)"
    assert torch.isfinite(ns["loss"])
