"""The capture route's handler: sample with the engine, write the side channels, answer records.

:class:`CaptureRoute` serves ``POST /rollfeed/v1/generate`` (:mod:`rollfeed.capture.protocol`)
for one engine (anything with vLLM's ``EngineClient.generate``: an async generator of
``RequestOutput``) and one payload root. Per request it

1. builds ``vllm.SamplingParams`` from the request and refuses, before anything runs, what the
   trainer cannot replay (:func:`~rollfeed.capture.check_sampling_params`) or what the engine
   cannot return (:func:`~rollfeed.capture.check_engine`): a :class:`SamplingSettingsError` or
   :class:`CaptureModeError`, answered with HTTP 400 and the reason;
2. runs the request and takes its final ``RequestOutput``;
3. captures every completion with the group's writer (:func:`capture_request_output`, in a
   worker thread so an ``fsync`` never stalls the event loop) and answers only after the writes
   returned, so a record never names bytes that are not durable.

One :class:`~rollfeed.payload.PayloadWriter` per group and server process, shared by every
request of that group: its writes are serialised by its own lock, each returns its own records.
Writers of groups no request uses any more are closed once more than ``max_open_groups`` are
open (the oldest first), so a long-running server holds a bounded number of files open.

Example (what the server does; a test can feed a recorded ``RequestOutput`` to ``respond``)::

    route = CaptureRoute(engine, payload_root="/shared/payload", num_experts=128)
    response = await route.generate(GenerateRequest(token_ids=[1, 5, 9], group="step_000001",
                                                     sampling={"top_k": 20, "max_tokens": 8}))
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from rollfeed.capture.config import CaptureConfig
from rollfeed.capture.errors import CaptureError, CaptureRequestError, SamplingSettingsError
from rollfeed.capture.images import ImageCapture, capture_images, decoded
from rollfeed.capture.protocol import CompletionRecord, GenerateRequest, GenerateResponse
from rollfeed.capture.routing import routed_dtype
from rollfeed.capture.settings import check_requested, check_unchanged
from rollfeed.capture.vllm_adapter import (
    capture_request_output,
    check_engine,
    check_sampling_params,
    import_vllm,
)
from rollfeed.payload import MediaWriter, PayloadWriter

logger = logging.getLogger(__name__)

# Set by the route itself: the capture decides them, a request may not.
_ROUTE_OWNED = ("logprobs", "flat_logprobs", "output_kind", "routed_experts_prompt_start")
_INT64 = (-(2**63), 2**63)  # the integers the engine's messages encode


def _check_integers(sampling: dict[str, Any]) -> None:
    """Refuse an integer sampling value the engine cannot encode (vLLM would answer HTTP 500).

    Checks each value and the items of a list or dict value (``stop_token_ids``, ``logit_bias``).
    """
    for key, value in sampling.items():
        if isinstance(value, dict):
            values = list(value.values())
        else:
            values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and not _INT64[0] <= v < _INT64[1]:
                hint = (
                    "; a completion ends at the model's context length anyway, so any budget "
                    "up to it will do"
                    if key == "max_tokens"
                    else ""
                )
                raise SamplingSettingsError(
                    f"sampling {key}={v} lies outside the signed 64-bit integers the engine "
                    f"encodes [-2**63, 2**63){hint}"
                )


class CaptureRoute:
    """Handler of the capture route for one engine and one payload root (see module doc).

    engine: vLLM's ``EngineClient`` (``AsyncLLM``) or an object with the same ``generate`` and
    ``model_config``. fsync: the writers' policy (``"always"``: records only after ``fsync``).
    num_experts: the model's experts per MoE layer (routing is stored as uint8/uint16 for it).
    writer_prefix: starts the name of every file the route writes (``<group>/<prefix><random
    hex>.rfp``), e.g. to tell whose files a shared root holds. images: the served model's
    image processor and placeholder token (:class:`~rollfeed.capture.images.ImageCapture`), for
    a vision-language model: each request's images are stored once by handle and returned as
    the turn's image records; None refuses requests with images.
    """

    def __init__(
        self,
        engine: Any,
        *,
        payload_root: str,
        fsync: Literal["always", "never"] = "always",
        num_experts: int | None = None,
        writer_prefix: str = "",
        max_open_groups: int = 8,
        images: ImageCapture | None = None,
    ) -> None:
        self.engine, self.payload_root, self.fsync = engine, str(payload_root), fsync
        self.images = images
        self.media = MediaWriter(self.payload_root)
        self.num_experts, self.max_open_groups = num_experts, max_open_groups
        self.writer_prefix = writer_prefix
        # One routing dtype for every request of the server (as CaptureConfig.writer_dtypes).
        self._dtypes = (
            {} if num_experts is None else {"routed_experts": routed_dtype(num_experts).name}
        )
        self._writers: dict[str, list[Any]] = {}  # group -> [writer, requests using it]
        self._lock = threading.Lock()

    def config(self, request: GenerateRequest) -> CaptureConfig:
        """The capture settings of one request (top_k from its sampling, the server's experts)."""
        return CaptureConfig(
            top_k=request.sampling.get("top_k"),
            policy=request.policy,
            num_experts=self.num_experts,
        )

    def sampling_params(self, request: GenerateRequest, config: CaptureConfig) -> Any:
        """``vllm.SamplingParams`` for ``request``, refused (typed) when not replayable."""
        if request.prompt_start > len(request.token_ids):
            raise SamplingSettingsError(
                f"prompt_start={request.prompt_start} lies past the {len(request.token_ids)} "
                "token ids sent; send the whole history and the first position of this turn"
            )
        owned = sorted(set(request.sampling) & set(_ROUTE_OWNED))
        if owned:
            raise SamplingSettingsError(
                f"sampling sets {owned}, which the capture route sets itself; leave them out"
            )
        _check_integers(request.sampling)
        check_requested(request.sampling)  # before vLLM raises a low temperature to its floor
        kwargs = dict(request.sampling)
        if isinstance(kwargs.get("logit_bias"), dict):  # JSON object keys are strings
            kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
        vllm = import_vllm()
        from vllm.exceptions import VLLMClientError

        try:
            params = vllm.SamplingParams(
                **kwargs,
                logprobs=config.requested,
                flat_logprobs=True,
                output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
                routed_experts_prompt_start=request.prompt_start,
            )
        except (TypeError, ValueError, VLLMClientError) as err:
            raise SamplingSettingsError(f"vLLM refused the sampling parameters: {err}") from None
        check_sampling_params(params, config)
        check_unchanged(request.sampling, params)
        return params

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Sample ``request`` with the engine, capture it, answer its records."""
        config = self.config(request)
        params = self.sampling_params(request, config)
        check_engine(self.engine, config)
        self.acquire(request.group)  # a group name that leaves the root is refused here
        if request.images and self.images is None:
            raise CaptureRequestError(
                f"the request holds {len(request.images)} images, the served model takes none"
            )
        try:
            request_id = f"rollfeed-{uuid.uuid4().hex}"
            final = None
            prompt: dict[str, Any] = {"prompt_token_ids": list(request.token_ids)}
            if request.images:
                prompt["multi_modal_data"] = {"image": [decoded(b) for b in request.images]}
            async for output in self.engine.generate(prompt, params, request_id):
                final = output
            if final is None or not final.finished:
                raise CaptureError(
                    "the engine ended the request without a finished output", request=request_id
                )
            return await asyncio.to_thread(
                self.capture_output,
                request.group,
                final,
                config,
                prompt_start=request.prompt_start,
                temperature=params.temperature,
                images=request.images,
            )
        finally:
            self.release(request.group)

    def respond(
        self, request: GenerateRequest, output: Any, config: CaptureConfig | None = None
    ) -> GenerateResponse:
        """Capture one finished ``RequestOutput`` of ``request`` into its group; the response."""
        return self.capture_output(
            request.group,
            output,
            config or self.config(request),
            prompt_start=request.prompt_start,
            temperature=float(request.sampling.get("temperature", 1.0)),
            images=request.images,
        )

    def capture_output(
        self,
        group: str,
        output: Any,
        config: CaptureConfig,
        *,
        prompt_start: int,
        temperature: float,
        images: Sequence[bytes] = (),
    ) -> GenerateResponse:
        """Capture one finished ``RequestOutput`` into ``group``'s writer; its records
        (``images``: the encoded images of its prompt, in order)."""
        spans = []
        if self.images is not None:
            spans = capture_images(
                images,
                prompt_ids=list(output.prompt_token_ids or ()),
                prompt_start=prompt_start,
                capture=self.images,
                writer=self.media,
            )
        elif images:
            raise CaptureRequestError(f"{len(images)} images, and the served model takes none")
        writer = self.acquire(group)
        try:
            captured = capture_request_output(writer, output, config, prompt_start=prompt_start)
        finally:
            self.release(group)
        completions = []
        for k, (completion, cap) in enumerate(zip(output.outputs, captured, strict=True)):
            new = cap.new_prompt_len
            completions.append(
                CompletionRecord(
                    index=getattr(completion, "index", k),
                    token_ids=cap.token_ids[new:].tolist(),
                    logprobs=cap.inference_logprobs[new:].tolist(),
                    trainable=cap.loss_mask[new:].tolist(),
                    finish_reason=getattr(completion, "finish_reason", None),
                    new_prompt_len=new,
                    segments=list(cap.segments),
                    metrics=cap.metrics,
                    version_spans=[tuple(row) for row in cap.version_spans.tolist()],
                )
            )
        return GenerateResponse(
            request_id=str(getattr(output, "request_id", "")),
            prompt_start=prompt_start,
            temperature=temperature,
            completions=completions,
            images=spans,
        )

    def acquire(self, group: str) -> PayloadWriter:
        """The writer of ``group``, held by one more request until :meth:`release` (a name that
        leaves the root is refused here, before anything runs)."""
        with self._lock:
            entry = self._writers.pop(group, None)
            if entry is None:
                writer = PayloadWriter(
                    self.payload_root,
                    group=group,
                    name=f"{self.writer_prefix}{uuid.uuid4().hex}",
                    fsync=self.fsync,
                    dtypes=self._dtypes,
                )
                entry = [writer, 0]
            entry[1] += 1
            self._writers[group] = entry  # most recently used last
            return entry[0]

    def release(self, group: str) -> None:
        """One request less holds ``group``'s writer; idle writers beyond the bound close."""
        with self._lock:
            self._writers[group][1] -= 1
            idle = [g for g, (_, users) in self._writers.items() if users == 0]
            for name in idle[: max(len(self._writers) - self.max_open_groups, 0)]:
                self._writers.pop(name)[0].close()
                logger.debug("closed the writer of group %s (%d open)", name, len(self._writers))

    def close(self) -> None:
        """Close every writer (the server's shutdown)."""
        with self._lock:
            for writer, _ in self._writers.values():
                writer.close()
            self._writers.clear()
