"""Capture shell: written segments read back as the trainer reads them; HF routing; multi-turn."""

import math

import numpy as np
import pytest
import torch

from rollfeed.capture import (
    CaptureConfig,
    CaptureError,
    LogprobRows,
    RoutingShapeError,
    SamplingSettingsError,
    Turn,
    assemble_turns,
    capture_completion,
    support_from_logprob_rows,
)
from rollfeed.collate import Sample
from rollfeed.payload import PayloadWriter, read_field, read_fields

INF = math.inf


def processed_rows(rng, completion, top_k, vocab=64):
    """Processed-logprob rows as vLLM returns them: top_k + 1 entries, filtered ones -inf."""
    dicts = []
    for y in completion:
        others = [int(t) for t in rng.permutation(vocab) if t != y][:top_k]
        n_kept = int(rng.integers(1, top_k + 1))
        kept = [int(y), *others[: n_kept - 1]]
        lps = np.log(rng.dirichlet(np.ones(n_kept)))
        row = dict(zip(kept, lps.tolist(), strict=True))
        row.update({t: -INF for t in others[n_kept - 1 :]})
        dicts.append(row)
    return dicts


def test_round_trip_through_the_payload(tmp_path):
    rng = np.random.default_rng(0)
    prompt, completion = rng.integers(0, 64, 7), rng.integers(0, 64, 11)
    dicts = processed_rows(rng, completion, top_k=4)
    config = CaptureConfig(top_k=4)
    with PayloadWriter(tmp_path, group="step_000001") as writer:
        got = capture_completion(
            writer,
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=LogprobRows.from_dicts(dicts),
            config=config,
        )
    T = 18
    assert got.length == T and got.new_prompt_len == 7
    assert got.token_ids.tolist() == [*prompt.tolist(), *completion.tolist()]
    assert got.loss_mask.tolist() == [False] * 7 + [True] * 11
    want_lp = [dicts[i][int(y)] for i, y in enumerate(completion)]
    np.testing.assert_allclose(got.inference_logprobs[7:], want_lp, rtol=1e-6)
    assert not got.inference_logprobs[:7].any()
    assert {s.field for s in got.segments} == {"sampling_mask", "sampling_mask_logprobs"}
    assert all(s.pos == 7 and s.rows == 11 for s in got.segments)
    # The trainer reads masks over the labels window: row j holds token j + 1's kept set.
    mask = read_field(got.segments, "sampling_mask", (1, T + 1), root=tmp_path).padded()
    mask_lp = read_field(got.segments, "sampling_mask_logprobs", (0, T), root=tmp_path).padded(
        fill=-INF
    )
    for i, row in enumerate(dicts):
        kept = sorted(t for t, lp in row.items() if lp > -INF)
        y = int(completion[i])  # the label: stored rows omit it, column 0 is its place
        assert mask[6 + i][0] == -1 and y in kept  # the label is in its support
        ids = mask[6 + i][mask[6 + i] >= 0].tolist()
        assert ids == [t for t in kept if t != y]
        canonical = [y, *ids]  # the sampled token first, then the others ascending
        np.testing.assert_allclose(
            mask_lp[7 + i][: len(kept)].numpy(), [row[t] for t in canonical], rtol=1e-6
        )
    assert (mask[:6] == -1).all() and (mask[T - 1] == -1).all()
    sample = Sample(
        token_ids=got.token_ids,
        loss_mask=got.loss_mask,
        advantages=np.ones(T, np.float32),
        inference_logprobs=got.inference_logprobs,
        payload=got.segments,
    )
    assert Sample.from_json(sample.to_json()).payload == sample.payload


def test_config_refuses_unbounded_top_k():
    for top_k in (None, 0, 1, -1):
        with pytest.raises(SamplingSettingsError, match="top_k >= 2"):
            CaptureConfig(top_k=top_k)
    with pytest.raises(CaptureError, match="extra_logprobs"):
        CaptureConfig(top_k=4, extra_logprobs=0)
    with pytest.raises(CaptureError, match="policy"):
        CaptureConfig(top_k=4, policy="skip")
    assert CaptureConfig(top_k=4).requested == 5
    assert CaptureConfig(top_k=4, num_experts=512).writer_dtypes == {"routed_experts": "uint16"}


def tiny_moe():
    from rollfeed.demo.tiny_model import tiny_moe_model

    return tiny_moe_model(seed=3, vocab_size=96)


def test_routing_from_an_hf_forward_reads_back_at_input_positions(tmp_path):
    from rollfeed.demo.tiny_model import hf_routing

    model = tiny_moe()
    rng = np.random.default_rng(1)
    prompt, completion = rng.integers(0, 96, 6), rng.integers(0, 96, 5)
    tokens = np.concatenate([prompt, completion])
    routing = hf_routing(model, tokens)  # [T, layers, top_k]
    assert routing.shape == (11, 2, 2)
    config = CaptureConfig(top_k=3, num_experts=8)
    with PayloadWriter(tmp_path, group="s", dtypes=config.writer_dtypes) as writer:
        with pytest.raises(RoutingShapeError, match="never forwarded"):
            capture_completion(
                writer,
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=LogprobRows.from_dicts(processed_rows(rng, completion, 3)),
                config=config,
                routed_experts=routing,  # one row too many: the final token was not forwarded
            )
        got = capture_completion(
            writer,
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=LogprobRows.from_dicts(processed_rows(rng, completion, 3)),
            config=config,
            routed_experts=routing[:-1],
        )
    seg = next(s for s in got.segments if s.field == "routed_experts")
    assert (seg.pos, seg.rows, seg.dtype, seg.shape) == (0, 10, "uint8", (2, 2))
    back = read_field(got.segments, "routed_experts", (0, 11), root=tmp_path)
    assert back.dtype == torch.uint8
    assert np.array_equal(back[:10].numpy(), routing[:10]) and not back[10].any()
    assert got.metrics["routed_rows"] == 10


