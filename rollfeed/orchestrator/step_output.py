"""A finished step's samples from its recorded rollouts, and its step file written or adopted.

Every sample of step ``k`` is rebuilt from the cursor's records alone
(:class:`~rollfeed.orchestrator.cursor_events.StepState`): each rollout's turns stitched by a
:class:`~rollfeed.orchestrator.Rollout`, its advantage its reward normalised within its prompt's
group (:func:`~rollfeed.orchestrator.groups.group_advantages`). Samples come in prompt order, then
sample order; each is named ``uid = "<prompt id>/<sample>"``, grouped by its prompt id with the
prompt's tokens as shared prefix (none for a sample with images: those are not packed as trees),
and carries the oldest policy version among its tokens when the server reported versions.

:func:`put_step` writes the step file whole (:class:`~rollfeed.loaders.StepWriter`), unless a
file of that step is there already: a producer that crashed after putting the file and before
recording it. That file is adopted when it holds exactly these samples (uids, tokens, advantages
and logprobs), and refused with :class:`~rollfeed.orchestrator.errors.CursorMismatchError`
otherwise; it is never replaced, since a trainer may be reading it.

Example: step 3 of prompts ``p6, p7``, group size 2 -> samples ``p6/0, p6/1, p7/0, p7/1``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.collate import Sample
from rollfeed.loaders import StepWriter, read_step_file, step_file_name
from rollfeed.loaders.step_files import listing_start, step_root
from rollfeed.orchestrator.client import Rollout
from rollfeed.orchestrator.cursor_events import RolloutState, StepState
from rollfeed.orchestrator.errors import CursorMismatchError
from rollfeed.orchestrator.groups import group_advantages


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepSample:
    """One sample of a step with what its step record keeps beside it."""

    sample: Sample
    group: str
    shared_prefix: int
    policy_version: int | None


def rebuild(state: RolloutState) -> Rollout:
    """The rollout its recorded turns make."""
    rollout = Rollout()
    for new_ids, response in state.turns:
        rollout.add(new_ids, response)
    return rollout


def step_samples(state: StepState, prompt_len: Mapping[str, int]) -> list[StepSample]:
    """The samples of a finished step (see the module doc)."""
    out = []
    for prompt in state.prompts:
        rollouts = [state.rollouts[(prompt, s)] for s in range(state.group_size)]
        advantages = group_advantages([r.reward for r in rollouts])  # type: ignore[misc]
        for s, (r, adv) in enumerate(zip(rollouts, advantages, strict=True)):
            sample = rebuild(r).sample(advantage=float(adv), uid=f"{prompt}/{s}")
            out.append(
                StepSample(
                    sample=sample,
                    group=prompt,
                    shared_prefix=0 if sample.images else prompt_len[prompt],
                    policy_version=None,
                )
            )
    return out


def _same(a: Sample, b: Sample) -> bool:
    return (
        a.uid == b.uid
        and np.array_equal(a.token_ids, b.token_ids)
        and np.array_equal(a.advantages, b.advantages)
        and np.array_equal(a.inference_logprobs, b.inference_logprobs)
    )


def put_step(
    directory: str | os.PathLike[str],
    step: int,
    samples: Sequence[StepSample],
    *,
    store: Mapping[str, object] | None = None,
    vocab_size: int | None = None,
    fsync: bool = True,
) -> bool:
    """Write step ``step``'s file, or adopt the one there (see the module doc); True when
    adopted."""
    root = step_root(directory, store)
    name = step_file_name(step)
    try:
        present = any(e.rel == name for e in root.store.names("", after=listing_start(step)))
        where = root.store.where(name)
    finally:
        root.close()
    if present:
        found = read_step_file(where, store=store)
        if len(found) != len(samples) or not all(
            _same(f, s.sample) for f, s in zip(found, samples, strict=False)
        ):
            raise CursorMismatchError(
                f"the step file holds {len(found)} samples that are not the {len(samples)} "
                "rollouts the cursor recorded for it: another producer wrote this step "
                "directory, or the cursor was replaced; give each run its own step directory",
                file=where,
                step=step,
            )
        return True
    options = {"vocab_size": vocab_size, "store": store, "fsync": "always" if fsync else "never"}
    with StepWriter(directory, step, **options) as writer:  # type: ignore[arg-type]
        for s in samples:
            writer.append(
                s.sample,
                group=s.group,
                shared_prefix=s.shared_prefix,
                policy_version=s.policy_version,
            )
    return False
