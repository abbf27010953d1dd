"""PolicyScorer on the tiny Qwen3-VL-MoE in one process: a packed row of samples with images
(one image shared by three samples, encoded once) and recorded routes replayed in the language
model scores as the samples one at a time through the stock model, gradients to the vision tower
included; placeholders that are not the images' runs, and images for a text model, are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PackingError, PolicyScorer
from tests.dist.policy_cases import loss_weights
from tests.models.tiny import tiny_qwen3
from tests.models.tiny_vlm import one_thread, processor_spec, tiny_qwen3_vl_moe
from tests.models.vlm_cases import own_routing, vlm_reference, vlm_samples

SPEC = processor_spec()


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


LAYOUTS = [[3, "shared", 5], [2, "own", 3, "shared", 6], [7], [4, "shared", 4]]


def test_packed_row_with_images_and_replayed_routes_equals_per_sample_stock_scoring():
    stock = tiny_qwen3_vl_moe(seed=2)
    stock.set_attn_implementation("sdpa")
    routing = own_routing(stock, vlm_samples(0, LAYOUTS, SPEC), SPEC)
    samples = vlm_samples(0, LAYOUTS, SPEC, routing=routing)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=96), dp_size=1)[0]
    w = loss_weights(mb.length, seed=1)
    lp, ent, valid = vlm_reference(stock, mb, SPEC)
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    scorer = PolicyScorer(
        tiny_qwen3_vl_moe(seed=2), compute_entropy=True, entropy_requires_grad=True
    )
    out = scorer.score(to_tensor_micro_batch(mb, cp_rank=0, image_processor=SPEC))
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    assert torch.equal(out.valid_mask, valid) and int(valid.sum()) > 15
    torch.testing.assert_close(out.logprobs.detach(), lp.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.entropy.detach(), ent.detach(), atol=1e-10, rtol=0)
    assert int(out.metrics["rows_replayed"]) > 0
    assert (int(out.metrics["images_encoded"]), int(out.metrics["vision_patches"])) == (
        2,
        24 + sum(im.patches for im in samples[1].images[:1]),
    )
    grads = dict(stock.named_parameters())
    towers = 0
    for name, p in scorer.model.named_parameters():
        want = grads[name].grad
        assert (p.grad is None) == (want is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, want, atol=1e-9, rtol=1e-7)
            towers += name.startswith("model.visual.") and bool(p.grad.abs().sum() > 0)
    assert towers > 10  # the vision tower's parameters get their gradients


def test_placeholders_must_be_the_images_runs_and_a_text_model_refuses_images():
    samples = vlm_samples(1, [[3, "own", 4]], SPEC)
    s = samples[0]
    ids = s.token_ids.copy()
    ids[s.images[0].start] = 5  # a placeholder token replaced by text
    wrong = dataclasses.replace(s, token_ids=ids)
    (mb,) = prepare_batch([wrong], PlanConfig(seq_len=32), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0, image_processor=SPEC)
    with pytest.raises(PackingError, match="image record's placeholder") as err:
        PolicyScorer(tiny_qwen3_vl_moe(seed=0)).score(tmb)
    assert err.value.pos == s.images[0].start
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=32), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0, image_processor=SPEC)
    with pytest.raises(PackingError, match="no vision tower"):
        PolicyScorer(tiny_qwen3(seed=0)).score(tmb)


def test_a_text_only_micro_batch_on_the_vlm_is_the_stock_text_forward():
    samples = vlm_samples(2, [[6], [9]], SPEC)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=32), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    assert tmb.media is None
    out = PolicyScorer(tiny_qwen3_vl_moe(seed=3), compute_entropy=True).score(tmb)
    stock = tiny_qwen3_vl_moe(seed=3)
    stock.set_attn_implementation("sdpa")
    lp, _, valid = vlm_reference(stock, mb, SPEC)
    assert torch.equal(out.valid_mask, valid)
    torch.testing.assert_close(out.logprobs.detach(), lp.detach(), atol=1e-10, rtol=0)
    assert int(out.metrics["images_encoded"]) == 0
