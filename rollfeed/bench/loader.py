"""``python -m rollfeed.bench loader``: how much payload decoding the trainer still waits for.

One step of by-handle samples (routing ``[T, 48, 8]`` uint8 and CSR sampling masks with their
logprobs, one payload file per request) is planned into 16,384-token micro batches for one rank.
A consumer that is busy ``--busy-ms`` per micro batch (simulated compute) drains the loader:

- trainer-visible wait per micro batch (time blocked in ``next``, and dropping the batch the
  consumer is done with), mean over all but the first, with ``--workers`` worker processes and
  the receive thread (the default), the same workers without it (``receive_depth=0``), and the
  work done on the main thread (``num_workers=0``, where the wait is the whole decode);
- where that wait goes (``loader.metrics``): before the micro batch was made (the workers are
  behind) or after (its handover: transfer, receive, pinning), with the memfd handover (the
  default) against torch's own (``handover="torch"``), each with and without the receive thread;
- time to the first micro batch (workers, start included; and for the next step, with the
  workers already running) against decoding the whole step up front (``prepare_batch`` +
  ``to_tensor_micro_batch`` for every micro batch, the first usable only when all are done).

Both sides run in one process, interleaved, on the page cache; medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import numpy as np

from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    RolloutLoader,
    Topology,
    build_dataloader,
    read_step_file,
    step_file_name,
    write_step_file,
)
from rollfeed.payload import PayloadRoot, PayloadWriter

SEQ_LEN = 16_384
CONFIG = PlanConfig(seq_len=SEQ_LEN)


def make_step(root: str, rng: np.random.Generator, samples: int) -> list[Sample]:
    out = []
    for i, T in enumerate(rng.integers(1_024, 8_192, samples).tolist()):
        P = T // 4  # prompt; the completion [P, T) carries the masks
        counts = rng.geometric(1 / 4, T - P)
        tokens = rng.integers(0, 151_936, T)
        kept = rng.integers(0, 151_936, counts.sum()).astype(np.int32)
        kept[np.cumsum(counts) - counts] = tokens[P:]  # each kept set holds its sampled token
        arrays = {
            "routed_experts": rng.integers(0, 128, (T, 48, 8)).astype(np.uint8),
            "sampling_mask": (counts, kept),
            "sampling_mask_logprobs": (counts, -rng.random(counts.sum(), dtype=np.float32)),
        }
        with PayloadWriter(root, group="bench", name=f"req{i}") as w:
            segs = w.write({"routed_experts": arrays["routed_experts"]}, 0)
            rest = {k: v for k, v in arrays.items() if k != "routed_experts"}
            segs += w.write(rest, P, sampled=tokens[P:])
        out.append(
            Sample(
                tokens,
                loss_mask=np.arange(T) >= P,
                advantages=rng.standard_normal(T).astype(np.float32),
                inference_logprobs=-rng.random(T, dtype=np.float32),
                payload=segs,
            )
        )
    return out


def drain(make, busy_s: float) -> tuple[RolloutLoader, float, list[float], dict[str, float]]:
    """(the loader ``make()`` built, seconds from calling it to the first micro batch, wait in
    ``next`` for each later one, and their wait split as ``loader.metrics`` counts it). Building
    is timed: it reads the first step's lengths."""
    t0 = time.perf_counter()
    loader = make()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    before = dict(loader.metrics)
    waits = []
    while True:
        time.sleep(busy_s)
        t = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            after = loader.metrics
            split = {k: after[k] - before[k] for k in ("wait_making_s", "wait_handover_s")}
            return loader, first, waits, split
        waits.append(time.perf_counter() - t)


def _next_step_first(loader) -> float:
    """Seconds to the first micro batch of the next step (workers already running)."""
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    return first


def _up_front(path: str, root: str) -> float:
    t0 = time.perf_counter()
    samples = read_step_file(path)
    plan = prepare_batch(samples, CONFIG, dp_size=1)
    proot = PayloadRoot(root)
    for mb in plan[0]:
        to_tensor_micro_batch(mb, cp_rank=0, root=proot)
    return time.perf_counter() - t0


