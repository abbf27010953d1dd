"""Attack families against payload files, records, stores and step lines, run in a bounded
child process.

``python -m tests.payload.adversary FAMILY WORKDIR SEED`` runs one family and prints one JSON
summary line; :func:`run_family` starts that child under ``RLIMIT_AS`` and a wall-clock bound, so a
hang or a memory bomb fails the calling test instead of the suite. An object-store family reaches
the session's S3 server through the ``AWS_*`` variables :func:`run_family` passes on.

Each family lives in a module of its own concern beside this one; what they share is the outcome
count (:mod:`tests.payload.adversary_tally`: correct, refused, wrong, hang, escape, untyped,
overalloc), the oracle (:mod:`tests.payload.adversary_oracle`: the writer's own arrays) and the
corpus (:mod:`tests.payload.adversary_corpus`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.capture.adversary_capture import family_capture_settings
from tests.cli.adversary_cli import family_cli_steps
from tests.collate.tree_attacks import family_trees
from tests.loaders.guard_attacks import family_step_guards
from tests.loaders.run_attacks import family_loss_runs
from tests.loaders.state_attacks import family_loader_states
from tests.loaders.step_attacks import family_step_replace
from tests.loaders.tree_index_attacks import family_tree_index
from tests.objectives.adversary_objectives import family_objectives
from tests.orchestrator.cursor_attacks import family_cursor
from tests.payload.adversary_bounds import family_bounds
from tests.payload.adversary_files import family_bytes, family_memory, family_truncation
from tests.payload.adversary_fork import family_fork
from tests.payload.adversary_media import family_media
from tests.payload.adversary_ragged import family_ragged_rows
from tests.payload.adversary_records import family_records
from tests.payload.adversary_steps import family_steps
from tests.payload.adversary_stores import family_stores
from tests.payload.adversary_tally import OUTCOMES, Tally
from tests.payload.adversary_versions import family_versions
from tests.payload.adversary_writers import family_kill, family_races

REPO = Path(__file__).resolve().parents[2]
AS_LIMIT = 1 << 30  # the child imports torch in ~650 MiB of address space; measured, it fits
# glibc reserves 64 MiB of address space for each thread's malloc arena (up to 8 per core), which
# RLIMIT_AS counts as if allocated: the stores family (a proxy's threads, obstore's) peaked at
# 1017 MiB of its 1024 that way, and a thread more than usual could not start (a hang, or an abort
# from obstore's runtime). Two arenas: it peaks at ~790 MiB, and the limit bounds what is
# allocated, not how many threads ran.
ARENAS = {"MALLOC_ARENA_MAX": "2"}
STACKS = "stacks.txt"  # where a child that hangs writes every thread's stack


# --------------------------------------------------------------------------- parent side


def run_family(
    family: str,
    workdir: Path,
    *,
    seed: int = 15,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    as_limit: int = AS_LIMIT,
) -> dict:
    """Run one family in a child under ``RLIMIT_AS`` (``as_limit`` bytes) and ``timeout_s``; its
    summary as a dict. ``env``: variables added to the child's environment (the S3 server's
    ``AWS_*``).

    A child that runs past ``timeout_s`` or dies reports a hang / crash naming its last case (a
    hang with every thread's stack at the time, dumped by the child on ``SIGUSR1``).
    """
    progress = workdir / "progress.txt"
    cmd = [sys.executable, "-m", "tests.payload.adversary", family, os.fspath(workdir), str(seed)]
    child = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit)),
        env={**os.environ, **ARENAS, **(env or {})},
    )
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stacks = workdir / STACKS
        child.send_signal(signal.SIGUSR1)  # every thread's stack into STACKS (see main)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not (stacks.exists() and stacks.stat().st_size):
            time.sleep(0.05)
        child.kill()
        child.communicate()
        last = progress.read_text().splitlines()[-1:] if progress.exists() else []
        where = stacks.read_text()[-4000:] if stacks.exists() else "(no stacks written)"
        why = f"child ran past {timeout_s} s; last case: {last}; its threads then:\n{where}"
        return _broken(family, "hang", why)
    lines = out.strip().splitlines()
    if child.returncode != 0 or not lines:
        last = progress.read_text().splitlines()[-1:] if progress.exists() else []
        why = f"child exited {child.returncode}; last case {last}; stderr: {err[-3000:]}"
        return _broken(family, "untyped", why)
    return json.loads(lines[-1])


def _broken(family: str, outcome: str, why: str) -> dict:
    summary = {k: 0 for k in OUTCOMES}
    summary.update(family=family, tried=1, examples=[{"outcome": outcome, "case": why}])
    summary[outcome] = 1
    return summary


def format_summary(s: dict) -> str:
    counts = ", ".join(f"{k} {s[k]}" for k in OUTCOMES)
    lines = [f"[adversarial] {s['family']}: tried {s['tried']}: {counts}"]
    lines += [f"    {e['outcome']}: {e['case']}" for e in s["examples"]]
    return "\n".join(lines)


TRACED = ("memory", "steps", "bounds")
FAMILIES = {
    "records": family_records,
    "bytes": family_bytes,
    "truncation": family_truncation,
    "kill": family_kill,
    "races": family_races,
    "steps": family_steps,
    "memory": family_memory,
    "versions": family_versions,
    "stores": family_stores,
    "bounds": family_bounds,
    "step_replace": family_step_replace,
    "capture_settings": family_capture_settings,
    "loader_states": family_loader_states,
    "step_guards": family_step_guards,
    "objectives": family_objectives,
    "loss_runs": family_loss_runs,
    "cli_steps": family_cli_steps,
    "fork": family_fork,
    "ragged_rows": family_ragged_rows,
    "media": family_media,
    "trees": family_trees,
    "tree_index": family_tree_index,
    "cursor": family_cursor,
}


def main(argv: list[str]) -> None:
    family, workdir, seed = argv[0], Path(argv[1]), int(argv[2])
    stacks = open(workdir / STACKS, "w")  # noqa: SIM115  (open while the child runs)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    rng = np.random.default_rng([seed, *family.encode()])
    import rollfeed.cli
    import rollfeed.loaders  # noqa: F401  (imported before tracemalloc starts: imports are slow under it)

    tally = Tally(family, workdir, trace=family in TRACED)
    FAMILIES[family](tally, workdir, rng)
    print(json.dumps(tally.summary()))


if __name__ == "__main__":
    main(sys.argv[1:])
