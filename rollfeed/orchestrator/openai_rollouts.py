"""Rollouts from answers of vLLM's OpenAI endpoints that captured (a group in ``vllm_xargs``).

An agent framework on the plain ``openai`` client keeps the answers it got; each answer of a
capture request carries the records in its ``rollfeed`` field
(:class:`~rollfeed.capture.TurnCapture`) and the token ids vLLM returns with
``return_token_ids`` (which a capture request turns on). :class:`OpenAIRollouts` turns those
answers into :class:`~rollfeed.orchestrator.Rollout`\\ s: one per sample of each conversation
(``rollfeed_conversation``; a request without one is a rollout of its own, one per choice), the
turns stitched as :meth:`Rollout.add` stitches the capture route's answers.

Answers are added in the order they were answered within a conversation; every inconsistency is
a :class:`~rollfeed.capture.CaptureError` naming the conversation: a missing turn, an answer
whose ``sample`` skips one, token ids that differ from the records. ``metrics``: ``turns``,
``samples`` and ``restarted`` (samples begun because a turn did not extend the last one).

Example::

    rollouts = OpenAIRollouts()
    for answer in answers:                  # openai.types.Completion / ChatCompletion, or dicts
        rollouts.add(answer)
    samples = [r.sample(advantage=a) for r in rollouts.rollouts("p0")]   # one per sample
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rollfeed.capture.errors import CaptureError
from rollfeed.capture.protocol import CAPTURE_FIELD, XARG_GROUP, TurnCapture
from rollfeed.orchestrator.client import Rollout


def _as_dict(answer: Any) -> dict[str, Any]:
    if isinstance(answer, dict):
        return answer
    if hasattr(answer, "model_dump"):  # the openai client's models keep vLLM's extra fields
        return answer.model_dump()
    raise CaptureError(f"an answer is a dict or an openai response object, not {type(answer)}")


class OpenAIRollouts:
    """The rollouts of OpenAI answers that captured, by conversation (see module doc)."""

    def __init__(self) -> None:
        self._by_key: dict[str, list[Rollout]] = {}
        self.metrics = {"turns": 0, "samples": 0, "restarted": 0}

    def add(self, answer: Any, *, index: int = 0) -> Rollout:
        """Add choice ``index`` of ``answer`` as its conversation's next turn; its rollout."""
        data = _as_dict(answer)
        try:
            record = TurnCapture.model_validate(data[CAPTURE_FIELD])
        except KeyError:
            raise CaptureError(
                f"the answer {data.get('id')!r} has no {CAPTURE_FIELD!r} field: its request named "
                f"no capture group (vllm_xargs {XARG_GROUP}) or the server is not rollfeed's"
            ) from None
        except ValidationError as err:
            raise CaptureError(
                f"the answer's {CAPTURE_FIELD!r} field is malformed: {err.errors()[0]['msg']}"
            ) from None
        choices = data.get("choices") or []
        if not 0 <= index < len(choices):
            raise CaptureError(f"choice {index} of an answer with {len(choices)}")
        choice = choices[index]
        prompt = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
        key = record.conversation or f"{record.request_id}/{index}"
        c = next((c for c in record.completions if c.index == choice.get("index", index)), None)
        if prompt is None or c is None or choice.get("token_ids") != c.token_ids:
            raise CaptureError(
                f"conversation {key!r}: the answer's token ids do not match its records (was "
                "the answer changed, or its request sent without return_token_ids?)",
                turn=record.turn,
            )
        samples = self._by_key.setdefault(key, [])
        if record.sample == len(samples) and record.turn == 0:
            samples.append(Rollout())
            self.metrics["samples"] += 1
            self.metrics["restarted"] += int(record.restarted)
        rollout = samples[record.sample] if record.sample < len(samples) else None
        if rollout is None or record.sample < len(samples) - 1 or record.turn != len(rollout.turns):
            have = len(samples[-1].turns) if samples else 0
            raise CaptureError(
                f"conversation {key!r}: the answer is turn {record.turn} of sample "
                f"{record.sample}, the rollouts hold {len(samples)} samples, the last of "
                f"{have} turns; add a conversation's answers in order, each once (a server that "
                "forgot the conversation, or another server, starts it again at sample 0)",
                turn=record.turn,
            )
        rollout.add(prompt[record.prompt_start :], record, index=record.completions.index(c))
        self.metrics["turns"] += 1
        return rollout

    def rollouts(self, conversation: str) -> list[Rollout]:
        """The rollouts of ``conversation`` (of ``"<request id>/<choice>"`` without one), one per
        sample in order."""
        if conversation not in self._by_key:
            raise CaptureError(f"no answer of conversation {conversation!r} was added")
        return list(self._by_key[conversation])

    @property
    def conversations(self) -> list[str]:
        return list(self._by_key)
