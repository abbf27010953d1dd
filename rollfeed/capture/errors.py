"""Typed errors of the inference-side capture (engine outputs -> payload segments, turns -> sample).

Each is a :class:`~rollfeed.errors.RollfeedError` (a ``ValueError``: bad engine output, settings
or turns, never an internal bug) and names the value, the bound it broke and the fix. They are not
:class:`~rollfeed.payload.PayloadError`\\ s: no payload byte or record is wrong, the engine's output
or the caller's settings are. The place names what is known of where:

- ``request``: the engine's request id; ``completion``: the completion's index in its request;
- ``token``: the completion token (0 = the first sampled token);
- ``turn``: the turn's index in a multi-turn rollout;
- ``field``: the payload field; ``pos``: a token position (of the request for routed experts, of
  the assembled sample for turn assembly).

Example: ``SupportBoundError("...", request="cmpl-7", completion=1, token=12)`` reads
``"... [request=cmpl-7, completion=1, token=12]"``.
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class CaptureError(RollfeedError):
    """Base class: engine outputs, settings or turns that cannot become replayable data."""

    PLACE = ("request", "completion", "turn", "token", "field", "pos")


class SamplingSettingsError(CaptureError):
    """Sampling settings the trainer cannot replay (no top_k bound, greedy, penalties, biases)."""


class CaptureModeError(CaptureError):
    """The engine's logprobs are not the processed (kept-set normalised) ones the capture needs."""


class SupportMembershipError(CaptureError):
    """The sampled token is not in the kept set recovered for its position."""


class SupportBoundError(CaptureError):
    """All requested logprob entries are finite: the kept set may exceed what was returned."""


class RoutingShapeError(CaptureError):
    """Routed experts whose shape, row count or ids do not match the request."""


class TurnRangeError(CaptureError):
    """A turn adds no token, or one of its segments lies outside the turn's own positions."""


class TurnGapError(CaptureError):
    """Turn assembly found a gap in an ``inputs`` field's coverage under ``gap="raise"``."""


class TurnPrefixError(CaptureError):
    """A conversation's turn whose prompt does not extend the previous prompt and completion token
    for token (a chat template that drops earlier reasoning, an edited history) under
    ``policy="error"``; ``"repair"`` starts a new sample instead, counted."""


class CaptureRequestError(CaptureError):
    """A request to the OpenAI endpoints that names a capture group but asks for what the
    capture cannot serve (streaming, several prompts, a malformed capture key)."""


class ModelPathError(CaptureError):
    """``serve --model`` names a local path that does not exist (and is no Hugging Face repo
    id)."""


class CaptureServerError(CaptureError):
    """A capture server refused a request (``status``: its HTTP status) or gave no answer
    (``status=None``: unreachable, or died mid-request); no record came back."""

    PLACE = (*CaptureError.PLACE, "status")
