"""Attack family ``step_guards`` of the adversary harness (:mod:`tests.payload.adversary`): step
files and indexes that are not what their names say, rewritten in place, or never coming.

- Under the step file's or the index's name (each in turn): a FIFO without a writer, a directory,
  a symlink to a good copy, to a canary outside the step directory, a dangling symlink, a unix
  socket, a sparse file of 2**40 bytes, an empty file; and, accepted as the step itself, a hard
  link to a good copy. Each is planned by a sampler (stream mode, and listing the directory), read
  whole by ``read_step_file`` and indexed by ``build_step_index``. A refusal must be a typed
  error naming that path; a FIFO open would block for ever, so the per-case alarm proves no
  hang; bytes of the canary in a sample are an ``escape``.
- Rewritten in place to the very same size after the pass's first micro batch (or before the
  pass): a step line with other tokens of the same sizes, two lines swapped, the same bytes
  again; an index with a line's CRC-32C changed, two samples' lengths swapped, the same bytes
  again. Read in the trainer's process, in a spawned copy of the dataset, or by two forked
  DataLoader workers, a pass yields exactly the planned samples or raises a typed error.
- A step that never comes (stream mode and not, ``step_timeout_s=0.3``), a run folder given for
  its ``steps/``, a missing path, a FIFO as the step directory: a typed error naming the directory
  and what is there.
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


# (what, make(target, good copy, canary), refused): things put under a step file's or an index's
# name; a hard link to a good copy is the file itself
THINGS: list[tuple[str, Callable[[Path, Path, Path], None], bool]] = [
    ("a FIFO", lambda t, g, c: os.mkfifo(t), True),
    ("a directory", lambda t, g, c: t.mkdir(), True),
    ("a symlink to a good copy", lambda t, g, c: t.symlink_to(g), True),
    ("a symlink to a canary outside", lambda t, g, c: t.symlink_to(c), True),
    ("a dangling symlink", lambda t, g, c: t.symlink_to(t.with_name("gone")), True),
    ("a unix socket", lambda t, g, c: _socket(t), True),
    ("a sparse file of 2**40 bytes", lambda t, g, c: _sparse(t), True),
    ("a hard link to a good copy", lambda t, g, c: os.link(g, t), False),
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
    from rollfeed.loaders.step_index import build_step_index, index_path
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

    for target in ("step_000000.jsonl", "step_000000.index.json"):
        ways: list[tuple[str, Callable[[Path], list], list]] = [
            ("planned, listing the directory", _planned, want),
            ("planned in stream mode", lambda d: _planned(d, stream=True), want),
        ]
        things = list(THINGS)
        if target.endswith("jsonl"):
            ways.append(("read_step_file", lambda d: _whole(read_step_file, d), [samples_json]))
            ways.append(("build_step_index", lambda d: _index(build_step_index, d), [lengths]))
        else:
            things.append(("an empty file", lambda t, g, c: t.write_bytes(b""), True))
        for indexed in (True, False) if target.endswith("jsonl") else (True,):
            for what, make, refused in things:
                for how, run, expect in ways:
                    directory = fresh()
                    path = directory / target
                    if not indexed:
                        index_path(directory / "step_000000.jsonl").unlink()
                    path.unlink()
                    make(path, good / target, canary)
                    tally.case(
                        f"step_guards: {target} is {what}{'' if indexed else ', no index'}; {how}",
                        _names(path, refused, lambda run=run, d=directory: run(d), expect),
                    )

    loaded = _loaded(fresh(), lambda: None, workers=0)
    for what, rewrite, target in [*_step_rewrites(samples), *_index_rewrites()]:
        for where in ("trainer", "spawned copy", "2 workers", "before the pass"):
            if where == "2 workers" and "same bytes" in what:
                continue  # what the workers read is the planned version either way
            directory = fresh()
            change = lambda p=directory / target, r=rewrite: r(p)  # noqa: E731
            tally.case(
                f"step_guards: {target} rewritten in place ({what}); {where}",
                _either(lambda w=where, d=directory, c=change: _rewritten(w, d, c), want, loaded),
            )

    _waits(tally, workdir, base)


def _whole(read: Callable, directory: Path) -> list:
    return [[s.to_json() for s in read(directory / "step_000000.jsonl")]]


def _index(build: Callable, directory: Path) -> list:
    from rollfeed.loaders.step_index import read_step_index

    build(directory / "step_000000.jsonl")
    return [read_step_index(directory / "step_000000.jsonl").lengths.tolist()]


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


def _step_rewrites(samples: list) -> list:
    """``(what, rewrite(path), target)`` of step file lines, each in place to the same size."""
    from tests.loaders.step_attacks import same_sizes_other_tokens

    lines = [(s.to_json() + "\n").encode() for s in samples]
    other = [(s.to_json() + "\n").encode() for s in same_sizes_other_tokens(samples)]
    i = next(j for j in range(N - 1) if len(lines[j]) != len(lines[j + 1]))

    def at(offset: int, data: bytes) -> Callable[[Path], None]:
        def rewrite(path: Path) -> None:
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(data)

        return rewrite

    offsets = np.cumsum([0] + [len(x) for x in lines]).tolist()
    last = N - 1
    return [
        ("the last line, other tokens", at(offsets[last], other[last]), "step_000000.jsonl"),
        ("every line, other tokens", at(0, b"".join(other)), "step_000000.jsonl"),
        ("two lines swapped", at(offsets[i], lines[i + 1] + lines[i]), "step_000000.jsonl"),
        ("the same bytes again", at(0, b"".join(lines)), "step_000000.jsonl"),
    ]


def _index_rewrites() -> list:
    """``(what, rewrite(path), target)`` of the index, each in place to the same size."""

    def edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
        def rewrite(path: Path) -> None:
            import json

            text = path.read_bytes()
            record = json.loads(text)
            change(record)
            new = json.dumps(record, separators=(",", ":")).encode()
            new = new[: len(text)].ljust(len(text), b" ")  # the same size, JSON whitespace
            with open(path, "r+b") as f:
                f.write(new)

        return rewrite

    def crc(record: dict) -> None:
        record["crc32c"][-1] ^= 1

    def lengths(record: dict) -> None:
        a = record["lengths"]
        j = next(j for j in range(len(a) - 1, 0, -1) if a[j] != a[j - 1])
        if len(str(a[j])) == len(str(a[j - 1])):
            a[j], a[j - 1] = a[j - 1], a[j]

    name = "step_000000.index.json"
    return [
        ("the last line's CRC-32C", edit(crc), name),
        ("two samples' lengths swapped", edit(lengths), name),
        ("the same bytes again", edit(lambda record: None), name),
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
        ("a directory of other files", other, "none named step_NNNNNN.jsonl", {}),
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
    os.link(base / "step_000000.jsonl", far / "step_3000000000.jsonl")
    tally.case("step_guards: a step numbered 3000000000", lambda: _planned(far))
    run = workdir / "run"
    shutil.copytree(base, run / "steps")
    fifo = workdir / "fifo-dir"
    os.mkfifo(fifo)
    for what, directory, named in [
        ("a run folder for its steps/", run, os.fspath(run / "steps")),
        ("a missing path", workdir / "missing", "does not exist"),
        ("a FIFO as the step directory", fifo, "is not a directory"),
        ("a step file as the step directory", base / "step_000000.jsonl", "is not a directory"),
    ]:
        tally.case(f"step_guards: build: {what}", build(directory, named))
