"""vLLM adapter on vLLM-shaped objects (no engine): refused settings, flat logprobs, outputs."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from rollfeed.capture import (
    CaptureConfig,
    CaptureError,
    CaptureModeError,
    LogprobRows,
    SamplingSettingsError,
    SupportMembershipError,
    capture_request_output,
    check_engine,
    check_sampling_params,
    engine_version_spans,
    logprob_rows,
)
from rollfeed.payload import PayloadError, PayloadWriter, read_field

INF = math.inf


def params(**overrides):
    """The fields of vllm.SamplingParams the checks read, at vLLM's defaults, top_k set."""
    base = dict(
        temperature=1.0,
        top_k=4,
        top_p=0.9,
        min_p=0.0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        logit_bias=None,
        watermarking=None,
        trace_decode_token_ids=None,
        logprobs=5,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def test_replayable_settings_pass():
    check_sampling_params(params(), CaptureConfig(top_k=4))
    check_sampling_params(params(top_p=1.0, min_p=0.05, temperature=0.7), CaptureConfig(top_k=4))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_k": 1}, "top_k=1"),
        ({"top_k": None}, "top_k=None"),
        ({"temperature": 0.0}, "greedy"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"frequency_penalty": 0.5}, "frequency_penalty=0.5"),
        ({"presence_penalty": -0.2}, "presence_penalty=-0.2"),
        ({"logit_bias": {5: 2.0}}, "logit_bias"),
        ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors"),
        ({"watermarking": True}, "watermarking"),
        ({"logprobs": 4}, "logprobs=4"),
        ({"logprobs": None}, "logprobs=None"),
        ({"top_k": 8, "logprobs": 9}, "differs"),
    ],
)
def test_unreplayable_settings_are_refused(override, named):
    with pytest.raises(SamplingSettingsError) as err:
        check_sampling_params(params(**override), CaptureConfig(top_k=4))
    assert named in str(err.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(SamplingSettingsError) as err:
        check_sampling_params(params(temperature=0.0, presence_penalty=1.0, logit_bias={1: 1.0}))
    assert str(err.value).count(";") == 2


def engine(**model_config):
    base = dict(logprobs_mode="processed_logprobs", max_logprobs=20, logits_processors=None)
    base.update(model_config)
    return SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(**base)))


def test_engine_checks():
    config = CaptureConfig(top_k=4)
    check_engine(engine(), config)
    for bad, named in (
        ({"logprobs_mode": "raw_logprobs"}, "processed_logprobs"),
        ({"max_logprobs": 4}, "start the server with --max-logprobs 5 or more"),
        ({"logits_processors": ["my.Processor"]}, "logits processors"),
    ):
        with pytest.raises(CaptureModeError, match=named):
            check_engine(engine(**bad), config)


def flat(dicts):
    """A FlatLogprobs-shaped object (vLLM's flat_logprobs=True output)."""
    starts, ends, ids, lps = [], [], [], []
    for row in dicts:
        starts.append(len(ids))
        ids += list(row)
        lps += list(row.values())
        ends.append(len(ids))
    return SimpleNamespace(start_indices=starts, end_indices=ends, token_ids=ids, logprobs=lps)


