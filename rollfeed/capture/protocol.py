"""The capture route's request and response: JSON records between an orchestrator and a server.

``POST /rollfeed/v1/generate`` takes a :class:`GenerateRequest` and answers a
:class:`GenerateResponse`; both are frozen pydantic models (they cross a process and a network
boundary). The side channels never travel in them: each completion carries the segment records
of what the server wrote under its payload root, named relative to that root, so a trainer that
reaches the same root (a shared path, or the same bucket) reads the bytes by handle.

Positions are relative to the turn's first token, ``prompt_start`` (0 for a single call, where
the turn is the whole sample): the turn's tokens are ``token_ids[prompt_start:] +
completion ids``, its kept sets start at ``new_prompt_len = len(token_ids) - prompt_start`` and
its routing rows (when the engine returns them) at 0. :class:`~rollfeed.capture.Turn` takes them
as they are; :func:`~rollfeed.capture.assemble_turns` shifts them into the sample.

Example request (JSON)::

    {"token_ids": [1, 17, 42], "group": "step_000042",
     "sampling": {"top_k": 20, "top_p": 0.95, "temperature": 1.0, "max_tokens": 64, "seed": 3}}

answered with one completion per ``n``: ``{"token_ids": [...], "logprobs": [...],
"finish_reason": "length", "new_prompt_len": 3, "trainable": [...], "segments": [...]}``, and
the ``temperature`` the engine sampled with.

Each completion carries ``version_spans``: ``[start, end, version]`` rows, turn-relative like
the segments, naming the policy version (the trainer step whose weights sampled them) of its
tokens; two rows when the weights changed under it (:mod:`rollfeed.capture.weights`).

``POST /rollfeed/v1/weights`` takes a :class:`WeightsRequest` (a complete trainer checkpoint, its
version and what happens to requests in flight) and answers a :class:`WeightsResponse` once the
engine samples with the new weights.

vLLM's ``/v1/completions`` and ``/v1/chat/completions`` capture a request whose ``vllm_xargs``
hold :data:`XARG_GROUP` (and optionally :data:`XARG_CONVERSATION`, :data:`XARG_POLICY`); the
answer is vLLM's with one more field, :data:`CAPTURE_FIELD`: a :class:`TurnCapture`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from rollfeed.payload import ImageSpan, PayloadSegment

ROUTE = "/rollfeed/v1/generate"
INFO_ROUTE = "/rollfeed/v1/info"
WEIGHTS_ROUTE = "/rollfeed/v1/weights"
MAX_VERSION = (1 << 31) - 1  # versions are int32 in the micro batch
# Keys of ``vllm_xargs`` in a request to vLLM's OpenAI endpoints that ask for capture.
XARG_GROUP = "rollfeed_group"
XARG_CONVERSATION = "rollfeed_conversation"
XARG_POLICY = "rollfeed_policy"
XARGS = (XARG_GROUP, XARG_CONVERSATION, XARG_POLICY)
XARG_PREFIX = "rollfeed_"
CAPTURE_FIELD = "rollfeed"  # the answer's field holding the TurnCapture
GROUP_BYTES = 255  # a file name's limit on common filesystems
GROUP_RULE = (
    f"a group is 1 to {GROUP_BYTES} bytes of ASCII letters, digits, '.', '_' and '-', in "
    "components separated by '/', each starting with a letter, a digit or '_'"
)
_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*")
_GROUP_CHAR = re.compile(r"[A-Za-z0-9._/-]")


def check_group(group: str) -> str:
    """``group`` when it is a group name (:data:`GROUP_RULE`); else ``ValueError`` naming what
    breaks the rule.

    Example: ``"step_000042"`` and ``"run7/step_000042"`` pass; ``"step 42"`` (a space),
    ``"step%2F42"`` (a percent-escape), a name holding a newline, ``"../x"`` and 300 bytes of
    ``"a"`` do not.
    """
    size = len(group.encode())
    if size > GROUP_BYTES:
        raise ValueError(f"group {group[:40]!r}... is {size} bytes; {GROUP_RULE}")
    if not _GROUP.fullmatch(group):
        bad = next(
            (f"{c!r} at position {i}" for i, c in enumerate(group) if not _GROUP_CHAR.fullmatch(c)),
            "a component that is empty or starts with '.' or '-'",
        )
        raise ValueError(f"group {group!r} holds {bad}; {GROUP_RULE}")
    return group


class GenerateRequest(BaseModel):
    """One generation request through the capture route.

    token_ids: ``[P]`` the whole history (every earlier turn included), ids of the served model.
    group: the payload group the records land in (e.g. one training step, ``"step_000042"``);
        the server keeps one writer per group. A name follows :data:`GROUP_RULE` (no space,
        newline, ``%`` or other character that a path, a log line or a URL would change).
    sampling: ``vllm.SamplingParams`` keyword arguments; ``top_k`` is required (it bounds the
        kept set), ``logprobs`` comes from the capture (``top_k + 1``), and everything the trainer
        cannot replay (penalties, logit bias, greedy) is refused with HTTP 400.
    prompt_start: the first position of this turn (the length of the tokens already captured
        by earlier turns); records are relative to it.
    policy: what to do with a row the trainer cannot replay exactly (``"error"`` or
        ``"repair"``, see :mod:`rollfeed.capture.kept_set`).
    images: the encoded images (PNG, JPEG, ...; base64 in JSON) of the whole history, in prompt
        order, each standing in ``token_ids`` as its run of the model's image placeholder token
        (:mod:`rollfeed.capture.images`); a served model without images refuses them.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    token_ids: list[StrictInt] = Field(min_length=1)
    group: str = Field(min_length=1)
    sampling: dict[str, Any]
    prompt_start: StrictInt = Field(default=0, ge=0)
    policy: Literal["error", "repair"] = "error"
    images: list[bytes] = []

    _group = field_validator("group")(check_group)


