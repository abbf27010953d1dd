"""``python -m rollfeed.bench steps``: what a step file costs, on disk and to read, against JSON
lines and against ``numpy.save`` of the same arrays.

The step of the design: ``--samples`` (128) samples of a 1,024-token prompt and a 7,168-token
completion, token ids below a vocabulary of 151,936, float32 inference logprobs, the loss mask on
the completion, one advantage per sample (and, second, a per-token advantage). Per way of storing
it, side by side in one run, medians of ``--repeats``:

- bytes per token on disk, and the time to write the step and to read it back as samples
  (``write_step_file`` / ``read_step_file``; JSON lines: ``Sample.to_json`` per line and
  ``Sample.from_json`` per line, as step files were; ``numpy.save`` / ``numpy.load`` of the
  arrays alone, token ids as uint32 and the mask as bits: the floor, no sample made);
- a loader pass over the step (``num_workers=0``, no payload: the micro batches' token tensors),
  from the step file against from the same samples in memory, in seconds per million tokens
  (goal: at most 2x), with the JSON-lines parse of the step per million tokens beside it.

Goals: at most 10 bytes per token with one advantage per sample (floor 8.1).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from rollfeed.collate import PlanConfig, Sample
from rollfeed.loaders import (
    LoaderConfig,
    RolloutDataset,
    Topology,
    build_dataloader,
    read_step_file,
    write_step_file,
)

VOCAB = 151_936
PROMPT, COMPLETION = 1_024, 7_168
CONFIG = PlanConfig(seq_len=16_384)


def make_step(rng: np.random.Generator, samples: int, per_token: bool) -> list[Sample]:
    T = PROMPT + COMPLETION
    out = []
    for _ in range(samples):
        advantage = rng.standard_normal(T) if per_token else np.full(T, rng.standard_normal())
        logprobs = np.r_[np.zeros(PROMPT), -rng.random(COMPLETION)]
        out.append(
            Sample(
                rng.integers(0, VOCAB, T),
                loss_mask=np.arange(T) >= PROMPT,
                advantages=advantage.astype(np.float32),
                inference_logprobs=logprobs.astype(np.float32),
            )
        )
    return out


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    got = fn()
    return time.perf_counter() - t, got


def _json(path: str, samples: list[Sample]) -> Callable[[], None]:
    def write() -> None:
        with open(path, "w") as f:
            f.writelines(s.to_json() + "\n" for s in samples)

    return write


def _json_read(path: str) -> list[Sample]:
    with open(path, "rb") as f:
        return [Sample.from_json(line) for line in f if line.strip()]


def _arrays(samples: list[Sample], per_token: bool) -> list[np.ndarray]:
    """The step's arrays at their narrowest: what any format must store."""
    ids = np.concatenate([s.token_ids for s in samples]).astype(np.uint32)
    logprobs = np.concatenate([s.inference_logprobs for s in samples])
    mask = np.packbits(np.concatenate([s.loss_mask for s in samples]))
    if per_token:
        advantages = np.concatenate([s.advantages for s in samples])
    else:
        advantages = np.array([s.advantages[0] for s in samples], np.float32)
    return [ids, logprobs, mask, advantages]


def _npy(path: str, arrays: list[np.ndarray]) -> Callable[[], None]:
    def write() -> None:
        with open(path, "wb") as f:
            for a in arrays:
                np.save(f, a)

    return write


def _npy_read(path: str) -> list[np.ndarray]:
    with open(path, "rb") as f:
        data = io.BytesIO(f.read())
    return [np.load(data) for _ in range(4)]


def _pass(dataset: RolloutDataset) -> float:
    loader = build_dataloader(dataset, Topology(), LoaderConfig(plan=CONFIG), root=None)
    t = time.perf_counter()
    for mb in loader:
        mb.input_ids.sum()
    return time.perf_counter() - t