def test_flat_and_dict_logprobs_agree():
    dicts = [{3: -0.2, 5: -1.7, 1: -INF}, {}, {9: 0.0, 2: -INF, 4: -INF}]
    a, b = logprob_rows(flat(dicts)), logprob_rows(dicts)
    assert isinstance(a, LogprobRows)
    for name in ("offsets", "token_ids", "logprobs"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert a.offsets.tolist() == [0, 3, 3, 6]
    with pytest.raises(CaptureError, match="no logprobs"):
        logprob_rows(None)


def test_request_output_with_two_completions(tmp_path):
    completions = [
        SimpleNamespace(
            token_ids=[7, 8],
            logprobs=[{7: -0.1, 2: -2.4, 3: -INF}, {8: 0.0, 4: -INF, 5: -INF}],
            routed_experts=None,
            sampling_mask=None,
        ),
        SimpleNamespace(
            token_ids=[9],
            logprobs=flat([{9: -0.6, 6: -0.8, 3: -INF}]),
            routed_experts=np.array([[[1, 2]], [[3, 0]], [[2, 1]]]),  # prompt 3 + 1 - 1 rows
            sampling_mask=SimpleNamespace(token_ids=[[6, 9]]),
        ),
    ]
    out = SimpleNamespace(finished=True, prompt_token_ids=[1, 2, 3], outputs=completions)
    config = CaptureConfig(top_k=2, num_experts=4)
    with PayloadWriter(tmp_path, group="step_000001") as writer:
        got = capture_request_output(writer, out, config)
    assert [g.token_ids.tolist() for g in got] == [[1, 2, 3, 7, 8], [1, 2, 3, 9]]
    assert "routed_experts" not in {s.field for s in got[0].segments}
    routed = read_field(got[1].segments, "routed_experts", (0, 4), root=tmp_path)
    assert routed[:3].tolist() == [[[1, 2]], [[3, 0]], [[2, 1]]] and not routed[3].any()
    mask = read_field(got[1].segments, "sampling_mask", (3, 4), root=tmp_path)
    # {6, 9} without the sampled 9 (the label: its slot first, at -1 without labels=)
    assert mask.offsets.tolist() == [0, 2] and mask.values.tolist() == [-1, 6]
    np.testing.assert_allclose(got[1].inference_logprobs, [0, 0, 0, -0.6], rtol=1e-6)
    with pytest.raises(CaptureError, match="finished"):
        capture_request_output(writer, SimpleNamespace(finished=False), config)


def test_a_capture_error_names_request_completion_and_token(tmp_path):
    good = SimpleNamespace(index=0, token_ids=[7], logprobs=[{7: -0.1, 2: -2.4, 3: -INF}])
    bad = SimpleNamespace(  # token 1 sampled 5, which its finite entries do not hold
        index=1, token_ids=[7, 5], logprobs=[{7: 0.0, 4: -INF, 1: -INF}, {6: 0.0, 5: -INF, 2: -INF}]
    )
    out = SimpleNamespace(
        request_id="cmpl-3", finished=True, prompt_token_ids=[1, 2], outputs=[good, bad]
    )
    with (
        PayloadWriter(tmp_path, group="step_000001") as writer,
        pytest.raises(SupportMembershipError) as err,
    ):
        capture_request_output(writer, out, CaptureConfig(top_k=2))
    assert err.value.place == {
        "request": "cmpl-3",
        "completion": 1,
        "turn": None,
        "token": 1,
        "field": None,
        "pos": None,
    }
    assert "[request=cmpl-3, completion=1, token=1]" in str(err.value)
    assert not isinstance(err.value, PayloadError)  # the engine's output is wrong, not a payload


def _spans(*rows):
    return [SimpleNamespace(start=a, end=b, version=v) for a, b, v in rows]


def test_engine_version_spans_merge_runs_and_an_engine_never_versioned_gives_none():
    assert engine_version_spans(_spans((0, 3, "4"), (3, 5, "4"), (5, 9, "5")), 9).tolist() == [
        [0, 5, 4],
        [5, 9, 5],
    ]
    for unlabelled in (None, _spans((0, 9, "default"))):  # rollout code that never sets one
        assert engine_version_spans(unlabelled, 9).shape == (0, 3)
    bad = [
        (_spans((0, 4, "default"), (4, 9, "5")), "weight version 'default'"),
        (_spans((0, 9, "v5")), "weight version 'v5'"),
        (_spans((0, 4, "5"), (5, 9, "6")), "a span \\[5, 9\\) where one from 4"),
        (_spans((0, 8, "5")), "end at token 8 of the completion's 9"),
    ]
    for spans, why in bad:
        with pytest.raises(CaptureError, match=why):
            engine_version_spans(spans, 9)
