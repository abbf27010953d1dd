"""The capture server's client: requests out, :class:`Sample`\\ s and steps in.

:class:`CaptureClient` posts :class:`~rollfeed.capture.protocol.GenerateRequest`\\ s to a capture
server (``python -m rollfeed serve``) with the standard library's HTTP client (an orchestrator
needs neither vLLM nor torch's extras for it; call it from threads for concurrency). Anything but
a well-formed answer is a :class:`CaptureServerError` with the HTTP status and the server's
reason (``None`` when the connection failed: the server died or was unreachable), and no record.

:class:`Rollout` accumulates the turns of one rollout branch and makes its
:class:`~rollfeed.collate.Sample`: each turn adds the new prompt tokens it sent (tool text,
user text) and the completion it got; the segments are stitched with
:func:`~rollfeed.capture.assemble_turns`. A single call is a rollout of one turn.

An orchestrator in a few lines::

    client = CaptureClient("http://inference-0:8000")
    sampling = {"top_k": 20, "top_p": 0.95, "temperature": 1.0, "max_tokens": 256}
    with client.step_writer("steps/", 42) as step:   # the step file, written as rollouts finish
        for i, prompt in enumerate(prompts):
            rollout = Rollout()   # the temperature the server sampled at
            rollout.add(prompt, client.generate(prompt, group="step_000042", sampling=sampling))
            rollout.add(tool_ids, client.turn(rollout, tool_ids, group="step_000042",
                                              sampling=sampling))   # a second turn
            step.append(rollout.sample(advantage=0.3, uid=f"p{i}"), group=f"p{i}")
    # step_000042.rfs appears whole here; client.write_step("steps/", 42, samples) writes a list
    client.load_weights("/ckpt/step_000043", version=43)   # the trainer's next weights
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from rollfeed.capture.errors import CaptureError, CaptureServerError
from rollfeed.capture.protocol import (
    INFO_ROUTE,
    ROUTE,
    WEIGHTS_ROUTE,
    CompletionRecord,
    GenerateRequest,
    GenerateResponse,
    ServerInfo,
    WeightsRequest,
    WeightsResponse,
)
from rollfeed.capture.turns import Turn, assemble_turns, stitch_version_spans
from rollfeed.collate import Sample
from rollfeed.loaders import StepWriter, write_step_file
from rollfeed.payload import ImageSpan


class CaptureClient:
    """HTTP client of one capture server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def _call(self, path: str, body: bytes | None) -> bytes:
        req = urllib.request.Request(
            self.url + path, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                reason = json.loads(raw)["error"]
                reason = f"{reason['type']}: {reason['message']}"
            except (ValueError, KeyError, TypeError):
                reason = raw[:2000].decode("utf-8", "replace")
            raise CaptureServerError(
                f"{self.url}{path} answered HTTP {err.code}: {reason}", status=err.code
            ) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            raise CaptureServerError(
                f"{self.url}{path} gave no answer ({err}): no record came back; the server may "
                "have died mid-request, leaving bytes without records in its group (run "
                "`python -m rollfeed verify ROOT`, then prune the group)",
                status=None,
            ) from None

    def info(self) -> ServerInfo:
        """The server's payload root, model and fsync policy, and its policy version now."""
        return ServerInfo.model_validate_json(self._call(INFO_ROUTE, None))

    def load_weights(
        self,
        path: str | os.PathLike[str],
        *,
        version: int,
        in_flight: Literal["finish", "continue"] = "finish",
    ) -> WeightsResponse:
        """Have the server load the trainer checkpoint at ``path`` (absolute, as the server
        sees it; complete: :mod:`rollfeed.capture.checkpoint`) as policy ``version``; returns
        once the engine samples with it. ``in_flight``: requests under way at the switch end
        under the old weights (``"finish"``) or go on under the new ones (``"continue"``, a
        partial rollout; :class:`~rollfeed.capture.protocol.WeightsRequest`). A refused
        checkpoint is a :class:`CaptureServerError` (HTTP 400) naming what is wrong."""
        request = WeightsRequest(path=os.fspath(path), version=version, in_flight=in_flight)
        raw = self._call(WEIGHTS_ROUTE, request.model_dump_json().encode())
        try:
            return WeightsResponse.model_validate_json(raw)
        except ValidationError as err:
            raise CaptureServerError(
                f"{self.url}{WEIGHTS_ROUTE} answered a malformed response "
                f"({err.errors()[0]['msg']}); is it a capture server of this rollfeed version?"
            ) from None

    def generate(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        group: str,
        sampling: dict[str, Any],
        prompt_start: int = 0,
        policy: Literal["error", "repair"] = "error",
        images: Sequence[bytes] = (),
    ) -> GenerateResponse:
        """Sample ``token_ids`` (the whole history) and get the records (see the protocol);
        ``images``: the encoded images of the history, each a placeholder run of the ids."""
        request = GenerateRequest(
            token_ids=[int(t) for t in token_ids],
            group=group,
            sampling=sampling,
            prompt_start=prompt_start,
            policy=policy,
            images=list(images),
        )
        raw = self._call(ROUTE, request.model_dump_json().encode())
        try:
            response = GenerateResponse.model_validate_json(raw)
        except ValidationError as err:
            raise CaptureServerError(
                f"{self.url}{ROUTE} answered a malformed response ({err.error_count()} problems: "
                f"{err.errors()[0]['msg']}); is it a capture server of this rollfeed version?"
            ) from None
        for c in response.completions:
            if not (len(c.token_ids) == len(c.logprobs) == len(c.trainable)):
                raise CaptureServerError(
                    f"{self.url}{ROUTE} answered {len(c.token_ids)} ids, {len(c.logprobs)} "
                    f"logprobs and {len(c.trainable)} trainable flags for one completion",
                    completion=c.index,
                )
        return response

    def turn(self, rollout: Rollout, new_ids: Sequence[int], **kwargs: Any) -> GenerateResponse:
        """The next turn of ``rollout``: its history plus ``new_ids``, from its current end."""
        history = [*rollout.token_ids, *(int(t) for t in new_ids)]
        return self.generate(history, prompt_start=len(rollout.token_ids), **kwargs)

    @staticmethod
    def write_step(
        directory: str | os.PathLike[str], step: int, samples: list[Sample], **options: Any
    ) -> str:
        """Write step ``step``'s file whole (:func:`rollfeed.loaders.write_step_file`; ``options``:
        :class:`~rollfeed.loaders.StepWriter`'s); its path or URL."""
        return write_step_file(directory, step, samples, **options)

    @staticmethod
    def step_writer(directory: str | os.PathLike[str], step: int, **options: Any) -> StepWriter:
        """A writer of step ``step``'s file that takes each sample as its rollout finishes
        (:class:`~rollfeed.loaders.StepWriter`; the file appears whole when it closes)."""
        return StepWriter(directory, step, **options)


class Rollout:
    """The turns of one rollout branch, stitched into one :class:`Sample`.

    ``add(new_ids, response)``: the turn's new prompt tokens (the whole prompt for the first
    turn) and the server's answer to it (completion ``index``). Token ids, loss mask and sampled
    logprobs grow turn by turn; :meth:`sample` stitches the segments (``final_token``, ``gap``:
    see :func:`~rollfeed.capture.assemble_turns`).

    ``temperature``: the one the sample records for the trainer; None (the default) takes the
    temperature the server reports it sampled with, and every turn must report the one the
    rollout has (a rollout asked at one temperature and sampled at another is refused).

    Example: a prompt of 3 tokens answered with 2, then 2 tool tokens answered with 2 ->
    ``token_ids`` of 9, loss mask ``[0,0,0,1,1,0,0,1,1]``, turns of lengths 5 and 4.
    """

    def __init__(self, *, temperature: float | None = None) -> None:
        self.temperature = temperature
        self.token_ids: list[int] = []
        self.loss_mask: list[bool] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.images: list[ImageSpan] = []

    def add(
        self, new_ids: Sequence[int], response: GenerateResponse, *, index: int = 0
    ) -> CompletionRecord:
        """Append one turn; returns its completion record."""
        turn = len(self.turns)
        if response.prompt_start != len(self.token_ids):
            raise CaptureError(
                f"the response starts its turn at {response.prompt_start}, the rollout has "
                f"{len(self.token_ids)} tokens; send the whole history with "
                "prompt_start=len(rollout.token_ids) (CaptureClient.turn does)",
                turn=turn,
            )
        if self.temperature is not None and response.temperature != self.temperature:
            raise CaptureError(
                f"the server sampled this turn at temperature {response.temperature}, the "
                f"rollout records {self.temperature}; the trainer must score at the sampler's",
                turn=turn,
            )
        if not 0 <= index < len(response.completions):
            raise CaptureError(
                f"completion {index} of a response with {len(response.completions)}", turn=turn
            )
        c = response.completions[index]
        if c.new_prompt_len != len(new_ids):
            raise CaptureError(
                f"the server saw {c.new_prompt_len} new prompt tokens in this turn, the rollout "
                f"adds {len(new_ids)}",
                turn=turn,
            )
        self.temperature = response.temperature
        self.images += [im.shifted(len(self.token_ids)) for im in response.images]
        self.token_ids += [int(t) for t in new_ids] + c.token_ids
        self.loss_mask += [False] * len(new_ids) + c.trainable
        self.logprobs += [0.0] * len(new_ids) + c.logprobs
        self.turns.append(
            Turn(
                length=len(new_ids) + len(c.token_ids),
                segments=tuple(c.segments),
                version_spans=tuple(c.version_spans),
            )
        )
        return c

    def sample(
        self,
        *,
        advantage: float = 0.0,
        uid: str | None = None,
        final_token: Literal["fill", "repeat"] = "fill",
        gap: Literal["drop", "raise"] = "drop",
    ) -> Sample:
        """The rollout as one :class:`Sample`: ``advantage`` per loss token, segments and policy
        version spans stitched."""
        if not self.turns or self.temperature is None:
            raise CaptureError("a rollout needs at least one turn before it becomes a sample")
        segments, _ = assemble_turns(self.turns, final_token=final_token, gap=gap)
        versions = stitch_version_spans(self.turns)
        mask = np.asarray(self.loss_mask, dtype=bool)
        return Sample(
            np.asarray(self.token_ids, dtype=np.int64),
            loss_mask=mask,
            advantages=np.where(mask, advantage, 0.0).astype(np.float32),
            inference_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            temperatures=np.full(mask.size, self.temperature, np.float32),
            payload=segments,
            images=self.images,
            version_spans=versions,
            uid=uid,
        )
