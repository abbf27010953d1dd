"""Attack family ``step_guards`` of the adversary harness (:mod:`tests.payload.adversary`): step
files that are not what their names say, rewritten in place, or never coming.

- Under the step file's name: a FIFO without a writer, a directory, a symlink to a good copy, to
  a canary outside the step directory, a dangling symlink, a unix socket, a sparse file of 2**40
  bytes, an empty file, a JSON-lines file, the good file cut in half or before its footer, a copy
  of the canary, a payload file; and,
  accepted as the step itself, a hard link to a good copy, a copy, the file moved away and back.
  Each is planned by a sampler (stream mode, and listing the directory), read whole by
  ``read_step_file`` and summarised by ``python -m rollfeed steps``. A refusal must be a typed
  error (or a finding) naming that path; a FIFO open would block for ever, so the per-case
  alarm proves no hang; bytes of the canary in a sample are an ``escape``.
- Rewritten in place to the very same size after the pass's first micro batch (or before the
  pass): a record with other tokens of the same sizes, every record, two records swapped, the
  same bytes again; a record's header; the index with a record's CRC-32C changed or two
  samples' token counts swapped (the footer's CRC-32C of the index made to match), the index's
  last byte (not), the footer's magic, the file header's version, the same index again. Read in
  the trainer's process, in a spawned copy of the dataset, or by two forked DataLoader workers,
  a pass yields exactly the planned samples or raises a typed error.
- A step that never comes (stream mode and not, ``step_timeout_s=0.3``), a run folder given for
  its ``steps/``, a missing path, a FIFO as the step directory, a JSON-lines step file left
  unconverted (and one beside its converted file, and a writer's temporary file: both ignored):
  a typed error naming the directory and what is there, or the pass.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.payload.adversary_tally import Escaped, Tally, Wrong

N = 13
SEQ, MAX_LEN = 32, 30
CANARY = b"CANARY-outside-the-step-directory"


def _socket(target: Path) -> None:
    """A unix socket at ``target`` (bound from its directory: socket paths are short)."""
    here = os.getcwd()
    os.chdir(target.parent)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(target.name)
        s.close()
    finally:
        os.chdir(here)


def _sparse(target: Path) -> None:
    with open(target, "wb") as f:
        f.truncate(1 << 40)


def _moved_back(target: Path, good: Path) -> None:
    shutil.copyfile(good, target.with_name("away"))
    os.replace(target.with_name("away"), target)


def _cut(target: Path, good: Path, before_footer: bool) -> None:
    data = good.read_bytes()
    target.write_bytes(data[:-FOOTER_BYTES] if before_footer else data[: len(data) // 2])


def _payload_file(target: Path) -> None:
    """A payload file (``.rfp``) of one region, put under the step file's name."""
    from rollfeed.payload import PayloadWriter

    with PayloadWriter(target.parent / "payload", group="g", name="w") as w:
        w.write({"routed_experts": np.ones((4, 2, 2), np.uint8)}, 0)
    os.replace(target.parent / "payload" / "g" / "w.rfp", target)


FOOTER_BYTES = 48
# (what, make(target, good copy, canary), refused): things put under a step file's name; a hard
# link to a good copy, a copy and the file moved away and back are the step itself
THINGS: list[tuple[str, Callable[[Path, Path, Path], None], bool]] = [
    ("a FIFO", lambda t, g, c: os.mkfifo(t), True),
    ("a directory", lambda t, g, c: t.mkdir(), True),
    ("a symlink to a good copy", lambda t, g, c: t.symlink_to(g), True),
    ("a symlink to a canary outside", lambda t, g, c: t.symlink_to(c), True),
    ("a dangling symlink", lambda t, g, c: t.symlink_to(t.with_name("gone")), True),
    ("a unix socket", lambda t, g, c: _socket(t), True),
    ("a sparse file of 2**40 bytes", lambda t, g, c: _sparse(t), True),
    ("an empty file", lambda t, g, c: t.write_bytes(b""), True),
    ("a JSON-lines file", lambda t, g, c: t.write_bytes(b'{"token_ids": [1]}\n'), True),
    ("the good file cut in half", lambda t, g, c: _cut(t, g, False), True),
    ("the good file cut before its footer", lambda t, g, c: _cut(t, g, True), True),
    ("a copy of the canary", lambda t, g, c: shutil.copyfile(c, t), True),
    ("a payload file", lambda t, g, c: _payload_file(t), True),
    ("a hard link to a good copy", lambda t, g, c: os.link(g, t), False),
    ("a copy of a good file", lambda t, g, c: shutil.copyfile(g, t), False),
    ("the file moved away and back", lambda t, g, c: _moved_back(t, g), False),
]


