"""What a producer checks before it resumes from a cursor: the same prompts, the same directory.

A cursor records which prompts each begun step took and the group size; a producer started again
with another prompt list, another ``prompts_per_step`` or ``group_size`` would write steps that
contradict the ones written (or silently skip prompts), so it is refused with
:class:`~rollfeed.orchestrator.errors.CursorMismatchError` naming the step and the first prompt
that differs. A step file in the directory that the cursor never began (another producer's, or a
cursor deleted) is refused the same way.

Example: the cursor began step 0 with ``["p0", "p1"]``; a producer whose step 0 takes
``["p0", "p2"]`` -> ``CursorMismatchError: step 0 took prompt 'p1' at 1, this producer gives it
'p2' [step=0, prompt=p1]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rollfeed.loaders.step_files import parse_step_name, step_root
from rollfeed.orchestrator.cursor_events import CursorState
from rollfeed.orchestrator.errors import CursorMismatchError
from rollfeed.orchestrator.groups import Prompt, step_prompts


def check_resume(
    state: CursorState,
    prompts: Sequence[Prompt],
    config: Any,
    directory: str | os.PathLike[str],
    store: Mapping[str, object] | None,
) -> None:
    """Refuse a cursor this producer cannot continue (see the module doc)."""
    for k in sorted(state.steps):
        step = state.steps[k]
        if step.group_size != config.group_size:
            raise CursorMismatchError(
                f"step {k} was begun with group size {step.group_size}, this producer's is "
                f"{config.group_size}",
                file=state.name,
                step=k,
            )
        want = [p.id for p in step_prompts(prompts, k, config.prompts_per_step)]
        if want != step.prompts:
            at = next(
                (i for i, (a, b) in enumerate(zip(step.prompts, want, strict=False)) if a != b),
                min(len(want), len(step.prompts)),
            )
            mine = want[at] if at < len(want) else "no prompt"
            theirs = step.prompts[at] if at < len(step.prompts) else None
            raise CursorMismatchError(
                f"step {k} took prompt {theirs!r} at {at}, this producer gives it {mine!r}: "
                "resume with the prompt list, prompts_per_step and group_size the run began with",
                file=state.name,
                step=k,
                prompt=theirs,
            )
    root = step_root(directory, store)
    try:
        listed = [parse_step_name(e.rel) for e in root.store.names("")]
    finally:
        root.close()
    stray = sorted(k for k in listed if k is not None and k not in state.steps)
    if stray:
        raise CursorMismatchError(
            f"the step directory holds the file of step {stray[0]}, which this cursor never "
            "began: another producer wrote here, or the cursor was deleted; give each run a step "
            "directory of its own",
            file=state.name,
            step=stray[0],
        )
