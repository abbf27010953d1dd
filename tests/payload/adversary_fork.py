"""The fork family: processes forked around object-store use, each child under a hard wall-clock
bound, against the session's S3 server.

obstore's runtime does not survive ``fork``
(:mod:`rollfeed.payload.stores.object_runtime`): a child forked after its parent's first request
must get a typed refusal at once, whatever it builds (the parent's root, a new root, a writer, a
step store, a listing, a prune), and a child forked before any request must get exactly the
data, as must its own children. Every operation runs in a grandchild of the family's process,
forked by a *setup* child that first does one thing with the store (nothing, build a client
without a request, read, write, list, prune, read while threads keep requesting at the fork,
list a step store, which speaks botocore only) — the family's own process makes no request, so
each setup starts from a process whose runtime never ran. Some operations fork once more (a
child's child), and one setup forks its child before its own first request.

Outcomes: ``correct`` for exactly the data written; ``refused`` for the typed refusal where the
runtime was inherited; ``wrong`` for a refusal where it was not (a false refusal), another error
there, or other data; ``hang`` for a child killed at its bound (the configured
``RETRY_TIMEOUT_S``: an answer comes within the root's own timeouts or not at all; once one
child of a setup hung, the next get ``SHORT_S``, so a broken build still ends in time).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.payload.adversary_tally import Tally
from tests.payload.forked import run_forked

TIMEOUT_S, RETRY_TIMEOUT_S = 2.0, 4.0  # the roots' bounds; a child's answer comes within them
BOUND_S = RETRY_TIMEOUT_S + 2.0  # a child that itself waits for a child bounded by RETRY_TIMEOUT_S
SHORT_S = 0.5  # a child's bound once one child of its setup hung (each answers in milliseconds)


def _rows(n: int, seed: int) -> np.ndarray:
    return (np.arange(n * 4).reshape(n, 2, 2) * (seed + 1) % 200).astype(np.int64)


def _read(root, segs, n: int) -> np.ndarray:
    from rollfeed.payload import read_fields

    return read_fields(segs, {"routed_experts": (0, n)}, root=root)["routed_experts"].values.numpy()


def _written(root, group: str, seed: int) -> tuple[list, np.ndarray]:
    from rollfeed.payload import PayloadWriter

    rows = _rows(7 + seed % 5, seed)
    with PayloadWriter(root, group=group, name="w") as w:
        return w.write({"routed_experts": rows}, pos=0), rows


class _Store:
    """The family's prefix of the session's bucket, its data and how to reach it."""

    def __init__(self, base: str) -> None:
        self.base, self.steps = base, f"{base}/steps"

    def root(self):
        from rollfeed.payload import PayloadRoot

        return PayloadRoot(self.base, timeout_s=TIMEOUT_S, retry_timeout_s=RETRY_TIMEOUT_S)

    def step_store(self):
        from rollfeed.loaders import RolloutDataset

        bounds = {"timeout_s": TIMEOUT_S, "retry_timeout_s": RETRY_TIMEOUT_S}
        return RolloutDataset.from_step_dir(self.steps, store=bounds)


def _check(got: np.ndarray, want: np.ndarray, what: str) -> str:
    if got.shape != want.shape or not np.array_equal(got, want):
        said, wrote = got.ravel()[:8].tolist(), want.ravel()[:8].tolist()
        return f"wrong: {what} read {said}..., wrote {wrote}..."
    return "data"


def _operations(store: _Store, held, data, rng: np.random.Generator) -> dict[str, Callable]:
    """What a child does, each returning ``"data"`` or ``"wrong: ..."`` (or raising)."""
    segs, rows = data
    seed = int(rng.integers(1 << 20))

    def same_root():
        return _check(_read(held, segs, len(rows)), rows, "the parent's root")

    def fresh_root():
        return _check(_read(store.root(), segs, len(rows)), rows, "a new root")

    def same_root_writer():
        mine, want = _written(held, f"c{seed}", seed)
        return _check(_read(held, mine, len(want)), want, "the parent's root, written")

    def fresh_writer():
        root = store.root()
        mine, want = _written(root, f"d{seed}", seed + 1)
        return _check(_read(root, mine, len(want)), want, "a new root, written")

    def listing():
        found = [f.rel for f in store.root().store.listing(".rfp")[0]]
        return "data" if segs[0].file in found else f"wrong: listing {found} lacks {segs[0].file}"

    def prune():
        root = store.root()
        _written(root, f"p{seed}", seed + 2)
        root.prune(f"p{seed}")
        left = [f.rel for f in root.store.listing(".rfp")[0] if f.rel.startswith(f"p{seed}/")]
        return "data" if not left else f"wrong: prune left {left}"

    def step_store():
        steps = store.step_store()
        got, lengths = steps.steps_from(0), steps.lengths(1).tolist()
        ok = got == [1] and lengths == [3, 4]
        return "data" if ok else f"wrong: steps {got}, lengths {lengths}"

    def nested(op):  # a child's child: what it gets is its parent's due
        return lambda: ("a child's child", *run_forked(op, RETRY_TIMEOUT_S - 1))

    return {
        "the parent's root": same_root,
        "a new root": fresh_root,
        "a writer on the parent's root": same_root_writer,
        "a writer on a new root": fresh_writer,
        "a listing": listing,
        "a prune": prune,
        "a step store": step_store,
        "a child's child, a new root": nested(fresh_root),
        "a child's child, the first parent's root": nested(same_root),
    }


def _verdict(kind: str, value: Any, inherited: bool) -> tuple[str, str]:
    """The outcome of one child's answer (see the module doc)."""
    if kind == "done" and isinstance(value, tuple):  # a child's child answered
        kind, value = value[1:]
    if kind == "done":
        return ("correct", "") if value == "data" else ("wrong", str(value))
    if kind == "raised":
        module, name, message, was_typed = value
        refusal = was_typed and name == "PayloadInputError" and "forkserver" in message
        if inherited and refusal:
            return "refused", ""
        why = "a false refusal" if refusal else "an error"
        return ("wrong" if was_typed else "untyped"), f"{why}: {module}.{name}: {message[:200]}"
    return ("hang" if kind == "hang" else "untyped"), f"{kind} {value}"