def _planned(directory: Path, *, stream: bool = False, copy: bool = False, rewrite=None) -> list:
    """The samples (as JSON) of one pass over step 0 of ``directory``, read in this process or,
    after the first micro batch, in a spawned (pickled) copy of the dataset; ``rewrite()`` runs
    after the first micro batch."""
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import LoaderConfig, MicroBatchSampler, RolloutDataset, Topology

    ds = RolloutDataset.from_step_dir(directory)
    config = LoaderConfig(plan=PlanConfig(seq_len=SEQ), stream=stream, step_timeout_s=0.3)
    sampler = MicroBatchSampler(ds, Topology(), config)
    reader = ds
    out = []
    for k, mb in enumerate(sampler):
        if k == 1 and rewrite is not None:
            rewrite()
        if k == 1 and copy:  # from here on, a copy that loads the step itself reads
            reader = pickle.loads(pickle.dumps(ds))
        out.append([s.to_json() for s in reader.__getitems__(mb)])
    return out


def _loaded(directory: Path, rewrite: Callable[[], None], *, workers: int = 2) -> list:
    """The same through a loader with ``workers`` forked workers (each micro batch's token
    ids); ``rewrite()`` runs after planning."""
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import (
        LoaderConfig,
        LoaderOptions,
        RolloutDataset,
        Topology,
        build_dataloader,
    )

    ds = RolloutDataset.from_step_dir(directory)
    options = LoaderOptions(num_workers=workers, timeout_s=10, stopped_s=1)
    config = LoaderConfig(plan=PlanConfig(seq_len=SEQ), step_timeout_s=0.3)
    loader = build_dataloader(ds, Topology(), config, root=None, options=options)
    try:
        assert len(loader) > 1  # planned in this process
        rewrite()
        return [mb.input_ids.tolist() for mb in loader]
    finally:
        loader.close()


def _names(path: Path, refused: bool, run: Callable[[], object], want: object) -> Callable:
    """An attack: ``run()`` must raise a typed error naming ``path`` (``refused``) or return
    ``want``; canary bytes anywhere are an escape."""
    from rollfeed.errors import RollfeedError

    def attack() -> None:
        try:
            got = run()
        except RollfeedError as err:
            if CANARY.decode() in str(err):
                raise Escaped(f"the error quotes the canary: {err}") from None
            named = getattr(err, "file", None)
            if refused and named != os.fspath(path):
                raise Wrong(f"refused naming {named!r}, not {os.fspath(path)!r}: {err}") from None
            raise
        if CANARY.decode() in repr(got):
            raise Escaped("a sample holds the canary's bytes")
        if refused or got != want:
            raise Wrong(f"accepted: {len(got)} micro batches" + ("" if refused else ", not these"))

    return attack


def family_step_guards(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """See the module doc."""
    from rollfeed.loaders.step_files import read_step_file, write_step_file
    from tests.collate.gen import inline_batch

    samples = inline_batch(rng, N, MAX_LEN)
    samples_json, lengths = [s.to_json() for s in samples], [len(s) for s in samples]
    base = workdir / "base"
    write_step_file(base, 0, samples)
    want = _planned(base)
    if len(want) < 3:
        raise AssertionError(f"the oracle pass is too short: {len(want)} micro batches")
    good = workdir / "good"
    shutil.copytree(base, good)
    canary = workdir / "canary.txt"
    canary.write_bytes(CANARY + b"\n")
    case = 0

    def fresh() -> Path:
        nonlocal case
        case += 1
        directory = workdir / f"c{case}"
        shutil.copytree(base, directory)
        return directory

    target = "step_000000.rfs"
    ways: list[tuple[str, Callable[[Path], list], list]] = [
        ("planned, listing the directory", _planned, want),
        ("planned in stream mode", lambda d: _planned(d, stream=True), want),
        ("read_step_file", lambda d: _whole(read_step_file, d), [samples_json]),
        ("python -m rollfeed steps", _summary, [[len(lengths), sum(lengths)]]),
    ]
    for what, make, refused in THINGS:
        for how, run, expect in ways:
            directory = fresh()
            path = directory / target
            path.unlink()
            make(path, good / target, canary)
            tally.case(
                f"step_guards: {target} is {what}; {how}",
                _names(path, refused, lambda run=run, d=directory: run(d), expect),
            )

    loaded = _loaded(fresh(), lambda: None, workers=0)
    for what, rewrite in _rewrites(samples, base / target):
        for where in ("trainer", "spawned copy", "2 workers", "before the pass"):
            if where == "2 workers" and ("same bytes" in what or "record" not in what):
                continue  # the planned version either way, or what a spawned copy finds too
            directory = fresh()
            change = lambda p=directory / target, r=rewrite: r(p)  # noqa: E731
            tally.case(
                f"step_guards: {target} rewritten in place ({what}); {where}",
                _either(lambda w=where, d=directory, c=change: _rewritten(w, d, c), want, loaded),
            )

    _waits(tally, workdir, base)


def _whole(read: Callable, directory: Path) -> list:
    return [[s.to_json() for s in read(directory / "step_000000.rfs")]]


def _summary(directory: Path) -> list:
    """``python -m rollfeed steps DIR``: ``[[samples, tokens]]``, or its first finding raised as
    a typed error naming the step file."""
    import contextlib
    import io
    import json

    from rollfeed.cli import main
    from rollfeed.loaders import StepFileError

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["steps", str(directory), "--json"])
    if rc not in (0, 1):
        raise Wrong(f"steps exited {rc}")
    report = json.loads(out.getvalue())
    if report["findings"]:
        f = report["findings"][0]
        raise StepFileError(f["message"], file=str(directory / f["step_file"]))
    return [[r["samples"], r["tokens"]] for r in report["steps"]]