def test_multi_turn_prompt_start_deltas_stitch_into_the_full_routing(tmp_path):
    from rollfeed.demo.tiny_model import hf_routing

    model = tiny_moe()
    rng = np.random.default_rng(2)
    p1, c1 = rng.integers(0, 96, 5), rng.integers(0, 96, 4)
    u2, c2 = rng.integers(0, 96, 3), rng.integers(0, 96, 6)
    full = np.concatenate([p1, c1, u2, c2])  # 18 tokens
    routing = hf_routing(model, full)  # causal: a prefix routes the same alone or in full
    assert np.array_equal(hf_routing(model, full[:9])[:8], routing[:8])
    config = CaptureConfig(top_k=3, num_experts=8, policy="repair")
    turns, inference = [], []
    with PayloadWriter(tmp_path, group="s") as writer:
        for prompt, completion, start in (
            (p1, c1, 0),
            (np.concatenate([p1, c1, u2]), c2, 9),
        ):
            end = prompt.size + completion.size - 1  # the engine's rows stop before the last token
            got = capture_completion(
                writer,
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=LogprobRows.from_dicts(processed_rows(rng, completion, 3)),
                config=config,
                routed_experts=routing[start:end],  # routed_experts_prompt_start=start
                prompt_start=start,
            )
            turns.append(Turn(length=got.length, segments=got.segments))
            inference.append(got)
    assert [t.length for t in turns] == [9, 9] and inference[1].new_prompt_len == 3
    segments, metrics = assemble_turns(turns, final_token="fill")
    assert metrics["final_filled"] == 2 and metrics["gaps"] == 0
    back = read_field(segments, "routed_experts", (0, 18), root=tmp_path).numpy()
    forwarded = np.ones(18, bool)
    forwarded[[8, 17]] = False  # each turn's final sampled token
    assert np.array_equal(back[forwarded], routing[forwarded])
    assert not back[~forwarded].any()
    got = read_fields(segments, {"sampling_mask": (0, 18)}, root=tmp_path)["sampling_mask"]
    mask, covered = got.values.padded(), got.coverage.numpy()
    sampled_at = np.r_[5:9, 12:18]
    assert covered[sampled_at].all() and not np.delete(covered, sampled_at).any()
    assert (mask[np.setdiff1d(np.arange(18), sampled_at)] == -1).all()
    for pos in sampled_at:  # stored without the sampled token (the label), column 0 its place
        assert mask[pos][0] == -1 and int(full[pos]) not in mask[pos].tolist()


def test_wide_expert_ids_need_one_writer_dtype(tmp_path):
    config = CaptureConfig(top_k=2, num_experts=300)
    completion = np.array([4, 5])
    rows = LogprobRows.from_dicts([{4: 0.0, 9: -INF, 8: -INF}, {5: 0.0, 1: -INF, 2: -INF}])
    routed = np.full((3, 1, 2), 7)  # ids < 256 in this request, but the model has 300 experts
    with (
        PayloadWriter(tmp_path, name="plain") as writer,
        pytest.raises(CaptureError, match="dtypes"),
    ):
        capture_completion(
            writer,
            prompt_ids=[1, 2],
            completion_ids=completion,
            logprobs=rows,
            config=config,
            routed_experts=routed,
        )
    with PayloadWriter(tmp_path, name="wide", dtypes=config.writer_dtypes) as writer:
        got = capture_completion(
            writer,
            prompt_ids=[1, 2],
            completion_ids=completion,
            logprobs=rows,
            config=config,
            routed_experts=routed,
        )
    assert next(s for s in got.segments if s.field == "routed_experts").dtype == "uint16"


def test_repair_takes_tokens_out_of_the_loss(tmp_path):
    rows = LogprobRows.from_dicts(
        [{4: -0.1, 9: -2.4, 8: -INF}, {5: -0.3, 1: -1.5, 2: -2.0}, {6: -INF, 7: 0.0, 3: -INF}]
    )
    completion = [4, 5, 6]  # row 1 is a bound row, row 2 sampled an id outside its kept set
    config = CaptureConfig(top_k=2, policy="repair")
    with PayloadWriter(tmp_path, name="r") as writer:
        got = capture_completion(
            writer, prompt_ids=[1], completion_ids=completion, logprobs=rows, config=config
        )
    assert got.loss_mask.tolist() == [False, True, False, False]
    assert got.metrics["rows_repaired"] == 2 and got.metrics["rows_bound"] == 1
    np.testing.assert_allclose(got.inference_logprobs, [0.0, -0.1, -0.3, 0.0], rtol=1e-6)
    ref = support_from_logprob_rows(rows, completion, requested=3, policy="repair")
    mask = read_field(got.segments, "sampling_mask", (1, 4), root=tmp_path).padded()
    for i in range(3):  # stored rows omit the sampled token (the label)
        assert (
            sorted([completion[i], *mask[i][mask[i] >= 0].tolist()])
            == ref.ids[ref.counts[:i].sum() :][: ref.counts[i]].tolist()
        )
    assert 6 in ref.ids[ref.counts[:2].sum() :][: ref.counts[2]].tolist()  # added by the repair
