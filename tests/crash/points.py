"""Pause points: a process of the crash test stops at a named point when the test arms it, so the
test's SIGKILL lands in the middle of that operation (a half-written cursor record, a staged step
file, a checkpoint without its metadata, a weights directory not yet renamed, a reload sent).

The test arms a role (``producer`` or ``trainer``) by putting ``<ctl>/arm-<role>.json``
(``{"id": 3, "point": "checkpoint.mid", "after": 2}``, written aside and renamed); the process
counts the hits of that point from the moment it sees the arm, and at hit ``after`` writes
``<ctl>/paused-<role>.json`` (the arm's id, the point, its pid) and waits: forever (the test's
SIGKILL ends it), or, for an arm with ``"release": true``, until ``<ctl>/release-<id>`` appears.
Only rank 0 of the trainer looks; the other ranks block in their next collective.

A gate paces a role: with ``<ctl>/gate-<role>.json`` (``{"below": 7}``) the process waits before
step 7 until the test opens it further, so a trainer does not run through the run's steps while
the test restarts another process (every kill then finds steps left to train).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CTL_ENV = "ROLLFEED_CRASH_CTL"


class Points:
    """The pause points of one process of role ``role`` (see the module doc)."""

    def __init__(self, role: str) -> None:
        ctl = os.environ.get(CTL_ENV)
        self.ctl = Path(ctl) if ctl else None
        self.role = role
        self.active = self.ctl is not None and os.environ.get("RANK", "0") == "0"
        self.hits: dict[int, int] = {}

    def _arm(self) -> dict | None:
        if not self.active:
            return None
        try:
            return json.loads((self.ctl / f"arm-{self.role}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def due(self, point: str) -> bool:
        """Count a hit of ``point``; True when it is the armed one (then :meth:`pause`)."""
        arm = self._arm()
        if arm is None or arm["point"] != point:
            return False
        n = self.hits[arm["id"]] = self.hits.get(arm["id"], 0) + 1
        return n == arm["after"]

    def pause(self, point: str) -> None:
        """Say so and wait (see the module doc)."""
        arm = self._arm()
        assert arm is not None and self.ctl is not None
        tmp = self.ctl / f".paused-{self.role}.tmp"
        tmp.write_text(json.dumps({"id": arm["id"], "point": point, "pid": os.getpid()}))
        tmp.rename(self.ctl / f"paused-{self.role}.json")
        release = self.ctl / f"release-{arm['id']}"
        while not (arm.get("release") and release.exists()):
            time.sleep(0.02)

    def gate(self, step: int) -> None:
        """Wait while the gate says ``step`` is not yet to begin (see the module doc)."""
        if not self.active:
            return
        while True:
            try:
                below = json.loads((self.ctl / f"gate-{self.role}.json").read_text())["below"]
            except (FileNotFoundError, ValueError):
                return
            if step < below:
                return
            time.sleep(0.05)

    def mark(self, event: str) -> None:
        """Append ``event`` with the wall time to ``<ctl>/timeline.jsonl`` (where a start's
        seconds go)."""
        if self.active:
            with open(self.ctl / "timeline.jsonl", "a") as f:
                f.write(json.dumps({"role": self.role, "event": event, "t": time.time()}) + "\n")

    def at(self, point: str) -> None:
        """A point with nothing to do before the pause."""
        if self.due(point):
            self.pause(point)