def _rewritten(where: str, directory: Path, change: Callable[[], None]) -> list:
    """One pass over ``directory`` with ``change()`` made where the case says."""
    if where == "2 workers":
        return _loaded(directory, change)
    if where == "before the pass":
        change()
        return _planned(directory)
    return _planned(directory, copy=where == "spawned copy", rewrite=change)


def _either(run: Callable[[], list], want: list, loaded: list) -> Callable:
    """An attack: ``run()`` returns exactly the planned pass (``want``; a loader's: ``loaded``)
    or raises a typed error."""

    def attack() -> None:
        got = run()
        if got not in (want, loaded):
            raise Wrong(f"{len(got)} micro batches read, not the planned {len(want)} (or other)")

    return attack


def _rewrites(samples: list, path: Path) -> list:
    """``(what, rewrite(path))``: parts of the step file ``path`` rewritten in place, each to the
    same size."""
    from rollfeed.loaders.step_files import write_step_file
    from rollfeed.payload.format.step_layout import INDEX_ROW
    from tests.loaders.step_attacks import same_sizes_other_tokens
    from tests.loaders.step_bytes import flip, index_bytes, index_of, rewrite_index, write_at

    ROW = INDEX_ROW.itemsize
    data = path.read_bytes()
    index = index_of(path)
    at, size = index.offsets.tolist(), index.sizes.tolist()
    other = Path(
        write_step_file(path.parent.with_name("rewrites"), 0, same_sizes_other_tokens(samples))
    )
    others = other.read_bytes()
    i = next(j for j in range(N - 1) if size[j] == size[j + 1] and data[at[j] : at[j] + size[j]]
             != data[at[j + 1] : at[j + 1] + size[j + 1]])  # fmt: skip
    last, idx = N - 1, index_bytes(path)
    rows = bytearray(idx)
    rows[ROW * last + 24] ^= 1  # the last record's CRC-32C
    swapped = bytearray(idx)
    j = next(j for j in range(N - 1, 0, -1) if index.tokens[j] != index.tokens[j - 1])
    swapped[ROW * j + 16 : ROW * j + 24], swapped[ROW * (j - 1) + 16 : ROW * (j - 1) + 24] = (
        idx[ROW * (j - 1) + 16 : ROW * (j - 1) + 24],
        idx[ROW * j + 16 : ROW * j + 24],
    )

    def at_(offset: int, new: bytes) -> Callable[[Path], None]:
        return lambda p: write_at(p, offset, new)

    end = at[last] + size[last]
    return [
        ("the last record, other tokens", at_(at[last], others[at[last] : end])),
        ("every record, other tokens", at_(at[0], others[at[0] : end])),
        (
            "two records swapped",
            at_(at[i], data[at[i + 1] : at[i + 1] + size[i]] + data[at[i] : at[i] + size[i]]),
        ),
        ("the same bytes again", at_(0, data)),
        ("a record's header", lambda p: flip(p, at[last] + 1)),
        ("the index: the last record's CRC-32C", lambda p: rewrite_index(p, bytes(rows))),
        (
            "the index: two samples' token counts swapped",
            lambda p: rewrite_index(p, bytes(swapped)),
        ),
        ("the index's last byte", lambda p: flip(p, len(data) - 49)),
        ("the footer's magic", lambda p: flip(p, len(data) - 1)),
        ("the file header's version", lambda p: flip(p, 8)),
        ("the same index again, the same bytes", lambda p: rewrite_index(p, idx)),
    ]


