"""Capture behind vLLM's OpenAI endpoints: the engine client their handlers call, wrapped.

vLLM's ``/v1/completions`` and ``/v1/chat/completions`` handlers render the prompt (the chat
template), build ``SamplingParams`` and call ``engine_client.generate``. :class:`CapturingEngine`
stands in for that engine client: a call whose params carry a pending capture's key
(:data:`~rollfeed.capture.openai_request.XARG_KEY`, set by the HTTP layer,
:mod:`rollfeed.capture.openai_http`) runs through :meth:`OpenAICapture.generate`; any other call
is the engine's own generator, untouched.

:meth:`OpenAICapture.generate`, for one turn:

1. places the turn in its conversation (:class:`~rollfeed.capture.conversations.Conversations`;
   a prompt that does not extend the last turn is refused or starts a new sample);
2. refuses params that differ from what was asked, or that the trainer cannot replay, and an
   engine that cannot return the logprobs (as the capture route does);
3. runs the engine with ``top_k + 1`` logprobs per token (or more, when the client asked more)
   and ``routed_experts_prompt_start`` at the turn's start, captures the final output with the
   capture route's writers (the same records the custom route writes for the same request);
4. hands vLLM's handler the output with the logprobs the client asked for (none, or its top
   ``n``, as the engine would have returned them), so the answer is vLLM's own.

The records wait under the key until the HTTP layer adds them to the answer
(:meth:`OpenAICapture.close`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from rollfeed.capture.conversations import Conversations, TurnPlace
from rollfeed.capture.errors import CaptureError, CaptureRequestError
from rollfeed.capture.images import encoded
from rollfeed.capture.openai_request import XARG_KEY, CaptureAsk, parse_capture_request
from rollfeed.capture.protocol import TurnCapture
from rollfeed.capture.route import CaptureRoute
from rollfeed.capture.settings import check_unchanged
from rollfeed.capture.vllm_adapter import check_engine, check_sampling_params
from rollfeed.errors import RollfeedError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class _Pending:
    """One request's capture, from its parse to its answer (mutable: filled by the engine call)."""

    ask: CaptureAsk
    started: bool = False
    result: TurnCapture | None = None
    error: RollfeedError | None = None


def engine_logprobs(user: int | None, requested: int) -> int:
    """Logprobs per token the engine returns for capture: ``requested``, or the client's own
    count when it asked more (``-1``: the whole vocabulary)."""
    if user is not None and (user == -1 or user > requested):
        return user
    return requested


def client_view(output: Any, user: int | None) -> Any:
    """``output`` as the engine returns it for ``logprobs=user``: the capture's extra entries off.

    Per token the engine returns the sampled id and the ids of rank 1..n; the capture's output
    holds ranks up to ``top_k + 1``, so the client's view keeps the sampled id and ranks <= n.
    """
    outputs = []
    for completion in output.outputs:
        rows = completion.logprobs
        if user is None:
            rows = None
        elif user != -1 and rows is not None:
            rows = [
                None
                if row is None
                else {t: lp for t, lp in row.items() if t == y or (lp.rank or 0) <= user}
                for row, y in zip(rows, completion.token_ids, strict=True)
            ]
        outputs.append(dataclasses.replace(completion, logprobs=rows))
    view = copy.copy(output)
    view.outputs = outputs
    return view


def capture_params(ask: CaptureAsk, params: Any, *, prompt_start: int) -> Any:
    """The ``SamplingParams`` the engine runs a capture request with: vLLM handler's ``params``
    with the capture's logprobs and turn start, refused when they differ from what was asked or
    the trainer cannot replay them.

    Example: asked ``{"temperature": 0.7, "top_k": 20}``, the client asked no logprobs ->
    ``params`` at temperature 0.7, top_k 20, ``logprobs=21``, ``routed_experts_prompt_start``.
    """
    check_unchanged(ask.asked, params)
    run = params.clone()
    extra = {k: v for k, v in (params.extra_args or {}).items() if k != XARG_KEY}
    run.extra_args = extra or None
    run.logprobs = engine_logprobs(ask.user_logprobs, ask.config.requested)
    run.routed_experts_prompt_start = prompt_start
    check_sampling_params(run, ask.config)
    return run