def _setup(name: str, store: _Store, data) -> tuple[Any, bool, Callable[[], object] | None]:
    """``(root, inherited, after)``: the setup's root (held by its children), whether a child
    forked now inherits a started runtime, and the requests a parent makes after forking a
    child (``None``: none; the setup that forks before its first request)."""
    root = store.root()
    segs, rows = data
    keep_going = threading.Event()

    def reads_on_threads():  # requests in flight on other threads at each fork
        def loop():
            while not keep_going.is_set():
                _read(root, segs, len(rows))

        for _ in range(2):
            threading.Thread(target=loop, daemon=True).start()
        time.sleep(0.05)

    steps = {
        "nothing": (lambda: None, False),
        "a client, no request": (lambda: root.store.client.process(), False),
        "a step store listing (botocore only)": (lambda: store.step_store().steps_from(0), False),
        "a read": (lambda: _read(root, segs, len(rows)), True),
        "a write": (lambda: _written(root, "s", 3), True),
        "a listing": (lambda: root.store.listing(".rfp"), True),
        "a prune": (lambda: (_written(root, "q", 4), root.prune("q")), True),
        "a read, threads still reading": (reads_on_threads, True),
        "nothing, then reads after the fork": (lambda: None, False),
    }
    first, inherited = steps[name]
    first()
    after = (lambda: _read(root, segs, len(rows))) if name.endswith("after the fork") else None
    return root, inherited, after


SETUPS = (
    "nothing",
    "a client, no request",
    "a step store listing (botocore only)",
    "a read",
    "a write",
    "a listing",
    "a prune",
    "a read, threads still reading",
    "nothing, then reads after the fork",
)


def _in_setup(name: str, store: _Store, data, seed: int) -> list[tuple[str, str, str]]:
    """In a setup child: every operation in a child of its own; ``(operation, outcome, why)``."""
    rng = np.random.default_rng(seed)
    root, inherited, after = _setup(name, store, data)
    out: list[tuple[str, str, str]] = []
    for op_name, op in _operations(store, root, data, rng).items():
        hung = any(outcome == "hang" for _, outcome, _ in out)
        bound = SHORT_S if hung else RETRY_TIMEOUT_S  # after a hang: the family stays in budget
        if after is None:
            kind, value = run_forked(op, bound)
        else:  # a parent of its own per operation, whose requests come after its fork
            wrapped = functools.partial(_fork_then_request, op, after)
            kind, value = run_forked(wrapped, bound + BOUND_S - RETRY_TIMEOUT_S)
            if kind == "done":
                kind, value = value
        out.append((op_name, *_verdict(kind, value, inherited)))
    return out


def _fork_then_request(op: Callable, requests: Callable[[], object]) -> tuple:
    """``op`` in a child forked before this process's first request, run once this process
    made ``requests``: its parent's runtime starting later is none of the child's."""
    go_r, go_w = os.pipe()

    def when_told():
        os.read(go_r, 1)
        return op()

    def parent_turn():
        requests()
        os.write(go_w, b"x")

    return run_forked(when_told, RETRY_TIMEOUT_S, then=parent_turn)


def family_fork(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Every setup against every operation (see the module doc)."""
    import botocore.session  # noqa: F401  (imported once here, not in every child)
    import obstore  # noqa: F401  (importing starts no runtime: only a request does)

    from tests.object_store_server import BUCKET

    store = _Store(f"s3://{BUCKET}/adversary-fork-{os.getpid()}-{int(rng.integers(1 << 30))}")
    made = run_forked(lambda: _seed_data(store), RETRY_TIMEOUT_S * 2, own_group=True)
    if made[0] != "done":
        tally.record("untyped", f"fork: writing the family's data failed: {made}")
        return
    data = made[1]
    bound = BOUND_S * (len(_operations(store, None, data, rng)) + 1)
    for name in SETUPS:
        seed = int(rng.integers(1 << 30))
        setup = functools.partial(_in_setup, name, store, data, seed)
        kind, value = run_forked(setup, bound, own_group=True)
        if kind != "done":
            outcome = "hang" if kind == "hang" else "untyped"
            tally.record(outcome, f"fork: setup {name}: {kind} {value}")
            continue
        for op_name, outcome, why in value:
            tally.record(outcome, f"fork: after {name}, {op_name} -> {why}")


def _seed_data(store: _Store):
    from rollfeed.loaders import write_step_file
    from tests.payload.adversary_stores import _samples

    write_step_file(store.steps, 1, _samples())
    return _written(store.root(), "g", 0)
