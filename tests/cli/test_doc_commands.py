"""The command-line page (docs/cli.md): every command it shows parses, and the output it quotes is
what the commands print over a step of the quick start's shape (four samples of a 3-token prompt
and 12 sampled tokens, each kept set 8 ids and their logprobs)."""

from __future__ import annotations

import shlex

import numpy as np

from rollfeed.cli import main
from rollfeed.cli.parser import build_parser
from rollfeed.collate import Sample
from rollfeed.loaders import write_step_file
from rollfeed.payload import PayloadWriter
from tests.readme_blocks import REPO, page_blocks

PAGE = "docs/cli.md"


def _section() -> str:
    return (REPO / PAGE).read_text()


def test_every_command_the_page_shows_parses():
    lines = (line.strip().removeprefix("$ ") for line in _section().splitlines())
    shown = [
        shlex.split(line.split("#")[0])[3:]
        for line in lines
        if line.startswith("python -m rollfeed ")
    ]
    assert len(shown) >= 6
    for argv in shown:
        if argv[0] != "serve":  # serve's flags are vLLM's parser's (tests/cli/test_serve_help.py)
            build_parser().parse_args(argv)


def test_the_output_the_page_quotes_is_what_the_commands_print(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    monkeypatch.chdir(tmp_path)
    samples = []
    with PayloadWriter("quickstart/payload", group="step_000000") as writer:
        for _ in range(4):
            ids = [1, *rng.integers(0, 1000, 14).tolist()]
            kept = [np.r_[ids[3 + t], rng.choice(1000, 7, replace=False) + 1000] for t in range(12)]
            counts = np.full(12, 8)
            segments = writer.write(
                {
                    "sampling_mask": (counts, np.concatenate(kept)),
                    "sampling_mask_logprobs": (counts, -rng.random(96).astype(np.float32)),
                },
                pos={"sampling_mask": 3, "sampling_mask_logprobs": 3},
                sampled=np.array(ids[3:]),
            )
            samples.append(
                Sample(
                    ids,
                    loss_mask=np.arange(15) >= 3,
                    advantages=np.zeros(15, np.float32),
                    inference_logprobs=np.zeros(15, np.float32),
                    payload=segments,
                )
            )
    write_step_file("quickstart/steps", 0, samples)
    [quoted] = [b.code for b in page_blocks(PAGE) if b.lang == ""]
    for chunk in quoted.split("$ ")[1:]:  # "$ command", then what it prints
        command, *printed = chunk.splitlines()
        assert main(shlex.split(command)[3:]) == 0
        assert capsys.readouterr().out.splitlines() == printed, command