def _formats(tmp: str, samples: list[Sample], per_token: bool, repeats: int) -> dict:
    """Per format: bytes, write and read seconds (medians)."""
    steps, js, npy = (os.path.join(tmp, k) for k in ("steps", "step.jsonl", "step.npy"))
    arrays = _arrays(samples, per_token)
    ways = {
        "step records": (
            lambda: write_step_file(steps, 0, samples, vocab_size=VOCAB),
            lambda: read_step_file(os.path.join(steps, "step_000000.rfs")),
            os.path.join(steps, "step_000000.rfs"),
        ),
        "JSON lines": (_json(js, samples), lambda: _json_read(js), js),
        "numpy.save": (_npy(npy, arrays), lambda: _npy_read(npy), npy),
    }
    out: dict = {k: {"write": [], "read": []} for k in ways}
    for _ in range(repeats):
        for name, (write, read, path) in ways.items():
            out[name]["write"].append(_timed(write)[0])
            out[name]["read"].append(_timed(read)[0])
            out[name]["bytes"] = os.path.getsize(path)
    return {
        k: {**v, "write": statistics.median(v["write"]), "read": statistics.median(v["read"])}
        for k, v in out.items()
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.bench steps")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args(argv)
    rng = np.random.default_rng(opts.seed)
    tokens = opts.samples * (PROMPT + COMPLETION)
    print(
        f"steps: {opts.samples} samples x ({PROMPT} prompt + {COMPLETION} completion) tokens = "
        f"{tokens} tokens, vocabulary {VOCAB}, float32 logprobs, loss mask on the completion"
    )
    for per_token in (False, True):
        samples = make_step(rng, opts.samples, per_token)
        with tempfile.TemporaryDirectory() as tmp:
            got = _formats(tmp, samples, per_token, opts.repeats)
            if not per_token:
                passes = _passes(os.path.join(tmp, "steps"), samples, opts.repeats)
        floor = got["numpy.save"]["bytes"] / tokens
        print(f"  {'per-token advantages' if per_token else 'one advantage per sample'}:")
        for name, row in got.items():
            size = row["bytes"]
            print(
                f"    {name:14s} {size / tokens:6.2f} B/token ({size / 1e6:6.1f} MB)"
                f"  write {row['write']:6.3f} s  read {row['read']:6.3f} s"
            )
        ours, js, npy = got["step records"], got["JSON lines"], got["numpy.save"]
        goal = (
            ""
            if per_token
            else f"; goal <= 10: {'met' if ours['bytes'] / tokens <= 10 else 'NOT met'}"
        )
        print(
            f"    step records vs numpy.save: {ours['bytes'] / npy['bytes']:.3f}x the bytes (floor "
            f"{floor:.2f} B/token{goal}), write {ours['write'] / npy['write']:.1f}x, read "
            f"{ours['read'] / npy['read']:.1f}x"
        )
        fewer, faster = js["bytes"] / ours["bytes"], js["write"] / ours["write"]
        print(
            f"    step records vs JSON lines: {fewer:.1f}x fewer bytes, write {faster:.1f}x "
            f"faster, read {js['read'] / ours['read']:.1f}x faster"
        )
    mem, disk, parse = (passes[k] * 1e6 / tokens for k in ("memory", "file", "json"))
    print(
        f"  loader pass (num_workers=0, no payload), s per million tokens: from the step file "
        f"{disk:.3f} vs in memory {mem:.3f} (ratio {disk / mem:.2f}x; goal <= 2x: "
        f"{'met' if disk <= 2 * mem else 'NOT met'}); parsing the JSON lines alone {parse:.3f}"
    )


def _passes(steps: str, samples: list[Sample], repeats: int) -> dict[str, float]:
    js = os.path.join(os.path.dirname(steps), "step.jsonl")
    times: dict[str, list[float]] = {"memory": [], "file": [], "json": []}
    for _ in range(repeats):
        times["memory"].append(_pass(RolloutDataset(samples)))
        times["file"].append(_pass(RolloutDataset.from_step_dir(steps)))
        times["json"].append(_timed(lambda: _json_read(js))[0])
    return {k: statistics.median(v) for k, v in times.items()}
