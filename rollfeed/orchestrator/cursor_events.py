"""What a producer's cursor records, and the state those records add up to (no files here).

Five kinds of record (frozen pydantic models, one JSON object each in the cursor log), in the
order a step lives them:

- :class:`StepBegun` ``step``: the prompt ids the step takes, in order, and the group size: which
  step each prompt went to;
- :class:`TurnSent`: turn ``turn`` of rollout ``(prompt, sample)`` was sent to the server;
- :class:`TurnDone`: its answer came back: the new prompt tokens the turn added and the server's
  :class:`~rollfeed.capture.protocol.GenerateResponse` (segment records, not payload bytes);
- :class:`RolloutDone`: the rollout is finished, with its reward;
- :class:`StepWritten`: the step file is in place, holding ``samples`` samples.

:class:`CursorState` replays them (:meth:`CursorState.apply`, record by record, refusing one that
contradicts what came before with :class:`~rollfeed.orchestrator.errors.CursorCorruptError`).
What a restarted producer does follows from it: a written step is done; a finished rollout is
never sampled again; a rollout with recorded turns continues from its next turn; a turn sent but
not answered (in flight at the crash) is sent again (``resent`` counts them).

Example: records ``begun(step 0, ["p0"], group 2)``, ``sent(p0/0 turn 0)``, ``done(p0/0 turn
0)``, ``finished(p0/0, reward 1.0)``, ``sent(p0/1 turn 0)`` -> rollout ``p0/0`` finished,
``p0/1`` in flight (to send again), step 0 not written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from rollfeed.capture.protocol import GenerateResponse
from rollfeed.orchestrator.errors import CursorCorruptError

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class StepBegun(BaseModel):
    model_config = _FROZEN
    kind: Literal["begun"] = "begun"
    step: StrictInt = Field(ge=0)
    prompts: list[str] = Field(min_length=1)
    group_size: StrictInt = Field(ge=1)


class _OfSample(BaseModel):
    """What every event of one rollout names: its step, prompt id and sample index."""

    model_config = _FROZEN
    step: StrictInt
    prompt: str
    sample: StrictInt


class TurnSent(_OfSample):
    kind: Literal["sent"] = "sent"
    turn: StrictInt


class TurnDone(_OfSample):
    kind: Literal["done"] = "done"
    turn: StrictInt
    new_ids: list[StrictInt]
    response: GenerateResponse


class RolloutDone(_OfSample):
    kind: Literal["finished"] = "finished"
    reward: float


class StepWritten(BaseModel):
    model_config = _FROZEN
    kind: Literal["written"] = "written"
    step: StrictInt
    samples: StrictInt


CursorEvent = Annotated[
    StepBegun | TurnSent | TurnDone | RolloutDone | StepWritten, Field(discriminator="kind")
]


class _Record(BaseModel):
    """The JSON object of one cursor record."""

    model_config = _FROZEN
    event: CursorEvent


def encode_event(event: StepBegun | TurnSent | TurnDone | RolloutDone | StepWritten) -> bytes:
    return _Record(event=event).model_dump_json().encode()


def decode_event(payload: bytes, *, seq: int, name: str):
    try:
        return _Record.model_validate_json(payload).event
    except ValueError as err:
        raise CursorCorruptError(
            f"cursor record {seq} checks out but is not a cursor event ({err}); was the log "
            "written by another rollfeed version?",
            file=name,
            record=seq,
        ) from None


@dataclass(kw_only=True, slots=True)
class RolloutState:
    """One rollout ``(prompt, sample)`` of a step: its answered ``turns`` (new ids, response),
    the turns ``sent`` (one more than answered while one is in flight) and its ``reward`` once
    finished."""

    turns: list[tuple[list[int], GenerateResponse]] = field(default_factory=list)
    sent: int = 0
    reward: float | None = None

    @property
    def finished(self) -> bool:
        return self.reward is not None


@dataclass(kw_only=True, slots=True)
class StepState:
    """One begun step: its ``prompts`` and ``group_size``, each rollout's state, and whether its
    file is written (with how many samples)."""

    prompts: list[str]
    group_size: int
    rollouts: dict[tuple[str, int], RolloutState]
    written: int | None = None

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.rollouts.values())


@dataclass(kw_only=True, slots=True)
class CursorState:
    """The steps the records add up to (see the module doc)."""

    steps: dict[int, StepState] = field(default_factory=dict)
    name: str = ""

    def apply(self, event, seq: int) -> None:
        """Add record ``seq``; a record that contradicts the earlier ones is refused."""
        why = self.contradiction(event)
        if why is not None:
            raise CursorCorruptError(
                f"cursor record {seq} ({event.kind}) contradicts the records before it: {why}",
                file=self.name,
                record=seq,
                step=event.step,
                prompt=getattr(event, "prompt", None),
                sample=getattr(event, "sample", None),
            )
        if isinstance(event, StepBegun):
            keys = [(p, s) for p in event.prompts for s in range(event.group_size)]
            self.steps[event.step] = StepState(
                prompts=list(event.prompts),
                group_size=event.group_size,
                rollouts={k: RolloutState() for k in keys},
            )
            return
        step = self.steps[event.step]
        if isinstance(event, StepWritten):
            step.written = event.samples
            return
        rollout = step.rollouts[(event.prompt, event.sample)]
        if isinstance(event, TurnSent):
            rollout.sent = event.turn + 1
        elif isinstance(event, TurnDone):
            rollout.turns.append((list(event.new_ids), event.response))
        else:
            rollout.reward = event.reward

    def contradiction(self, event) -> str | None:
        """Why ``event`` cannot follow the records so far, or ``None`` when it can."""
        if isinstance(event, StepBegun):
            if event.step in self.steps:
                return f"step {event.step} was begun before"
            if len(set(event.prompts)) != len(event.prompts):
                return "a prompt id appears twice in one step"
            return None
        step = self.steps.get(event.step)
        if step is None:
            return f"step {event.step} was never begun"
        if step.written is not None:
            return f"step {event.step} was written already"
        if isinstance(event, StepWritten):
            return None if step.finished else "not every rollout of the step is finished"
        rollout = step.rollouts.get((event.prompt, event.sample))
        if rollout is None:
            return f"the step has no rollout {event.prompt!r}/{event.sample}"
        if rollout.finished:
            return "the rollout was finished already"
        if isinstance(event, TurnSent):
            return None if event.turn == len(rollout.turns) else "a turn out of order"
        if isinstance(event, TurnDone):
            ok = event.turn == len(rollout.turns) == rollout.sent - 1
            return None if ok else "an answer to a turn that was not the one sent"
        return None if rollout.turns else "a rollout finished without a turn"

    def in_flight(self) -> list[tuple[int, str, int]]:
        """``(step, prompt, sample)`` of every rollout whose last turn was sent, not answered."""
        return [
            (k, p, s)
            for k, step in self.steps.items()
            for (p, s), r in step.rollouts.items()
            if not r.finished and r.sent > len(r.turns)
        ]
