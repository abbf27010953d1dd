"""Attack family ``capture_settings``: a grid of sampling settings against the capture's checks.

Each case sends one combination of temperature (0, a subnormal, 1e-6, 1e-5, 0.005, 0.00999, 0.01,
..., 2.5, inf, nan, negatives, odd types), top_k, top_p, min_p (and, on the OpenAI path, the
server's default settings) through the settings validation a request meets before the engine
runs, with no engine: the capture route's (:meth:`CaptureRoute.sampling_params`, then the engine
check at a ``max_logprobs``), and the OpenAI endpoints' (:meth:`OpenAICapture.open` on the body,
vLLM's own ``to_sampling_params`` on the body it hands vLLM's handler, then
:func:`capture_params`, what the engine runs).

Oracle: a typed refusal, or the ``SamplingParams`` the engine gets hold exactly the settings asked
(vLLM's ``SamplingParams`` changes a temperature below its floor, and resets top_k, top_p and min_p
under greedy, after which they differ), with ``logprobs >= top_k + 1`` and the engine's
``max_logprobs`` admitting them. A combination that is plainly replayable (a temperature in
[0.01, 2], an int top_k >= 2, top_p in (0, 1], min_p in [0, 1], enough max_logprobs) must be
accepted: a refusal of it is wrong.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tests.payload.adversary_tally import Tally, Wrong

MISSING = object()  # the setting is not sent
TEMPERATURES = [0, 0.0, 5e-324, 1e-6, 1e-5, 0.005, 0.00999, 0.01, 0.0100001, 0.5, 1, 1.0, 2.0]
TEMPERATURES += [2.5, math.inf, -math.inf, math.nan, -1e-6, -1.0, MISSING, True, "0.7"]
TOP_KS = [20, 2, 5, 1, 0, -1, MISSING, 20.0, True]
TOP_P_MIN_P = [
    (MISSING, MISSING),
    (0.9, MISSING),
    (1.0, 0.0),
    (MISSING, 0.1),
    (0.0, MISSING),
    (1.5, MISSING),
    (math.nan, MISSING),
    (MISSING, 1.0),
    (MISSING, -0.1),
]
SERVER_DEFAULTS = [{}, {"temperature": 0.6, "top_k": 20, "top_p": 0.95}, {"temperature": 0.005}]
MAX_LOGPROBS = [6, 21, 100]
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0}


def _engine(max_logprobs: int) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            logprobs_mode="processed_logprobs", max_logprobs=max_logprobs, logits_processors=None
        )
    )


def _sampling(t: Any, k: Any, p: Any, m: Any) -> dict[str, Any]:
    values = {"temperature": t, "top_k": k, "top_p": p, "min_p": m}
    return {name: v for name, v in values.items() if v is not MISSING}


def _plainly_replayable(asked: dict[str, Any], max_logprobs: int) -> bool:
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    t, k = asked.get("temperature", 1.0), asked.get("top_k", 0)
    p, m = asked.get("top_p", 1.0), asked.get("min_p", 0.0)
    return (
        number(t)
        and 0.01 <= t <= 2.0
        and isinstance(k, int)
        and not isinstance(k, bool)
        and k >= 2
        and number(p)
        and 0 < p <= 1
        and number(m)
        and 0 <= m <= 1
        and max_logprobs >= k + 1
    )


def _check_engine_params(params: Any, asked: dict[str, Any], max_logprobs: int) -> None:
    """The oracle: the engine's params hold exactly the asked settings (vLLM's defaults where
    none was asked) and logprobs enough to bound the kept set, within ``max_logprobs``."""
    for name, default in VLLM_DEFAULTS.items():
        want = asked.get(name, default)
        used = getattr(params, name)
        if not (used == want and type(used) is not str):
            raise Wrong(f"accepted {name}={want!r} but the engine samples with {used!r}")
    if params.top_k < 2 or params.logprobs < params.top_k + 1:
        raise Wrong(f"accepted top_k={params.top_k}, logprobs={params.logprobs}")
    if params.logprobs > max_logprobs:
        raise Wrong(f"accepted logprobs={params.logprobs} beyond max_logprobs={max_logprobs}")


def _custom_route(root: Path, sampling: dict[str, Any], max_logprobs: int) -> None:
    from rollfeed.capture.protocol import GenerateRequest
    from rollfeed.capture.route import CaptureRoute
    from rollfeed.capture.vllm_adapter import check_engine

    route = CaptureRoute(_engine(max_logprobs), payload_root=str(root))
    request = GenerateRequest(token_ids=[1, 2, 3], group="g", sampling=dict(sampling))
    config = route.config(request)
    params = route.sampling_params(request, config)
    check_engine(route.engine, config)  # as CaptureRoute.generate, before the engine runs
    _check_engine_params(params, sampling, max_logprobs)


def _openai(
    root: Path, kind: str, sampling: dict[str, Any], defaults: dict, max_logprobs: int
) -> None:
    from rollfeed.capture.openai_capture import OpenAICapture, capture_params
    from rollfeed.capture.openai_request import _request_class
    from rollfeed.capture.route import CaptureRoute

    body: dict[str, Any] = {"model": "m", "max_tokens": 4, **sampling}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Bada kime sotu."}]
    else:
        body["prompt"] = [1, 40, 41]
    body["vllm_xargs"] = {"rollfeed_group": "g", "session_id": "s"}
    capture = OpenAICapture(CaptureRoute(_engine(max_logprobs), payload_root=str(root)))
    key, sent = capture.open(kind, body, defaults=dict(defaults))
    ask = capture.close(key).ask
    # what vLLM's handler builds from the body it gets, then what the engine runs
    request = _request_class(kind).model_validate(sent)
    handed = request.to_sampling_params(4, dict(defaults))
    params = capture_params(ask, handed, prompt_start=0)
    if params.extra_args != {"session_id": "s"}:
        raise Wrong(f"the engine got extra_args {params.extra_args}")
    # asked as vLLM reads the request: its value, else the server's default
    asked = {}
    for name in VLLM_DEFAULTS:
        value = getattr(request, name)
        value = defaults.get(name) if value is None else value
        if value is not None:
            asked[name] = value
    _check_engine_params(params, asked, max_logprobs)


def family_capture_settings(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    from rollfeed.capture.openai_request import _request_class

    _request_class("completion"), _request_class("chat")  # imported before the cases' alarms
    root = workdir / "payload"
    grid = list(itertools.product(TEMPERATURES, TOP_KS, TOP_P_MIN_P))
    for t, k, (p, m) in grid:
        sampling = _sampling(t, k, p, m)
        max_logprobs = MAX_LOGPROBS[int(rng.integers(len(MAX_LOGPROBS)))]
        must = _plainly_replayable(sampling, max_logprobs)
        tally.case(
            f"capture route: sampling {sampling}, max_logprobs {max_logprobs}",
            lambda s=sampling, n=max_logprobs: _custom_route(root, s, n),
            refusal_ok=not must,
        )
        kind = ("completion", "chat")[int(rng.integers(2))]
        defaults = SERVER_DEFAULTS[int(rng.integers(len(SERVER_DEFAULTS)))]
        merged = {**defaults, **sampling}
        must = _plainly_replayable(merged, max_logprobs)
        tally.case(
            f"openai {kind}: sampling {sampling}, server defaults {defaults}, max_logprobs "
            f"{max_logprobs}",
            lambda s=sampling, d=defaults, n=max_logprobs, kind=kind: _openai(root, kind, s, d, n),
            refusal_ok=not must,
        )
