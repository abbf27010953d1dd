"""Samples with images through the planner and the tensors of each rank: mRoPE positions as the
model families compute them, truncation that never splits an image (counted), the row's images
dealt over cp, pixels processed for the images a rank encodes, by handle == inline bitwise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rollfeed.collate import (
    BatchConfigError,
    ImageInputError,
    ImageRuns,
    LossRuns,
    PlanConfig,
    Sample,
    SampleDtypeError,
    SampleValueError,
    SegmentRangeError,
    plan_lengths,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.collate.cp import ranges_index, rank_ranges
from rollfeed.collate.image_owners import deal_images
from rollfeed.collate.image_runs import image_cut
from rollfeed.collate.mrope import mrope_positions
from rollfeed.payload import ImageProcessorSpec, MediaWriter, PayloadWriter
from tests.collate.gen import make_pair
from tests.collate.test_equality import _assert_equal
from tests.models.tiny_vlm import IMAGE_TOKEN, image_span, png, processor_spec, vlm_sample

SPEC = processor_spec()


def _family_models():
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLModel,
        Qwen2VLConfig,
        Qwen2VLModel,
        Qwen3VLMoeModel,
    )

    from tests.models.tiny_vlm import TOKENS, tiny_vlm_config

    text = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, num_heads=2, patch_size=8, spatial_merge_size=2)
    return {
        "qwen2_vl": Qwen2VLModel(
            Qwen2VLConfig(text_config=text, vision_config=dict(vision, embed_dim=16), **TOKENS)
        ),
        "qwen2_5_vl": Qwen2_5_VLModel(
            Qwen2_5_VLConfig(
                text_config=text,
                vision_config=dict(vision, hidden_size=16, intermediate_size=16),
                **TOKENS,
            )
        ),
        "qwen3_vl_moe": Qwen3VLMoeModel(tiny_vlm_config()),
    }


def test_mrope_positions_equal_each_families_rope_index():
    rng = np.random.default_rng(0)
    models = _family_models()
    checked = 0
    for _ in range(12):
        pieces: list[int | bytes] = [int(rng.integers(0, 4))]
        for _ in range(int(rng.integers(0, 4))):  # images between text (as templates put them)
            pieces += [png(rng), int(rng.integers(1, 5))]
        sample = vlm_sample(rng, [p for p in pieces if p != 0] or [1], SPEC)
        ids = torch.from_numpy(sample.token_ids)[None]
        grids = torch.tensor([im.grid for im in sample.images]).reshape(-1, 3)
        ours = mrope_positions(len(sample), sample.images)
        for name, model in models.items():
            if not sample.images:
                continue
            want, _ = model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), grids)
            assert np.array_equal(ours, want[:, 0].numpy()), name
            checked += 1
        # a truncated sample's positions are a prefix of the whole sample's
        cut = image_cut(sample.images, int(rng.integers(1, len(sample) + 1)))
        kept = [im for im in sample.images if im.end <= cut]
        assert np.array_equal(mrope_positions(cut, kept), ours[:, :cut])
    assert checked >= 15


def test_truncation_cuts_before_an_image_or_drops_the_sample_counted():
    rng = np.random.default_rng(1)
    a, b = png(rng, 32, 32), png(rng, 48, 48)  # 4 and 9 placeholder tokens
    samples = [
        vlm_sample(rng, [10, a, 5, b, 4], SPEC, uid="cut_in_b"),  # b spans [19, 28): cut at 19
        vlm_sample(rng, [b, 30], SPEC, uid="cut_after_b"),  # 39 tokens, cut at 24: no image split
        vlm_sample(rng, [b, 10], SPEC, prompt=0, uid="fits"),  # 19 tokens
        vlm_sample(rng, [21, a, 4], SPEC, uid="cut_in_a"),  # a spans [21, 25): cut at 21
    ]
    config = PlanConfig(seq_len=24)
    plan = prepare_batch(samples, config, dp_size=2)
    m = plan.metrics
    assert (m["truncated"], m["truncated_before_image"], m["dropped_at_image"]) == (3, 2, 0)
    assert m["truncated_tokens"] == (32 - 19) + (39 - 24) + (29 - 21)
    placed = {mb.indices[k]: s for rank in plan for mb in rank for k, s in enumerate(mb.samples)}
    assert [len(placed[i]) for i in range(4)] == [19, 24, 19, 21]
    assert [len(placed[i].images) for i in range(4)] == [1, 1, 1, 0]
    lengths = np.array([len(s) for s in samples])
    again = plan_lengths(
        lengths,
        config,
        dp_size=2,
        loss_runs=LossRuns.of_samples(samples),
        image_runs=ImageRuns.of_samples(samples),
    )
    assert again.metrics == m and [list(r) for r in again] == [
        [mb.indices for mb in r] for r in plan
    ]
    # a sample whose first image starts at 0 and straddles the cut: nothing precedes it
    lone = vlm_sample(rng, [b, 30], SPEC, uid="lone")
    plan = prepare_batch([lone], PlanConfig(seq_len=8), dp_size=1)
    assert plan.metrics["dropped_at_image"] == 1 and plan.metrics["dropped"] == 1
    # planned without the image runs, the cut would split an image: placing it refuses
    plain = plan_lengths(lengths, config, dp_size=1, loss_runs=LossRuns.of_samples(samples))
    assert plain.metrics["truncated_before_image"] == 0
    assert plain.metrics["tokens"] == int(np.minimum(lengths, 24).sum()) > m["tokens"]


def test_image_records_of_a_sample_are_checked_and_round_trip():
    rng = np.random.default_rng(2)
    img = png(rng, 32, 32)
    sample = vlm_sample(rng, [2, img, 3, img, 1], SPEC)
    back = Sample.from_json(sample.to_json())
    assert back.images == sample.images and np.array_equal(back.token_ids, sample.token_ids)
    im = sample.images[0]
    base = dict(loss_mask=sample.loss_mask, advantages=sample.advantages)
    base["inference_logprobs"] = sample.inference_logprobs
    with pytest.raises(SampleValueError, match="starts before"):
        Sample(sample.token_ids, **base, images=[im, im.shifted(2)])
    with pytest.raises(SegmentRangeError, match="outside"):
        Sample(sample.token_ids, **base, images=[im.shifted(len(sample))])
    with pytest.raises(SampleDtypeError, match="ImageSpan"):
        Sample(sample.token_ids, **base, images=[{"start": 0}])
    record = sample.to_dict()
    record["images"][0]["tokens"] = 3
    with pytest.raises(SampleDtypeError, match=r"images\[0\].*cannot stand for"):
        Sample.from_dict(record)


def test_deal_images_balances_patches_over_cp_and_is_the_same_everywhere():
    rng = np.random.default_rng(3)
    for _ in range(50):
        patches = rng.integers(1, 100, int(rng.integers(1, 9))).tolist()
        cp = int(rng.integers(1, 5))
        owner = deal_images(patches, cp)
        assert owner == deal_images(list(patches), cp) and set(owner) <= set(range(cp))
        load = np.bincount(owner, weights=patches, minlength=cp)
        assert load.max() - load.min() <= max(patches)  # largest-first greedy's bound
    assert deal_images([64, 16, 48, 16], 2) == [0, 1, 1, 0]  # 64, 48, 16 (to 1), 16 (tie: 0)


def _image_pairs(rng, n, seq_len, writers, media, shared):
    """(inline, by-handle) samples with payload fields and images: ``shared`` in about half of
    them (a group's prompt image), others their own; inline bytes vs handles."""
    inline, handle = [], []
    for i in range(n):
        T = int(rng.integers(8, 3 * seq_len))
        a, b = make_pair(rng, T, writers, f"s{i}")
        at, images_a, images_b = int(rng.integers(0, 4)), [], []
        while at < T:
            data = shared if rng.random() < 0.5 else png(rng)
            ia, ib = image_span(data, at, SPEC), image_span(data, at, SPEC, media)
            if ib.end > T:
                break
            images_a.append(ia)
            images_b.append(ib)
            at = ib.end + int(rng.integers(0, 30))
        inline.append(dataclasses.replace(a, images=images_a))
        handle.append(dataclasses.replace(b, images=images_b))
    return inline, handle


@pytest.fixture(scope="module")
def image_batches(tmp_path_factory):
    root = tmp_path_factory.mktemp("payload")
    rng = np.random.default_rng(4)
    media = MediaWriter(root)
    with PayloadWriter(root, group="a") as wa, PayloadWriter(root, group="b") as wb:
        inline, handle = _image_pairs(rng, 10, 64, [wa, wb], media, png(rng, 40, 40))
    return root, inline, handle, media


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_multimodal_micro_batches_by_handle_equal_inline_dp2(image_batches, cp_size, cp_layout):
    root, inline, handle, media = image_batches
    config = PlanConfig(seq_len=64, cp_size=cp_size, cp_layout=cp_layout)
    plan_a, plan_b = (
        prepare_batch(inline, config, dp_size=2),
        prepare_batch(handle, config, dp_size=2),
    )
    assert plan_a.metrics == plan_b.metrics and plan_b.metrics["truncated_before_image"] > 0
    seen = {"fields": set(), "shared_row": False, "images": 0}
    for ra, rb in zip(plan_a, plan_b, strict=True):
        for ma, mb in zip(ra, rb, strict=True):
            if mb.is_dummy:
                continue
            one = dataclasses.replace(mb, config=dataclasses.replace(config, cp_size=1))
            whole = to_tensor_micro_batch(one, cp_rank=0, root=root, image_processor=SPEC)
            encoded = []
            for r in range(cp_size):
                ta = to_tensor_micro_batch(ma, cp_rank=r, image_processor=SPEC)
                tb = to_tensor_micro_batch(mb, cp_rank=r, root=root, image_processor=SPEC)
                _assert_equal(ta.media, tb.media, r)
                bare = dict(media=None)
                _assert_equal(dataclasses.replace(ta, **bare), dataclasses.replace(tb, **bare), r)
                seen["fields"] |= set(tb.fields)
                _check_rank(tb, whole, ma, r)
                encoded += [u for u, o in enumerate(tb.media.image_owner.tolist()) if o == r]
            u_count = len(whole.media.image_grid_thw)
            assert sorted(encoded) == list(range(u_count))  # each distinct image once in the group
            seen["images"] += len(whole.media.image_spans)
            seen["shared_row"] |= len(whole.media.image_spans) > u_count
    assert seen["fields"] >= {"routed_experts", "sampling_mask"}
    assert seen["shared_row"] and seen["images"] > 10
    assert media.metrics["media_repeated"] > 0


def _check_rank(tmb, whole, mb, r):
    """The rank's media against the whole row's and the processor's own output (``mb``: the
    inline micro batch, whose images hold their bytes)."""
    media, row = tmb.media, whole.media
    pos = tmb.positions
    assert torch.equal(media.mrope_position_ids, row.mrope_position_ids[:, pos])
    assert torch.equal(media.image_mask, row.image_mask[pos])
    assert torch.equal(media.image_spans, row.image_spans)
    assert torch.equal(media.image_owner, row.image_owner) or tmb.cp_size > 1
    idx = ranges_index(rank_ranges(mb.cu_seqlens, r, mb.config.cp_size, mb.config.cp_layout))
    assert np.array_equal(pos.numpy(), idx)
    images = mb.images
    assert torch.equal(
        row.image_mask.nonzero().reshape(-1),
        torch.tensor([p for im in images for p in range(im.start, im.end)], dtype=torch.int64),
    )
    first = {}
    for im, (_, _, u) in zip(images, row.image_spans.tolist(), strict=True):
        first.setdefault(u, im)
    mine = [u for u, o in enumerate(media.image_owner.tolist()) if o == r]
    want = [SPEC.process(first[u].data).pixel_values for u in mine]
    dim = SPEC.patch_dim
    want = np.concatenate(want) if want else np.zeros((0, dim), np.float32)
    assert torch.equal(media.pixel_values, torch.from_numpy(want))


def test_images_need_the_rollouts_processor_and_their_own_grid(tmp_path):
    rng = np.random.default_rng(5)
    img = png(rng, 32, 32)
    sample = vlm_sample(rng, [3, img, 4], SPEC, writer=MediaWriter(tmp_path))
    (mb,) = prepare_batch([sample], PlanConfig(seq_len=32), dp_size=1)[0]
    with pytest.raises(ImageInputError, match="image processor"):
        to_tensor_micro_batch(mb, cp_rank=0, root=tmp_path)
    with pytest.raises(BatchConfigError, match="root="):
        to_tensor_micro_batch(mb, cp_rank=0, image_processor=SPEC)
    other = ImageProcessorSpec(name=SPEC.name, config={**SPEC.config, "max_pixels": 16 * 16})
    with pytest.raises(ImageInputError, match="recorded with processor settings") as err:
        to_tensor_micro_batch(mb, cp_rank=0, root=tmp_path, image_processor=other)
    assert err.value.pos == 3
    wrong = dataclasses.replace(
        sample, images=[sample.images[0].model_copy(update={"processor": None, "grid": (1, 2, 8)})]
    )
    (mb,) = prepare_batch([wrong], PlanConfig(seq_len=32), dp_size=1)[0]
    with pytest.raises(ImageInputError, match=r"\(1, 4, 4\) patch grid, its record says"):
        to_tensor_micro_batch(mb, cp_rank=0, root=tmp_path, image_processor=SPEC)
    text = vlm_sample(rng, [5], SPEC)
    (mb,) = prepare_batch([text], PlanConfig(seq_len=32), dp_size=1)[0]
    assert to_tensor_micro_batch(mb, cp_rank=0).media is None  # text only: no processor needed
