"""Capture through vLLM's OpenAI endpoints, with the real ``openai`` client against the session's
capture server: a request naming a group (``vllm_xargs``) records what the capture route records
for the same request and seed; a request naming none is vLLM's answer, unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from rollfeed.orchestrator import CaptureClient, OpenAIRollouts, Rollout
from tests.capture.kept import CUT, read_kept

pytestmark = pytest.mark.vllm
openai = pytest.importorskip("openai", reason="the openai client comes with vLLM")

TOP_K = 5
SAMPLING = {"top_k": TOP_K, "top_p": 0.9, "temperature": 0.8, "ignore_eos": True}
USER = "Bada kime sotu."


@pytest.fixture(scope="module")
def oai(capture_server):
    return openai.OpenAI(base_url=capture_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(capture_server):
    return CaptureClient(capture_server.url, timeout_s=300)


@pytest.fixture(scope="module")
def model(capture_server):
    return str(capture_server.model_dir)


def xargs(group, conversation=None, policy=None):
    out = {"rollfeed_group": group}
    if conversation is not None:
        out["rollfeed_conversation"] = conversation
    if policy is not None:
        out["rollfeed_policy"] = policy
    return out


def complete(oai, model, prompt, *, seed, max_tokens, extra=None, **kwargs):
    """``/v1/completions`` through the openai client; SAMPLING's vLLM keys in ``extra_body``."""
    body = {"top_k": TOP_K, "ignore_eos": True, **(extra or {})}
    return oai.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        seed=seed,
        temperature=SAMPLING["temperature"],
        top_p=SAMPLING["top_p"],
        extra_body=body,
        **kwargs,
    )


def chat(oai, model, messages, *, seed, max_tokens, thinking, extra=None):
    body = {"top_k": TOP_K, "chat_template_kwargs": {"enable_thinking": thinking}, **(extra or {})}
    return oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        seed=seed,
        temperature=SAMPLING["temperature"],
        top_p=SAMPLING["top_p"],
        extra_body=body,
    )


def same_records(root, a, b):
    """Two completion records (OpenAI path, capture route) hold the same ids, logprobs and kept
    sets, read back from the payload root."""
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.trainable == b.trainable
    assert a.new_prompt_len == b.new_prompt_len and a.finish_reason == b.finish_reason
    lo, hi = a.new_prompt_len, a.new_prompt_len + len(a.token_ids)
    kept = read_kept(a.segments, root, lo, hi, a.token_ids)
    assert kept == read_kept(b.segments, root, lo, hi, b.token_ids)
    assert all(
        y in row and 1 <= len(row) <= TOP_K for y, row in zip(a.token_ids, kept, strict=True)
    )


def same_samples(root, a, b):
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert np.array_equal(a.inference_logprobs, b.inference_logprobs)
    assert np.array_equal(a.temperatures, b.temperatures)
    T = len(a.token_ids)
    assert read_kept(a.payload, root, 0, T, a.token_ids) == read_kept(
        b.payload, root, 0, T, b.token_ids
    )


def test_without_a_group_the_answer_is_vllms_and_with_one_the_same_plus_records(
    oai, model, capture_server
):
    prompt = [1, 17, 42, 99, 5]
    kwargs = dict(seed=5, max_tokens=6, logprobs=2)
    plain = complete(oai, model, prompt, extra={"return_token_ids": True}, **kwargs).model_dump()
    assert "rollfeed" not in plain
    captured = complete(
        oai, model, prompt, extra={"vllm_xargs": xargs("t-openai-same")}, **kwargs
    ).model_dump()
    record = captured.pop("rollfeed")
    for answer in (plain, captured):
        answer.pop("id"), answer.pop("created")
        for row in answer["choices"][0]["logprobs"]["top_logprobs"]:
            # ids cut by top-k/top-p tie at -inf: which of them fill the client's top 2 is the
            # engine's arbitrary pick, with or without capture; their count is not
            cut = [t for t, v in row.items() if v == CUT]
            row["cut"] = len(cut)
            for t in cut:
                del row[t]
    # the client's own logprobs (top 2) as vLLM gives them, though the capture asked top_k + 1
    assert captured == plain
    (c,) = record["completions"]
    assert c["token_ids"] == plain["choices"][0]["token_ids"]
    assert c["logprobs"] == pytest.approx(plain["choices"][0]["logprobs"]["token_logprobs"])
    assert record["group"] == "t-openai-same" and record["temperature"] == 0.8


