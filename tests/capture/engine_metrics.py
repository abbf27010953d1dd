"""What the session's vLLM engine is doing, from its Prometheus metrics (for tests that must act
while a request is in flight)."""

from __future__ import annotations

import re
import time
import urllib.request


def engine_counts(url: str) -> dict[str, float]:
    """Requests the engine runs and holds waiting now, and the tokens it generated so far
    (vLLM's Prometheus metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()

    def value(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    names = {"running": "num_requests_running", "waiting": "num_requests_waiting"}
    return {k: value(v) for k, v in names.items()} | {"tokens": value("generation_tokens_total")}


def wait_for(check, *, timeout_s: float, step_s: float = 0.02) -> bool:
    """Whether ``check()`` came true within ``timeout_s`` (polled every ``step_s``)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True
