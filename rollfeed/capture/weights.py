"""Weights that change under the capture server: a trainer checkpoint loaded in place, versioned.

:class:`WeightUpdater` serves ``POST /rollfeed/v1/weights`` (:class:`WeightsRequest`) with vLLM's
own API for one engine (``AsyncLLM``), one update at a time:

1. the checkpoint is held to :func:`~rollfeed.capture.checkpoint.read_checkpoint` (complete: its
   marker written last; its step the requested version) and its model config to the served
   model's (:func:`~rollfeed.capture.checkpoint.config_differences`), before the engine is
   touched: a :class:`~rollfeed.capture.checkpoint.CheckpointError` (HTTP 400) otherwise;
2. ``pause_generation(mode=..., clear_cache=True)``: with ``in_flight="finish"`` (mode
   ``"wait"``) the engine runs the requests it holds to their end under the old weights and queues
   new ones; with ``"continue"`` (mode ``"keep"``) it freezes them where they are. Once they are
   done or frozen it resets its prefix cache with the frozen requests preempted: no cached
   prefix computed by the old weights is reused, a frozen request's own KV included (it is
   recomputed under the new weights on resumption), and nothing runs until the resume;
3. ``collective_rpc("rollfeed_reload_weights", kwargs={"weights_path": path})`` loads the weights
   in place: in every worker, vLLM's own ``reload_weights`` and then the expert-weight preparation
   vLLM 0.32 skips on a weight update (:mod:`rollfeed.capture.worker_reload`; without it a MoE
   model reloaded on CPU computes other logits than the same weights loaded fresh);
4. ``update_weight_version(str(version))``: every token sampled from now on is stamped with it;
5. ``resume_generation()``: a frozen request goes on under the new weights
   and comes back as a partial rollout: its completion's ``weight_versions`` spans, and so its
   ``version_spans``, name both versions, the split where the switch fell.

A reload that fails in the engine (a tensor of another shape) loads the previous weights again
and resumes under the previous version: a :class:`WeightReloadError` (HTTP 422) names both. If
that fails too the engine's weights are unknown: generation stays paused and every later update
or capture request is refused naming the cause (restart the server).

The version is the trainer step whose weights the engine samples with; the server starts at
``serve --policy-version`` (default 0), which it stamps on the engine before it serves.

Example (what ``CaptureClient.load_weights`` asks)::

    POST /rollfeed/v1/weights {"path": "/ckpt/step_000042", "version": 42, "in_flight": "continue"}
    -> {"version": 42, "previous": 41, "requests_in_flight": 3, "in_flight": "continue", ...}
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from rollfeed.capture.checkpoint import CheckpointError, config_differences, read_checkpoint
from rollfeed.capture.errors import CaptureError
from rollfeed.capture.protocol import WeightsRequest, WeightsResponse
from rollfeed.capture.worker_reload import METHOD

logger = logging.getLogger(__name__)

PAUSE_MODES = {"finish": "wait", "continue": "keep"}


class WeightReloadError(CaptureError):
    """The engine failed to load a checkpoint that passed the checks; the previous weights were
    loaded again (or, when that failed too, generation stays paused: restart the server)."""


class WeightUpdater:
    """Loads trainer checkpoints into ``engine`` under ``version`` (see the module doc).

    engine: vLLM's ``AsyncLLM`` (``pause_generation``, ``collective_rpc``,
    ``update_weight_version``, ``resume_generation``). version: the
    policy version the engine's current weights are. path: where they were loaded from (loaded
    again when a reload fails). served_config: the served model's config (a dict), which a
    checkpoint's must agree with. rpc: the workers' reload method (``serve`` installs
    :data:`~rollfeed.capture.worker_reload.METHOD`; ``"reload_weights"`` is vLLM's own).
    """

    def __init__(
        self,
        engine: Any,
        *,
        version: int,
        path: str,
        served_config: Mapping[str, Any],
        rpc: str = METHOD,
    ) -> None:
        self.engine, self.version, self.path, self.rpc = engine, version, path, rpc
        self.served_config = dict(served_config)
        self.broken: str | None = None  # why the weights are unknown, after a failed restore
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Stamp the engine with the starting version (before it serves a request)."""
        await self.engine.update_weight_version(str(self.version))

    def running(self) -> int:
        """Requests the engine holds now (0 for an engine that does not say)."""
        count = getattr(self.engine, "get_num_unfinished_requests", None)
        return int(count()) if count is not None else 0

    def check_usable(self) -> None:
        """Refuse work once the weights are unknown (:class:`WeightReloadError`)."""
        if self.broken is not None:
            raise WeightReloadError(
                f"the engine's weights are unknown since a failed reload ({self.broken}); "
                "generation is paused: restart the server"
            )

    async def load(self, request: WeightsRequest) -> WeightsResponse:
        """Load ``request``'s checkpoint as its version; the answer once it is sampled with."""
        async with self._lock:
            self.check_usable()
            checkpoint = await asyncio.to_thread(read_checkpoint, request.path)
            if checkpoint.step != request.version:
                raise CheckpointError(
                    f"checkpoint {request.path} holds the weights of step {checkpoint.step}, the "
                    f"request loads them as version {request.version}: tokens would carry "
                    "another step's version; send version=" + str(checkpoint.step)
                )
            differ = config_differences(
                await asyncio.to_thread(checkpoint.config), self.served_config
            )
            if differ:
                raise CheckpointError(
                    f"checkpoint {request.path} is another model than the one served "
                    f"({'; '.join(differ)}): its weights would load only in part"
                )
            previous, running = self.version, self.running()
            paused = time.monotonic()
            await self.engine.pause_generation(
                mode=PAUSE_MODES[request.in_flight], clear_cache=True
            )
            reload_s = await self._reload(request)
            resumed = time.monotonic()
            logger.info(
                "policy version %d -> %d from %s (%d requests in flight: %s; paused %.3f s)",
                previous,
                request.version,
                request.path,
                running,
                request.in_flight,
                resumed - paused,
            )
            return WeightsResponse(
                version=request.version,
                previous=previous,
                path=request.path,
                in_flight=request.in_flight,
                requests_in_flight=running,
                paused_s=resumed - paused,
                reload_s=reload_s,
            )

    async def _reload(self, request: WeightsRequest) -> float:
        """Reload and stamp the new version, generation paused; resume. The seconds the reload
        took."""
        started = time.monotonic()
        try:
            await self.engine.collective_rpc(self.rpc, kwargs={"weights_path": request.path})
        except Exception as err:
            await self._restore(request, err)
            raise WeightReloadError(
                f"the engine failed to load {request.path} ({type(err).__name__}: {err}); the "
                f"previous weights ({self.path}) were loaded again and it samples on as version "
                f"{self.version}"
            ) from None
        reload_s = time.monotonic() - started
        await self.engine.update_weight_version(str(request.version))
        self.version, self.path = request.version, request.path
        await self.engine.resume_generation()
        return reload_s

    async def _restore(self, request: WeightsRequest, err: Exception) -> None:
        """Load the previous weights again and resume; on failure stay paused (``broken``)."""
        try:
            await self.engine.collective_rpc(self.rpc, kwargs={"weights_path": self.path})
        except Exception as again:
            self.broken = (
                f"{request.path}: {type(err).__name__}: {err}; then {self.path}: "
                f"{type(again).__name__}: {again}"
            )
            logger.error("weights unknown, generation stays paused: %s", self.broken)
            raise WeightReloadError(
                f"the engine failed to load {request.path} ({err}) and then the previous "
                f"weights {self.path} ({again}): its weights are unknown; generation stays "
                "paused: restart the server"
            ) from None
        await self.engine.resume_generation()