def test_completions_record_what_the_capture_route_records(oai, client, model, capture_server):
    root, prompt = capture_server.root, [1, 300, 7, 64]
    answer = complete(
        oai, model, prompt, seed=21, max_tokens=8, n=2, extra={"vllm_xargs": xargs("t-openai")}
    )
    sampling = dict(SAMPLING, max_tokens=8, seed=21, n=2)
    route = client.generate(prompt, group="t-openai-route", sampling=sampling)
    rollouts = OpenAIRollouts()
    for k in range(2):
        choice = answer.choices[k]
        assert choice.prompt_token_ids == prompt
        record = answer.model_dump()["rollfeed"]["completions"][k]
        assert record["token_ids"] == choice.token_ids
        rollout = rollouts.add(answer, index=k)
        alone = Rollout()
        alone.add(prompt, route, index=k)
        same_samples(root, rollout.sample(advantage=1.0), alone.sample(advantage=1.0))
    assert rollouts.metrics == {"turns": 2, "samples": 2, "restarted": 0}


def test_a_completions_conversation_stitches_like_the_route_and_restarts_when_cut(
    oai, client, model, capture_server
):
    root, rollouts = capture_server.root, OpenAIRollouts()
    route = Rollout()
    history, tools = [], [[1, 500, 501, 502], [503, 504]]
    for k, tool in enumerate(tools):
        prompt = [*history, *tool]
        answer = complete(
            oai, model, prompt, seed=40 + k, max_tokens=5, extra={"vllm_xargs": xargs("t-oc", "c1")}
        )
        record = answer.model_dump()["rollfeed"]
        assert (record["sample"], record["turn"], record["prompt_start"]) == (0, k, len(history))
        rollouts.add(answer)
        sampling = dict(SAMPLING, max_tokens=5, seed=40 + k)
        route.add(tool, client.turn(route, tool, group="t-oc-route", sampling=sampling))
        history = [*prompt, *answer.choices[0].token_ids]
    (rollout,) = rollouts.rollouts("c1")
    assert [t.length for t in rollout.turns] == [9, 7]
    same_samples(root, rollout.sample(), route.sample())
    # a turn whose prompt drops the last completion: refused before the engine runs ...
    cut = [*history[:9], 505]
    with pytest.raises(openai.UnprocessableEntityError) as err:
        complete(oai, model, cut, seed=1, max_tokens=3, extra={"vllm_xargs": xargs("t-oc", "c1")})
    assert err.value.body["type"] == "TurnPrefixError" and err.value.status_code == 422
    assert "differ from position 9 on" in err.value.body["message"]
    # ... or, under "repair", the first turn of the conversation's next sample, counted
    repair = {"vllm_xargs": xargs("t-oc", "c1", "repair")}
    answer = complete(oai, model, cut, seed=2, max_tokens=3, extra=repair)
    record = answer.model_dump()["rollfeed"]
    assert (record["sample"], record["turn"], record["prompt_start"], record["restarted"]) == (
        1,
        0,
        0,
        True,
    )
    rollouts.add(answer)
    assert [len(r.turns) for r in rollouts.rollouts("c1")] == [2, 1]
    assert rollouts.metrics["restarted"] == 1
    alone = Rollout()
    alone.add(
        cut, client.generate(cut, group="t-oc-route", sampling=dict(SAMPLING, max_tokens=3, seed=2))
    )
    same_samples(root, rollouts.rollouts("c1")[1].sample(), alone.sample())


