"""Cases for scoring the tiny VLM: samples with images, kept sets and routing, and the reference.

The reference scores each sample alone with the stock model forward (sdpa, the model's own
``get_rope_index`` from ``mm_token_type_ids``, its own ``get_image_features`` on the processor's
pixels of that sample's images), full logits and the support formula in float64
(:func:`tests.dist.policy_cases.reference`). The scorer under test shares nothing with it but the
router replay hooks when routing is replayed.
"""

from __future__ import annotations

import numpy as np
import torch

from rollfeed.collate import MicroBatch, Sample
from rollfeed.models.router_replay import RouterReplay
from rollfeed.payload import ImageProcessorSpec, MediaWriter
from tests.dist.policy_cases import reference
from tests.models.tiny_vlm import IMAGE_TOKEN, VOCAB, png, vlm_sample

EXPERTS = 8


def pixel_inputs(sample: Sample, spec: ImageProcessorSpec, root=None) -> dict:
    """The stock forward's image inputs for one sample (none for a text-only sample)."""
    ids = torch.as_tensor(sample.token_ids)[None]
    if not sample.images:
        return {}
    from rollfeed.payload import read_media

    pixels = [
        spec.process(im.data if im.media is None else read_media(root, im.media)).pixel_values
        for im in sample.images
    ]
    return {
        "pixel_values": torch.from_numpy(np.concatenate(pixels)),
        "image_grid_thw": torch.tensor([im.grid for im in sample.images]),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
    }


def vlm_samples(
    seed: int,
    layouts: list[list[int | str]],
    spec: ImageProcessorSpec,
    *,
    writer: MediaWriter | None = None,
    routing: list[np.ndarray] | None = None,
) -> list[Sample]:
    """Samples of text runs (ints) and images (``"shared"``: one image common to all samples,
    ``"own"``: a fresh one), the last text run sampled: kept sets of the sampled token plus 0-3
    others (some rows unrecorded), temperatures 0.7/1.0; ``routing`` (each sample's own
    ``[T, layers, top_k]``): recorded routes shifted by 3 of 8 experts on the forwarded rows."""
    rng = np.random.default_rng(seed)
    shared = png(rng, 32, 48)
    out = []
    for i, layout in enumerate(layouts):
        pieces = [shared if p == "shared" else png(rng) if p == "own" else p for p in layout]
        base = vlm_sample(np.random.default_rng([seed, i]), pieces, spec, writer=writer)
        T, ids = len(base), base.token_ids
        prompt = int(np.argmax(base.loss_mask))
        counts, values = np.zeros(T, np.int64), []
        for t in range(prompt, T):
            if rng.random() < 0.15:
                continue
            others = np.setdiff1d(np.arange(IMAGE_TOKEN), [ids[t]])
            extra = rng.choice(others, rng.integers(0, 4), replace=False)
            row = [int(ids[t]), *map(int, extra)]
            counts[t] = len(row)
            values += row
        fields: dict = {"sampling_mask": (counts, np.asarray(values, np.int32))}
        if routing is not None:
            fields["routed_experts"] = ((routing[i][:-1] + 3) % EXPERTS).astype(np.uint8)
        out.append(
            Sample(
                ids,
                loss_mask=base.loss_mask,
                advantages=base.advantages,
                inference_logprobs=base.inference_logprobs,
                temperatures=rng.choice([0.7, 1.0], T).astype(np.float32),
                fields=fields,
                images=base.images,
                uid=f"s{i}",
            )
        )
    assert all(v < VOCAB for v in values)
    return out


def own_routing(model, samples: list[Sample], spec: ImageProcessorSpec, root=None) -> list:
    """Each sample's own routing alone through the stock forward, ``[T, layers, top_k]``."""
    replay = RouterReplay(model)
    out = []
    for s in samples:
        with torch.no_grad(), replay.recording() as rec:
            model(
                input_ids=torch.as_tensor(s.token_ids)[None],
                **_doubled(pixel_inputs(s, spec, root)),
            )
        out.append(rec[0].experts.numpy())
    replay.remove()
    return out


def _doubled(inputs: dict) -> dict:
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].double()
    return inputs


def vlm_reference(model, mb: MicroBatch, spec: ImageProcessorSpec, root=None):
    """``(logprobs, entropy, valid) [S]`` of ``mb``'s samples scored one at a time (sdpa)."""
    inputs = iter([_doubled(pixel_inputs(s, spec, root)) for s in mb.samples])

    def forward(m, ids):
        return m(input_ids=ids[None], **next(inputs)).logits[0]

    return reference(model, mb, forward=forward)