class CompletionRecord(BaseModel):
    """One completion: ``C`` sampled ids and their records (positions turn-relative).

    token_ids: ``[C]`` sampled ids. logprobs: ``[C]`` the sampler's (processed) logprob of each.
    trainable: ``[C]`` False where ``policy="repair"`` took a row out of the loss.
    new_prompt_len: prompt tokens this turn adds (``len(request.token_ids) - prompt_start``).
    segments: the payload records (kept sets, their logprobs, routing when returned).
    version_spans: ``[start, end, version]`` rows over the completion's tokens (turn-relative:
    they start at ``new_prompt_len``), one per policy version that sampled them, in token order;
    empty when the engine reported none.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: StrictInt
    token_ids: list[StrictInt]
    logprobs: list[float]
    trainable: list[bool]
    finish_reason: str | None
    new_prompt_len: StrictInt
    segments: list[PayloadSegment]
    metrics: dict[str, int]
    version_spans: list[tuple[StrictInt, StrictInt, StrictInt]] = []


class GenerateResponse(BaseModel):
    """The answer to one :class:`GenerateRequest`: ``n`` completions, sent after their bytes are
    durable (as the server's writer ``fsync`` policy defines it). ``temperature``: the one the
    engine sampled with (the trainer's; a temperature the engine would change is refused).
    ``images``: the image records of the turn's prompt (turn-relative placeholder runs, the
    bytes by handle under the payload root), shared by its completions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    prompt_start: StrictInt
    temperature: float
    completions: list[CompletionRecord]
    images: list[ImageSpan] = []


class TurnCapture(GenerateResponse):
    """The ``rollfeed`` field of an answer of ``/v1/completions`` or ``/v1/chat/completions`` to a
    request that named a group (:data:`XARG_GROUP` in ``vllm_xargs``).

    A :class:`GenerateResponse` of the turn (positions relative to ``prompt_start``, as the
    capture route's), plus where the turn goes: ``conversation`` (:data:`XARG_CONVERSATION`, or
    None), the ``sample`` of that conversation it belongs to (0, then one more at each turn whose
    prompt did not extend the previous prompt and completion token for token: ``restarted``) and
    its ``turn`` in that sample. The turn's tokens are the answer's ``prompt_token_ids`` from
    ``prompt_start`` on, then the completion's ``token_ids``.
    """

    group: str
    conversation: str | None
    sample: StrictInt = Field(ge=0)
    turn: StrictInt = Field(ge=0)
    restarted: bool


class ServerInfo(BaseModel):
    """``GET /rollfeed/v1/info``: what a client checks before it trusts the records, and the
    policy version the engine samples with now (``policy_version``; ``None`` for a server that
    does not load weights) and the requests it holds (``requests_running``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    payload_root: str
    model: str
    fsync: Literal["always", "never"]
    num_experts: int | None
    route: str = ROUTE
    policy_version: int | None = None
    requests_running: int = 0


class WeightsRequest(BaseModel):
    """``POST /rollfeed/v1/weights``: load the trainer checkpoint at ``path`` (absolute, complete:
    :mod:`rollfeed.capture.checkpoint`) as policy version ``version`` (its marker's step).

    in_flight: what happens to requests the engine holds at the switch: ``"finish"`` (they end
    under the old weights, every token of the old version, before the new weights load; new
    requests wait) or ``"continue"`` (they pause, and go on under the new weights: a partial
    rollout, its tokens after the switch of the new version).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(min_length=1)
    version: StrictInt = Field(ge=0, le=MAX_VERSION)
    in_flight: Literal["finish", "continue"] = "finish"


class WeightsResponse(BaseModel):
    """The answer once the engine samples with the new weights: the ``version`` now and the
    one before (``previous``), the requests in flight at the switch (``requests_in_flight``) and
    what happened to them (``in_flight``), and the seconds generation was paused
    (``paused_s``) and the reload took (``reload_s``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    previous: int
    path: str
    in_flight: Literal["finish", "continue"]
    requests_in_flight: int
    paused_s: float
    reload_s: float
