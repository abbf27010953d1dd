"""Outcomes of adversarial cases, counted per family (:class:`Tally`), and what makes one.

Each attack (one read, one parse, one verify) is one case with an outcome:

- ``correct``: returned exactly what the oracle says;
- ``refused``: raised a typed error (a ``ValueError`` subclass defined in ``rollfeed``);
- ``wrong``: returned other data (or handed out a record that does not read back);
- ``hang``: ran past the per-case bound (``signal.setitimer``);
- ``escape``: returned bytes of the canary file outside the root;
- ``untyped``: raised anything else (``OSError``, ``struct.error``, ``KeyError``, ...);
- ``overalloc``: ``MemoryError`` under the address-space limit, or a peak of traced allocations
  (NumPy buffers, via ``tracemalloc``) above ``ALLOC_BOUND`` for files of a few KiB.
"""

from __future__ import annotations

import resource
import signal
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ALLOC_BOUND = 64 << 20
CASE_BOUND_S = 2.0  # one small read takes milliseconds
HANGS_BEFORE_SHORTER = 2  # after two hangs a family waits 0.3 s per case, to stay in budget
OUTCOMES = ("correct", "refused", "wrong", "hang", "escape", "untyped", "overalloc")
FAILURES = ("wrong", "hang", "escape", "untyped", "overalloc")


class Wrong(Exception):
    """A read returned data other than what the oracle says."""


class Escaped(Exception):
    """A read returned bytes of the canary outside the root."""


class _Hang(BaseException):
    """Raised by SIGALRM when a case runs past its bound (BaseException: nothing swallows it)."""


def _alarm(signum, frame):
    raise _Hang()


def typed(err: BaseException) -> bool:
    return isinstance(err, ValueError) and type(err).__module__.split(".")[0] == "rollfeed"


class Tally:
    """Outcome counts of one family and the first examples of each failure."""

    def __init__(self, family: str, workdir: Path, *, trace: bool) -> None:
        self.family, self.counts = family, dict.fromkeys(OUTCOMES, 0)
        self.examples: list[dict] = []
        self.progress = open(workdir / "progress.txt", "w")  # noqa: SIM115
        signal.signal(signal.SIGALRM, _alarm)
        if trace:  # 2-5x slower reads: only where size claims are the attack
            tracemalloc.start()

    def case(self, desc: str, attack: Callable[[], object], *, refusal_ok: bool = True) -> str:
        """Run one attack; ``refusal_ok=False`` when a typed error is itself a failure."""
        self.progress.write(desc[:300] + "\n")
        self.progress.flush()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        detail = ""
        bound = CASE_BOUND_S if self.counts["hang"] < HANGS_BEFORE_SHORTER else 0.3
        signal.setitimer(signal.ITIMER_REAL, bound)
        try:
            attack()
            outcome = "correct"
        except _Hang:
            outcome = "hang"
        except Wrong as err:
            outcome, detail = "wrong", str(err)
        except Escaped as err:
            outcome, detail = "escape", str(err)
        except MemoryError as err:
            outcome, detail = "overalloc", f"{type(err).__name__}: {err}"
        except BaseException as err:
            outcome = ("refused" if refusal_ok else "wrong") if typed(err) else "untyped"
            detail = f"{type(err).__module__}.{type(err).__name__}: {str(err)[:300]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1] - base
        peak = max(peak, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss)
        if peak > ALLOC_BOUND and outcome in ("correct", "refused"):
            outcome, detail = "overalloc", f"allocated {peak} bytes at peak ({detail})"
        self.counts[outcome] += 1
        if outcome in FAILURES:
            same = sum(e["outcome"] == outcome for e in self.examples)
            if same < 6:
                self.examples.append({"outcome": outcome, "case": f"{desc[:400]} -> {detail}"})
        return outcome

    def record(self, outcome: str, desc: str) -> None:
        """Count an outcome observed outside :meth:`case` (e.g. in a worker thread)."""
        self.counts[outcome] += 1
        if outcome in FAILURES and sum(e["outcome"] == outcome for e in self.examples) < 6:
            self.examples.append({"outcome": outcome, "case": desc[:500]})

    def summary(self) -> dict:
        out = {"family": self.family, "tried": sum(self.counts.values()), **self.counts}
        out["examples"] = self.examples
        return out