class OpenAICapture:
    """Pending captures of the OpenAI endpoints, the conversations, and the route's writers."""

    def __init__(self, route: CaptureRoute, *, conversations: Conversations | None = None) -> None:
        self.route = route
        self.conversations = conversations or Conversations()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def open(
        self, kind: Any, body: dict[str, Any], *, defaults: dict[str, Any]
    ) -> tuple[str, dict]:
        """Check a capture request (refused: a typed error); its key and the body vLLM gets."""
        key = uuid.uuid4().hex
        ask, out = parse_capture_request(
            kind, body, defaults=defaults, num_experts=self.route.num_experts, key=key
        )
        check_engine(self.route.engine, ask.config)
        with self._lock:
            self._pending[key] = _Pending(ask=ask)
        return key, out

    def close(self, key: str) -> _Pending:
        """The request's capture, forgotten here."""
        with self._lock:
            return self._pending.pop(key)

    def _take(self, key: Any) -> _Pending:
        with self._lock:
            pending = self._pending.get(key) if isinstance(key, str) else None
            if pending is None:
                raise CaptureRequestError(
                    f"vllm_xargs {XARG_KEY}={key!r} names no pending capture; the server sets "
                    "it, a client names its group with rollfeed_group"
                )
            if pending.started:
                raise CaptureRequestError("a capture request runs one prompt; it sent several")
            pending.started = True
            return pending

    async def generate(
        self, engine: Any, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """The engine's generation of one capture request, captured (see module doc)."""
        pending = self._take((params.extra_args or {}).get(XARG_KEY))
        ask = pending.ask
        try:
            ids = _prompt_ids(engine, prompt)
            if ask.conversation is None:
                place = TurnPlace()
            else:
                place = self.conversations.begin(ask.conversation, ids, policy=ask.policy)
            try:
                output = await self._run(
                    engine, ask, place, prompt, params, request_id, args, kwargs
                )
                completion = list(output.outputs[0].token_ids)
                response = await asyncio.to_thread(  # an fsync never stalls the event loop
                    self.route.capture_output,
                    ask.group,
                    output,
                    ask.config,
                    prompt_start=place.prompt_start,
                    temperature=params.temperature,
                    images=_prompt_images(prompt),
                )
                pending.result = TurnCapture(
                    **dict(response),
                    group=ask.group,
                    conversation=ask.conversation,
                    sample=place.sample,
                    turn=place.turn,
                    restarted=place.restarted,
                )
            except BaseException:
                if ask.conversation is not None:
                    self.conversations.abort(ask.conversation)
                raise
            if ask.conversation is not None:
                self.conversations.finish(ask.conversation, place, [*ids, *completion])
        except RollfeedError as err:  # the HTTP layer answers it, typed, in place of vLLM's answer
            pending.error = err
            raise
        yield client_view(output, ask.user_logprobs)

    async def _run(
        self,
        engine: Any,
        ask: CaptureAsk,
        place: TurnPlace,
        prompt: Any,
        params: Any,
        request_id: str,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        run = capture_params(ask, params, prompt_start=place.prompt_start)
        check_engine(engine, ask.config)
        self.route.acquire(ask.group)  # a group name that leaves the root is refused here
        try:
            final = None
            async for output in engine.generate(prompt, run, request_id, *args, **kwargs):
                final = output
        finally:
            self.route.release(ask.group)
        if final is None or not final.finished:
            raise CaptureError(
                "the engine ended the request without a finished output", request=request_id
            )
        return final


def _prompt_ids(engine: Any, prompt: Any) -> Sequence[int]:
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    ids = extract_prompt_components(engine.model_config, prompt).token_ids
    if ids is None:
        raise CaptureRequestError("a capture request needs a prompt of tokens (no embeddings)")
    return list(ids)


def _prompt_images(prompt: Any) -> list[bytes]:
    """The images vLLM's handler loaded for the prompt (``multi_modal_data``), as stored bytes."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    images = (data or {}).get("image") or []
    return [encoded(im) for im in (images if isinstance(images, list) else [images])]


class CapturingEngine:
    """vLLM's engine client, with capture for the calls that carry a pending capture's key."""

    def __init__(self, engine: Any, capture: OpenAICapture) -> None:
        self._engine, self._capture = engine, capture

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(params, "extra_args", None)
        if not extra or XARG_KEY not in extra:
            return self._engine.generate(prompt, params, request_id, *args, **kwargs)
        return self._capture.generate(self._engine, prompt, params, request_id, *args, **kwargs)
