"""What a request to vLLM's OpenAI endpoints asks of the capture: its keys, settings and shape.

A request to ``/v1/completions`` or ``/v1/chat/completions`` asks for capture when its
``vllm_xargs`` (the OpenAI client's ``extra_body={"vllm_xargs": {...}}``) hold
``rollfeed_group`` (the payload group, as the capture route's ``group``), optionally
``rollfeed_conversation`` (turns of one conversation stitch into one sample, see
:mod:`rollfeed.capture.conversations`) and ``rollfeed_policy`` (``"error"``, the default, or
``"repair"``). A request without a ``rollfeed_`` key is vLLM's, untouched.

:func:`parse_capture_request` checks such a request before vLLM sees it, with vLLM's own request
model and merge of the server's defaults (the model's generation config), and refuses what the
capture cannot serve (:class:`CaptureRequestError`: streaming, beam search, several prompts,
``n > 1`` in a conversation, ``logprob_token_ids``, ``routed_experts_prompt_start``) or the trainer
cannot replay (:class:`SamplingSettingsError`: the custom route's rules, a temperature vLLM would
change). It returns the :class:`CaptureAsk` and the body vLLM gets: the ``rollfeed_`` keys
replaced by one key naming the pending capture (:data:`XARG_KEY`), ``return_token_ids`` on.

Example: ``{"model": "m", "prompt": [1, 40, 41], "max_tokens": 8, "top_k": 20,
"vllm_xargs": {"rollfeed_group": "step_000042"}}`` -> ``CaptureAsk(kind="completion",
group="step_000042", conversation=None, policy="error", config=CaptureConfig(top_k=20), ...)``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from rollfeed.capture.config import CaptureConfig
from rollfeed.capture.errors import CaptureRequestError, SamplingSettingsError
from rollfeed.capture.kept_set import POLICIES, Policy
from rollfeed.capture.protocol import (
    XARG_CONVERSATION,
    XARG_GROUP,
    XARG_POLICY,
    XARG_PREFIX,
    XARGS,
    check_group,
)
from rollfeed.capture.settings import SAMPLED, check_requested, check_unchanged
from rollfeed.capture.vllm_adapter import check_sampling_params

Kind = Literal["completion", "chat"]
XARG_KEY = "rollfeed_key"  # set by the server only: which pending capture a request belongs to
_SHAPE = {  # a body field the capture refuses when set, and why
    "stream": "streaming: the records come with the whole answer; send stream=false",
    "use_beam_search": "beam search: its beams are not samples of the policy",
    "logprob_token_ids": "logprob_token_ids: the capture asks the engine for the top logprobs",
    "routed_experts_prompt_start": "routed_experts_prompt_start: the capture sets it per turn",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureAsk:
    """What one request asks of the capture. asked: the sampled settings (of
    :data:`~rollfeed.capture.settings.SAMPLED`) the request or the server's defaults set, as vLLM
    takes them. user_logprobs: the logprobs per token the client asked for itself (None: none)."""

    kind: Kind
    group: str
    conversation: str | None
    policy: Policy
    config: CaptureConfig
    asked: dict[str, Any]
    user_logprobs: int | None


def capture_xargs(body: Any) -> dict[str, Any]:
    """The ``rollfeed_`` keys of ``body``'s ``vllm_xargs``; empty for a request vLLM serves
    alone."""
    xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
    if not isinstance(xargs, dict):
        return {}
    return {k: v for k, v in xargs.items() if isinstance(k, str) and k.startswith(XARG_PREFIX)}


def _request_class(kind: Kind) -> Any:
    if kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


def _keys(ours: dict[str, Any]) -> tuple[str, str | None, Policy]:
    unknown = sorted(set(ours) - set(XARGS))
    if unknown:
        raise CaptureRequestError(f"vllm_xargs holds {unknown}; the capture's keys are {XARGS}")
    group = ours.get(XARG_GROUP)
    if not isinstance(group, str):
        raise CaptureRequestError(
            f"vllm_xargs {XARG_GROUP}={group!r}: a request asking for capture names its group"
        )
    try:
        check_group(group)
    except ValueError as err:
        raise CaptureRequestError(f"vllm_xargs {XARG_GROUP}: {err}") from None
    conversation = ours.get(XARG_CONVERSATION)
    if conversation is not None and (not isinstance(conversation, str) or not conversation):
        raise CaptureRequestError(
            f"vllm_xargs {XARG_CONVERSATION}={conversation!r}: a conversation id is a "
            "non-empty string"
        )
    policy = ours.get(XARG_POLICY, "error")
    if policy not in POLICIES:
        raise CaptureRequestError(f"vllm_xargs {XARG_POLICY}={policy!r}: one of {POLICIES}")
    return group, conversation, policy


def _check_shape(kind: Kind, body: dict[str, Any], conversation: str | None) -> None:
    for name, why in _SHAPE.items():
        if body.get(name):
            raise CaptureRequestError(f"{name} is set; a capture request cannot use {why}")
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1
    if several and all(isinstance(p, list | str) for p in prompt):
        raise CaptureRequestError(
            f"prompt holds {len(prompt)} prompts; a capture request sends one (several "
            "prompts are several requests)"
        )
    n = body.get("n")
    if conversation is not None and n not in (None, 1):
        raise CaptureRequestError(
            f"n={n!r} in conversation {conversation!r}: a conversation continues one completion; "
            "sample n > 1 without a conversation id"
        )


def parse_capture_request(
    kind: Kind,
    body: dict[str, Any],
    *,
    defaults: dict[str, Any],
    num_experts: int | None,
    key: str,
) -> tuple[CaptureAsk, dict[str, Any]]:
    """``(ask, body for vLLM)`` of a request that holds capture keys (see module doc).

    ``defaults``: the server's default sampling settings (vLLM's
    ``model_config.get_diff_sampling_param()``). ``key``: the pending capture's key.
    """
    group, conversation, policy = _keys(capture_xargs(body))
    _check_shape(kind, body, conversation)
    cls = _request_class(kind)
    try:
        request = cls.model_validate(body)
    except ValidationError as err:
        raise CaptureRequestError(
            f"vLLM's {kind} request refused it ({err.error_count()} problems): "
            f"{err.errors()[0]['msg']} at {err.errors()[0]['loc']}"
        ) from None
    # vLLM's own priority: the request's value, else the server's default, else vLLM's.
    asked = {}
    for name in SAMPLED:
        value = getattr(request, name, None)
        asked[name] = defaults.get(name) if value is None else value
    asked = {k: v for k, v in asked.items() if v is not None}
    check_requested(asked)  # before vLLM raises a low temperature to its floor
    config = CaptureConfig(top_k=asked.get("top_k"), policy=policy, num_experts=num_experts)
    from vllm.exceptions import VLLMClientError

    try:
        params = request.to_sampling_params(1, defaults)  # the length bound is not checked
    except (TypeError, ValueError, VLLMClientError) as err:
        raise SamplingSettingsError(f"vLLM refused the sampling parameters: {err}") from None
    user_logprobs = params.logprobs
    check_unchanged(asked, params)
    params.logprobs = max(config.requested, user_logprobs or 0)
    check_sampling_params(params, config)  # the engine's own check repeats it with its params
    out = copy.deepcopy(body)
    xargs = {k: v for k, v in out["vllm_xargs"].items() if not k.startswith(XARG_PREFIX)}
    out["vllm_xargs"] = {**xargs, XARG_KEY: key}
    out["return_token_ids"] = True
    ask = CaptureAsk(
        kind=kind,
        group=group,
        conversation=conversation,
        policy=policy,
        config=config,
        asked=asked,
        user_logprobs=user_logprobs,
    )
    return ask, out