def _lengths(steps: str) -> float:
    """Seconds for a fresh dataset's ``lengths(0)`` (what planning a step reads)."""
    t0 = time.perf_counter()
    RolloutDataset.from_step_dir(steps).lengths(0)
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(prog="python -m rollfeed.bench loader")
    args.add_argument("--samples", type=int, default=48)
    args.add_argument("--workers", type=int, default=2)
    args.add_argument("--busy-ms", type=float, default=20.0)
    args.add_argument("--repeats", type=int, default=5)
    args.add_argument("--seed", type=int, default=0)
    opts = args.parse_args(argv)
    busy = opts.busy_ms / 1e3
    with tempfile.TemporaryDirectory() as tmp:
        root, steps = os.path.join(tmp, "payload"), os.path.join(tmp, "steps")
        os.makedirs(steps)
        samples = make_step(root, np.random.default_rng(opts.seed), opts.samples)
        for step in (0, 1):  # a second step, for the warm time to first
            write_step_file(steps, step, samples)
        topo = Topology(dp_rank=0, dp_size=1)
        names = ("workers", "no_thread", "torch", "torch_no_thread", "main")
        rows: dict[str, list] = {k: [] for k in names}
        warm: dict[str, list[float]] = {"workers": []}
        times: dict[str, list[float]] = {"up_front": [], "index": []}
        runs = (
            ("workers", steps, dict(num_workers=opts.workers)),
            ("no_thread", steps, dict(num_workers=opts.workers, receive_depth=0)),
            ("torch", steps, dict(num_workers=opts.workers, handover="torch")),
            ("torch_no_thread", steps, dict(num_workers=opts.workers, receive_depth=0,
                                            handover="torch")),
            ("main", steps, dict(num_workers=0)),
        )  # fmt: skip
        for _ in range(opts.repeats):
            for name, directory, options in runs:
                # a fresh loader per run: time to first includes building it, starting the workers
                make = functools.partial(
                    build_dataloader,
                    RolloutDataset.from_step_dir(directory),
                    topo,
                    LoaderConfig(plan=CONFIG),
                    root=root,
                    options=LoaderOptions(**options),
                )
                loader, first, waits, split = drain(make, busy)
                rows[name].append((first, waits, split))
                if name in warm:
                    warm[name].append(_next_step_first(loader))
                loader.close()
                del loader
            times["up_front"].append(_up_front(os.path.join(steps, step_file_name(0)), root))
            times["index"].append(_lengths(steps))
    micro = len(rows["main"][0][1]) + 1
    wait = {k: statistics.median(statistics.mean(w) for _, w, _ in rows[k]) for k in rows}
    first = statistics.median(f for f, _, _ in rows["workers"])
    whole = statistics.median(times["up_front"])
    tokens = sum(len(s) for s in samples)
    print(
        f"loader: {opts.samples} samples, {tokens} tokens, {micro} micro batches of <= {SEQ_LEN} "
        f"tokens, routing [T, 48, 8] uint8 + CSR masks, busy {opts.busy_ms:.0f} ms per micro batch"
    )
    print(
        f"  wait per micro batch after the first: num_workers={opts.workers} "
        f"{wait['workers'] * 1e3:.2f} ms vs main thread {wait['main'] * 1e3:.2f} ms "
        f"(ratio {wait['main'] / max(wait['workers'], 1e-9):.1f}x; goal <= 1 ms)"
    )
    print(
        f"  receive thread: num_workers={opts.workers} {wait['workers'] * 1e3:.2f} ms vs without "
        f"it {wait['no_thread'] * 1e3:.2f} ms "
        f"(ratio {wait['no_thread'] / max(wait['workers'], 1e-9):.1f}x)"
    )
    print(
        "  where the wait goes, per micro batch (making: not made yet; handover: on its way; "
        "drop: freeing the one before)"
    )
    for name, label in (
        ("workers", "memfd handover, receive thread (default)"),
        ("no_thread", "memfd handover, no receive thread"),
        ("torch", "torch's handover, receive thread"),
        ("torch_no_thread", "torch's handover, no receive thread"),
    ):
        k = micro - 1
        run = min(rows[name], key=lambda r: abs(statistics.mean(r[1]) - wait[name]))  # median run
        making, handover = (run[2][key] / k * 1e3 for key in ("wait_making_s", "wait_handover_s"))
        drop = statistics.mean(run[1]) * 1e3 - making - handover
        print(
            f"    {label:42s} wait {wait[name] * 1e3:6.2f} ms = making {making:6.2f} + "
            f"handover {handover:6.2f} + drop {drop:5.2f}"
        )
    ratio = wait["torch"] / max(wait["workers"], 1e-9)
    print(
        f"  handover: memfd {wait['workers'] * 1e3:.2f} ms vs torch's {wait['torch'] * 1e3:.2f} "
        f"ms (ratio {ratio:.1f}x)"
    )
    print(
        f"  time to first micro batch: {first * 1e3:.1f} ms (workers, build and start included) vs "
        f"whole step read, parsed and decoded up front {whole * 1e3:.1f} ms "
        f"(ratio {whole / first:.1f}x)"
    )
    nxt = statistics.median(warm["workers"])
    print(
        f"  time to first micro batch of the next step (workers running): {nxt * 1e3:.1f} ms vs "
        f"whole step read, parsed and decoded up front {whole * 1e3:.1f} ms "
        f"(ratio {whole / nxt:.1f}x)"
    )
    index = statistics.median(times["index"])
    print(f"  lengths for planning: from the step file's index {index * 1e3:.2f} ms")
