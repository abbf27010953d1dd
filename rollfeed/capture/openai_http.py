"""The HTTP side of capture through vLLM's OpenAI endpoints: requests in, records added to answers.

:func:`install_openai_capture` wraps the ASGI app of vLLM's ``POST /v1/completions`` and
``POST /v1/chat/completions`` routes and gives their handlers a
:class:`~rollfeed.capture.openai_capture.CapturingEngine`. Per request the wrapper reads the body:

- no ``rollfeed_`` key in its ``vllm_xargs``: vLLM's handler gets the very bytes that came in and
  its answer goes out as it is (a plain vLLM answer, unchanged);
- a capture request: checked (:func:`~rollfeed.capture.openai_request.parse_capture_request`;
  refused with ``{"error": {"message", "type", "param", "code"}}``, OpenAI's shape, HTTP 400 or
  422), handed to vLLM's handler with the capture's key and ``return_token_ids``, and vLLM's answer
  goes out with one more field, ``rollfeed`` (a :class:`~rollfeed.capture.TurnCapture`), after the
  payload bytes are durable. A refusal raised while the engine ran (a turn that does not extend its
  conversation, a kept set the trainer cannot replay) answers in place of vLLM's answer.

Example answer (``/v1/completions``, shortened)::

    {"id": "cmpl-...", "choices": [{"text": "...", "token_ids": [17, 4],
     "prompt_token_ids": [1, 40, 41], ...}],
     "rollfeed": {"request_id": "cmpl-...-0", "prompt_start": 0, "temperature": 1.0,
                  "completions": [{"token_ids": [17, 4], "segments": [...], ...}],
                  "group": "step_000042", "conversation": null, "sample": 0, "turn": 0,
                  "restarted": false}}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rollfeed.capture.errors import (
    CaptureError,
    CaptureModeError,
    CaptureRequestError,
    SamplingSettingsError,
)
from rollfeed.capture.openai_capture import CapturingEngine, OpenAICapture
from rollfeed.capture.openai_request import capture_xargs
from rollfeed.capture.protocol import CAPTURE_FIELD
from rollfeed.errors import RollfeedError
from rollfeed.payload import PayloadPathError

logger = logging.getLogger(__name__)

ASGI = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable]
PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
SERVING = {"completion": "openai_serving_completion", "chat": "openai_serving_chat"}


def error_status(err: RollfeedError) -> int:
    """The HTTP status of a refusal: 400 for the request's settings, engine mode, shape or group
    path; 422 for what the engine's output or a conversation cannot become; 500 for a failed
    payload write (no record is sent)."""
    bad_request = (SamplingSettingsError, CaptureModeError, CaptureRequestError, PayloadPathError)
    if isinstance(err, bad_request):
        return 400
    return 422 if isinstance(err, CaptureError) else 500


async def _send_json(send: Callable, status: int, body: Any, headers: list | None = None) -> None:
    raw = json.dumps(body).encode()
    head = [
        (k, v) for k, v in headers or () if k.lower() not in (b"content-length", b"content-type")
    ]
    head += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


def _error(err: RollfeedError) -> tuple[int, dict]:
    status = error_status(err)
    return status, {
        "error": {"message": str(err), "type": type(err).__name__, "param": None, "code": status}
    }


class _Answer:
    """vLLM's answer to a capture request, held until the records are added."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: list = []
        self.body = bytearray()

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    async def forward(self, send: Callable) -> None:
        if self.status is None:
            return  # the client went away: nothing was answered
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": bytes(self.body), "more_body": False})


async def _read_body(receive: Callable) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Callable) -> Callable[[], Awaitable[dict]]:
    """``receive`` that hands out ``body`` once, then the connection's own messages."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def capture_endpoint(original: ASGI, capture: OpenAICapture, kind: str) -> ASGI:
    """The ASGI app of one OpenAI route with capture (see module doc) around vLLM's ``original``."""

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        body = await _read_body(receive)
        if body is None:
            return
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not capture_xargs(data):  # vLLM's request: its own bytes, its own answer
            await original(scope, _replay(body, receive), send)
            return
        serving = getattr(scope["app"].state, SERVING[kind], None)
        defaults = dict(getattr(serving, "default_sampling_params", None) or {})
        try:
            key, out = capture.open(kind, data, defaults=defaults)
        except RollfeedError as err:
            await _send_json(send, *_error(err))
            return
        raw = json.dumps(out).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        answer, raised = _Answer(), None
        try:
            await original(scope, _replay(raw, receive), answer.send)
        except Exception as err:  # vLLM's handler let an engine error through
            raised = err
        finally:  # also when the request is cancelled: nothing stays pending
            pending = capture.close(key)
        if pending.error is not None:
            await _send_json(send, *_error(pending.error))
            return
        if raised is not None:
            raise raised
        if answer.status != 200:
            await answer.forward(send)  # vLLM's own refusal, or nothing (the client went away)
            return
        if pending.result is None:
            err = CaptureRequestError("vLLM answered without running the engine; no record")
            await _send_json(send, *_error(err))
            return
        payload = json.loads(bytes(answer.body))
        payload[CAPTURE_FIELD] = pending.result.model_dump(mode="json")
        await _send_json(send, 200, payload, answer.headers)

    return app


def install_openai_capture(app: Any, capture: OpenAICapture) -> list[str]:
    """Capture on ``app``'s (vLLM's) completions and chat routes; the paths it wrapped."""
    wrapped = []
    for route in app.router.routes:
        kind = PATHS.get(getattr(route, "path", ""))
        if kind is not None and "POST" in (getattr(route, "methods", None) or ()):
            route.app = capture_endpoint(route.app, capture, kind)
            wrapped.append(route.path)
    for name in SERVING.values():
        serving = getattr(app.state, name, None)
        if serving is not None:
            serving.engine_client = CapturingEngine(serving.engine_client, capture)
    logger.info("capture through the OpenAI endpoints %s", wrapped)
    return wrapped
