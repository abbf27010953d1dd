"""The writer families: writers SIGKILLed at random points (``kill``); prune and rewrite under
one writer name while a long-lived root reads, threads over a small descriptor cache and
symlinks swapped in and out of the root (``races``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import tracemalloc
from pathlib import Path

import numpy as np

from tests.payload.adversary_corpus import build_corpus, kept_sets, packed, request_arrays
from tests.payload.adversary_oracle import (
    FIELDS,
    SAMPLED,
    check_read,
    fields_of,
    region_of,
    write_request,
)
from tests.payload.adversary_tally import Tally, Wrong, typed


def _killed_writer(root: Path, k: int, seed: int, fd: int) -> None:
    """Grandchild: write requests forever, print each one's records once ``write`` returned."""
    from rollfeed.payload import PayloadWriter

    with PayloadWriter(root, group="live", name=f"w{k}") as w:
        for i in range(10**6):
            arrays = request_arrays(np.random.default_rng([seed, k, i]), 1 + (i * 7919) % 30000)
            segs = w.write(fields_of(arrays), pos=0, sampled=arrays[SAMPLED])
            line = json.dumps({"i": i, "segs": [s.model_dump_json() for s in segs]}) + "\n"
            os.write(fd, line.encode())


def family_kill(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """SIGKILL a writing process at random points: every record it handed out reads back exactly;
    ``verify`` passes or names the file the kill left incomplete."""
    from rollfeed.payload import PayloadRoot, PayloadSegment, read_field

    root = workdir / "root"
    seed = int(rng.integers(1 << 30))
    handed_end: dict[str, int] = {}  # killed writer's file -> body offset of its last record
    for k in range(8):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the grandchild
            try:
                tracemalloc.stop()
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                os.close(rfd)
                _killed_writer(root, k, seed, wfd)
            finally:
                os._exit(0)
        os.close(wfd)
        wait_lines = int(rng.integers(0, 4))
        buf = b""
        with os.fdopen(rfd, "rb", buffering=0) as pipe:
            while buf.count(b"\n") < wait_lines:
                chunk = pipe.read(1 << 16)
                if not chunk:
                    break
                buf += chunk
            if rng.random() < 0.7:
                signal.setitimer(signal.ITIMER_REAL, 0)
                import time

                time.sleep(float(rng.random()) * 0.004)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            buf += pipe.read()
        lines = buf.split(b"\n")[:-1]  # the last, partial line was never handed out
        reader = PayloadRoot(root, retries=0)
        for line in lines:
            item = json.loads(line)
            i = item["i"]
            arrays = request_arrays(np.random.default_rng([seed, k, i]), 1 + (i * 7919) % 30000)
            segs = [PayloadSegment.from_json(t) for t in item["segs"]]
            regions = {(s.file, s.offset): region_of(s, arrays) for s in segs}
            rows = segs[0].rows
            for name in FIELDS:

                def attack(name=name, segs=segs, rows=rows, regions=regions, reader=reader):
                    out = read_field(segs, name, (0, rows), root=reader)
                    check_read(out, segs, name, [(0, rows)], regions)

                tally.case(f"kill {k}: handed-out request {i} {name}", attack, refusal_ok=False)
        reader.close()
        records = [PayloadSegment.from_json(t) for line in lines for t in json.loads(line)["segs"]]
        handed_end[f"w{k}.rfp"] = max((s.offset for s in records), default=-1)
        from rollfeed import cli

        def check_verify(k=k):
            """Findings may name only killed writers' files, and only past their last handed-out
            record: the bytes of every record a writer handed out stay sound."""
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = cli.verify(os.fspath(root))
            text = out.getvalue()
            bad = [ln for ln in text.splitlines() if "BAD" in ln.upper() and ".rfp" in ln]
            for ln in bad:
                name = next((f for f in handed_end if f in ln), None)
                at = re.search(r"offset=(\d+)", ln)
                past = name is not None and at is not None and int(at[1]) > handed_end[name]
                if name is None or (handed_end[name] >= 0 and not past):
                    raise Wrong(f"verify after killing writer {k} returned {rc}: {text!r}")
            if rc != 0 and not bad:
                raise Wrong(f"verify after killing writer {k} returned {rc}: {text!r}")

        if root.exists():
            tally.case(f"kill {k}: verify", check_verify)
        tally.case(f"kill {k}: lines handed out {len(lines)}", lambda: None)


def _version(root: Path, v: int, counts: np.ndarray) -> tuple[list, dict]:
    """Group ``step``, writer ``w``, version ``v``: the same layout every version, new values."""
    from rollfeed.payload import PayloadWriter

    rng = np.random.default_rng(v)
    rows = len(counts)
    ids, sampled = kept_sets(rng, counts)
    arrays = {
        "routed_experts": rng.integers(1, 200, (rows, 2, 3)),
        "routed_expert_weights": rng.normal(size=(rows, 2, 3)).astype(np.float32),
        "sampling_mask": (counts, ids),
        "sampling_mask_logprobs": (counts, -rng.random(int(counts.sum())).astype(np.float32)),
        SAMPLED: sampled,
    }
    regions: dict = {}
    with PayloadWriter(root, group="step", name="w") as w:
        segs = write_request(w, arrays, regions)
    return segs, regions


def family_races(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Prune and rewrite under the same writer name while one long-lived PayloadRoot reads; many
    threads over a small descriptor cache; a symlink swapped in and out of the root."""
    import threading
    import time

    from rollfeed.payload import PayloadRoot

    root = workdir / "root"
    counts = rng.integers(1, 5, 300)
    reader = PayloadRoot(root, retries=1, backoff_s=0.001)
    orchestrator = PayloadRoot(root)
    old = _version(root, 0, counts)
    for v in range(1, 25):  # sequential: the reader holds the old file open
        for name in FIELDS:
            tally.case(
                f"races: version {v - 1} before prune, {name}",
                lambda name=name, o=old: _read_exact(reader, o, name),
            )
        orchestrator.prune("step")
        new = _version(root, v, counts)
        for name in FIELDS:
            tally.case(
                f"races: version {v} after prune and rewrite, {name}",
                lambda name=name, n=new: _read_exact(reader, n, name),
                refusal_ok=False,
            )
            tally.case(
                f"races: version {v - 1} records after the rewrite, {name}",
                lambda name=name, o=old: _read_exact(reader, o, name),
            )
        old = new
    published = [old]
    stop = threading.Event()

    def rewrite():
        v = 100
        while not stop.is_set():
            orchestrator.prune("step")
            published.append(_version(root, v, counts))
            v += 1

    t = threading.Thread(target=rewrite)
    t.start()
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            for name in FIELDS:
                tally.case(
                    f"races: concurrent prune/rewrite, {name}",
                    lambda name=name, snap=published[-1]: _read_exact(reader, snap, name),
                )
    finally:
        stop.set()
        t.join()
    _threads_over_a_small_cache(tally, workdir, rng)
    _symlink_swap(tally, workdir, rng)


def _read_exact(root, version: tuple[list, dict], name: str) -> None:
    from rollfeed.payload import read_field

    segs, regions = version
    rows = segs[0].rows
    check_read(read_field(segs, name, (0, rows), root=root), segs, name, [(0, rows)], regions)


def _threads_over_a_small_cache(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Four threads share one PayloadRoot (max_open=3) over 12 files: every read is exact."""
    import threading

    from rollfeed.payload import PayloadRoot, PayloadWriter

    base = workdir / "many"
    versions = []
    for i in range(12):
        regions: dict = {}
        with PayloadWriter(base, name=f"f{i}") as w:
            segs = write_request(w, request_arrays(rng, 40 + i), regions)
        versions.append((segs, regions))
    shared = PayloadRoot(base, max_open=3, retries=0)
    results: list[tuple[str, str]] = []

    def worker(seed: int) -> None:
        r = np.random.default_rng(seed)
        for _ in range(150):
            i, name = int(r.integers(12)), FIELDS[int(r.integers(4))]
            try:
                _read_exact(shared, versions[i], name)
                results.append(("correct", ""))
            except Wrong as err:
                results.append(("wrong", f"file f{i} {name}: {err}"))
            except BaseException as err:
                results.append(("untyped" if not typed(err) else "wrong", f"f{i} {name}: {err!r}"))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if any(t.is_alive() for t in threads):
        tally.record("hang", "races: threads over a small descriptor cache did not finish in 20 s")
    for outcome, detail in results:
        tally.record(outcome, f"races: 4 threads, max_open=3, 12 files: {detail}")


def _symlink_swap(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """A thread swaps ``g/swap.rfp`` (and directory ``sw``) between a file inside the root and
    the canary outside: reads are exact or typed, never the canary's bytes."""
    import threading
    import time

    from rollfeed.payload import PayloadRoot

    corpus = build_corpus(workdir / "swap", rng)
    inside, outside = corpus.root / "g" / "a.rfp", corpus.outside / "g" / "a.rfp"
    link, dlink = corpus.root / "g" / "swap.rfp", corpus.root / "sw"
    stop = threading.Event()

    def swap():
        k = 0
        while not stop.is_set():
            for path, target in (
                (link, [inside, outside][k % 2]),
                (dlink, [inside.parent, outside.parent][k % 2]),
            ):
                tmp = path.with_name(path.name + ".tmp")
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                tmp.symlink_to(target)
                os.replace(tmp, path)
            k += 1

    t = threading.Thread(target=swap)
    t.start()
    root = PayloadRoot(corpus.root, retries=0)
    segs, total = packed(corpus, [0, 1])
    deadline = time.monotonic() + 0.6
    try:
        while time.monotonic() < deadline:
            for alias in ("g/swap.rfp", "sw/a.rfp"):
                moved = [s.model_copy(update={"file": alias}) for s in segs]
                for name in FIELDS:
                    # the canary check runs first; the regions of the alias are unknown, so an
                    # exact read of the inside file through the symlink still counts as wrong
                    tally.case(
                        f"races: symlink swap {alias}, {name}",
                        lambda name=name, m=moved: check_read(
                            _read(m, name, total, root), m, name, [(0, total)], corpus.regions
                        ),
                    )
    finally:
        stop.set()
        t.join()


def _read(segs, name, total, root):
    from rollfeed.payload import read_field

    return read_field(segs, name, (0, total), root=root)