def extending_seed(oai, model, messages, follow_up) -> tuple[int, list[int]]:
    """A seed whose completion, sent back as the assistant's text, renders token for token as
    sampled (a tiny random model's text does not always tokenize back the same), found with
    plain vLLM calls; and the second turn's prompt ids."""
    for seed in range(40):
        first = chat(
            oai,
            model,
            messages,
            seed=seed,
            max_tokens=4,
            thinking=False,
            extra={"return_token_ids": True},
        )
        sent = [*first.prompt_token_ids, *first.choices[0].token_ids]
        turn = [
            *messages,
            {"role": "assistant", "content": first.choices[0].message.content},
            follow_up,
        ]
        second = chat(
            oai,
            model,
            turn,
            seed=seed,
            max_tokens=1,
            thinking=False,
            extra={"return_token_ids": True},
        )
        if second.prompt_token_ids[: len(sent)] == sent:
            return seed, second.prompt_token_ids
    raise AssertionError("no seed of 40 gave a completion that tokenizes back as sampled")


def test_a_chat_conversation_stitches_and_a_template_that_drops_reasoning_restarts(
    oai, client, model, capture_server
):
    root = capture_server.root
    messages = [{"role": "user", "content": USER}]
    follow_up = {"role": "user", "content": "Ro zuvo."}
    seed, _ = extending_seed(oai, model, messages, follow_up)
    rollouts, route = OpenAIRollouts(), Rollout()
    group = {"vllm_xargs": xargs("t-chat", "chat-1")}
    first = chat(oai, model, messages, seed=seed, max_tokens=4, thinking=False, extra=group)
    turn = [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        follow_up,
    ]
    second = chat(oai, model, turn, seed=seed + 100, max_tokens=4, thinking=False, extra=group)
    for answer, answer_seed in ((first, seed), (second, seed + 100)):
        rollouts.add(answer)
        sampling = dict(SAMPLING, max_tokens=4, seed=answer_seed)
        sampling.pop("ignore_eos")
        new = answer.prompt_token_ids[len(route.token_ids) :]
        route.add(new, client.turn(route, new, group="t-chat-route", sampling=sampling))
    (rollout,) = rollouts.rollouts("chat-1")
    assert len(rollout.turns) == 2 and second.model_dump()["rollfeed"]["prompt_start"] == len(
        [*first.prompt_token_ids, *first.choices[0].token_ids]
    )
    same_samples(root, rollout.sample(), route.sample())
    # Qwen3's way: the generation prompt opens <think>, the next render drops it
    think = {"vllm_xargs": xargs("t-chat", "chat-2")}
    first = chat(oai, model, messages, seed=3, max_tokens=4, thinking=True, extra=think)
    turn = [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        follow_up,
    ]
    with pytest.raises(openai.UnprocessableEntityError, match="does not extend"):
        chat(oai, model, turn, seed=4, max_tokens=4, thinking=True, extra=think)
    think["vllm_xargs"]["rollfeed_policy"] = "repair"
    again = chat(oai, model, turn, seed=4, max_tokens=4, thinking=True, extra=think)
    rollouts.add(first), rollouts.add(again)
    assert [len(r.turns) for r in rollouts.rollouts("chat-2")] == [1, 1]
    assert again.model_dump()["rollfeed"]["restarted"] is True


@pytest.mark.parametrize(
    ("extra", "error", "named"),
    [
        ({"temperature": 0.005}, "BadRequestError", "below vLLM's floor 0.01"),
        ({"temperature": 0.0}, "BadRequestError", "temperature=0.0: greedy"),
        ({"top_k": None}, "BadRequestError", "capture needs top_k >= 2"),
        ({"stream": True}, "BadRequestError", "stream is set"),
        ({"presence_penalty": 0.5}, "BadRequestError", "presence_penalty=0.5"),
        ({"top_k": 40}, "BadRequestError", "--max-logprobs 41"),
    ],
)
def test_capture_refusals_are_openai_errors_naming_the_reason(oai, model, extra, error, named):
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "top_k": TOP_K, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(getattr(openai, error)) as err:
        oai.post("/completions", cast_to=object, body={**body, "vllm_xargs": xargs("t-refused")})
    assert named in str(err.value)
    if "stream" not in extra and "top_k" not in extra:  # vLLM alone serves it, as vLLM does
        assert oai.post("/completions", cast_to=object, body=body)["choices"]