def _waits(tally: Tally, workdir: Path, base: Path) -> None:
    """Steps that never come, and directories that are not step directories."""
    from rollfeed.loaders import LoaderConfigError, StepTimeoutError

    def timeout(directory: Path, found: str, **kw) -> Callable:
        def attack() -> None:
            from rollfeed.collate import PlanConfig
            from rollfeed.loaders import LoaderConfig, MicroBatchSampler, RolloutDataset, Topology

            ds = RolloutDataset.from_step_dir(directory)
            config = LoaderConfig(plan=PlanConfig(seq_len=SEQ), step_timeout_s=0.3, **kw)
            try:
                got = list(MicroBatchSampler(ds, Topology(), config))
            except StepTimeoutError as err:
                if str(directory) not in str(err) or found not in str(err):
                    raise Wrong(
                        f"the timeout does not name {directory} and {found!r}: {err}"
                    ) from None
                raise
            raise Wrong(f"a pass over a step that never came yielded {len(got)} micro batches")

        return attack

    empty = workdir / "empty"
    empty.mkdir()
    other = workdir / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    for what, directory, found, kw in [
        (
            "step 1 never comes, stream",
            base,
            "step files up to step 0",
            {"stream": True, "start_step": 1},
        ),
        ("step 1 never comes", base, "the producer's last step seen: 0", {"start_step": 1}),
        ("an empty directory", empty, "the directory is empty", {}),
        ("a directory of other files", other, "none named step_NNNNNN.rfs", {}),
    ]:
        tally.case(f"step_guards: wait: {what}", timeout(directory, found, **kw))

    def build(directory: Path, named: str) -> Callable:
        def attack() -> None:
            from rollfeed.loaders import RolloutDataset

            try:
                RolloutDataset.from_step_dir(directory)
            except LoaderConfigError as err:
                if named not in str(err):
                    raise Wrong(f"the error does not name {named}: {err}") from None
                raise
            raise Wrong(f"{directory} was taken for a step directory")

        return attack

    far = workdir / "far"
    far.mkdir()
    os.link(base / "step_000000.rfs", far / "step_3000000000.rfs")
    tally.case("step_guards: a step numbered 3000000000", lambda: _planned(far))
    run = workdir / "run"
    shutil.copytree(base, run / "steps")
    fifo = workdir / "fifo-dir"
    os.mkfifo(fifo)
    for what, directory, named in [
        ("a run folder for its steps/", run, os.fspath(run / "steps")),
        ("a missing path", workdir / "missing", "does not exist"),
        ("a FIFO as the step directory", fifo, "is not a directory"),
        ("a step file as the step directory", base / "step_000000.rfs", "is not a directory"),
    ]:
        tally.case(f"step_guards: build: {what}", build(directory, named))
    _beside(tally, workdir, base)


def _beside(tally: Tally, workdir: Path, base: Path) -> None:
    """Files beside a good step 0: a JSON-lines step file left unconverted is refused naming it
    and the command that converts it; one beside its converted file, and a killed writer's
    temporary file, are passed over (the pass is step 0's)."""
    want = _planned(base)
    for what, name, refused in [
        ("a JSON-lines step 1 left unconverted", "step_000001.jsonl", True),
        ("a JSON-lines step 0 beside its converted file", "step_000000.jsonl", False),
        ("a killed writer's temporary file", ".step_000001.rfs.77-0a1b2c3d.tmp", False),
    ]:
        directory = workdir / f"beside-{len(name)}-{refused}"
        shutil.copytree(base, directory)
        (directory / name).write_bytes(b'{"token_ids": [1, 2]}\n')
        path = directory / name if refused else directory / "step_000000.rfs"

        def attack(directory=directory, path=path, refused=refused) -> None:
            try:
                got = _planned(directory)
            except Exception as err:
                if refused and "steps convert" not in str(err):
                    raise Wrong(f"the refusal does not name the command: {err}") from None
                raise
            if refused or got != want:
                raise Wrong(f"a pass of {len(got)} micro batches")

        tally.case(f"step_guards: beside step 0: {what}", _names(path, refused, attack, None))
