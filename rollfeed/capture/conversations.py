"""Where a conversation's next turn goes: the same sample when its prompt extends the last turn.

An agent on vLLM's OpenAI endpoints sends each turn as a whole new prompt (a chat request is
rendered by the model's template), not as new tokens after the last ones. A turn continues the
conversation's current sample when its prompt starts with the previous turn's prompt and
completion, token for token; the turn then starts at ``prompt_start = len(history)``, exactly as
:meth:`~rollfeed.orchestrator.Rollout.add` stitches turns. A prompt that does not (Qwen3's
template drops earlier ``<think>`` blocks; an agent edits its history; text that tokenizes
otherwise when rendered again) cannot be stitched: under ``policy="error"`` it is a
:class:`TurnPrefixError` before the engine runs, under ``"repair"`` it starts a new sample of the
conversation at ``prompt_start = 0``, counted (``restarted``).

:func:`place_turn` is the pure rule; :class:`Conversations` holds each conversation's history
(the last turn's prompt and completion), one turn at a time, at most ``max_conversations`` of
them (the least recently used are forgotten; a forgotten conversation's next turn starts at
sample 0 again, which the client's :class:`~rollfeed.orchestrator.OpenAIRollouts` refuses).

Example: history ``[1, 2, 3, 7, 8]`` (prompt ``[1, 2, 3]``, completion ``[7, 8]``) and the next
prompt ``[1, 2, 3, 7, 8, 4, 5]`` -> ``TurnPlace(sample=0, turn=1, prompt_start=5)``; the next
prompt ``[1, 2, 3, 4, 5]`` -> ``TurnPlace(sample=1, turn=0, prompt_start=0, restarted=True)``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from rollfeed.capture.errors import CaptureRequestError, TurnPrefixError

logger = logging.getLogger(__name__)

MAX_CONVERSATIONS = 65536


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnPlace:
    """Where one turn goes: its conversation's ``sample``, its ``turn`` there, its first position
    ``prompt_start``, and whether it began a new sample because its prompt did not extend."""

    sample: int = 0
    turn: int = 0
    prompt_start: int = 0
    restarted: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class _History:
    tokens: tuple[int, ...]  # the last turn's prompt and completion
    place: TurnPlace


def place_turn(last: _History | None, prompt_ids: Sequence[int]) -> TurnPlace:
    """Where a turn with ``prompt_ids`` goes after ``last`` (None: the conversation's first)."""
    if last is None:
        return TurnPlace()
    n = len(last.tokens)
    if len(prompt_ids) >= n and tuple(prompt_ids[:n]) == last.tokens:
        return TurnPlace(sample=last.place.sample, turn=last.place.turn + 1, prompt_start=n)
    return TurnPlace(sample=last.place.sample + 1, restarted=True)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class Conversations:
    """The histories of the conversations a server captures (see module doc); thread-safe."""

    def __init__(self, *, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.max_conversations = max_conversations
        self._last: OrderedDict[str, _History | None] = OrderedDict()  # None: first turn
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self.metrics = {"turns": 0, "restarted": 0, "forgotten": 0}

    def begin(self, conversation: str, prompt_ids: Sequence[int], *, policy: str) -> TurnPlace:
        """Place the next turn of ``conversation``; it is that conversation's running turn until
        :meth:`finish` or :meth:`abort`."""
        with self._lock:
            if conversation in self._busy:
                raise CaptureRequestError(
                    f"conversation {conversation!r} already has a turn running; send its turns "
                    "one after the other (each prompt extends the last answer)"
                )
            last = self._last.get(conversation)
            place = place_turn(last, prompt_ids)
            if place.restarted:
                assert last is not None
                at = _first_difference(last.tokens, prompt_ids)
                why = (
                    f"the prompt of turn {last.place.turn + 1} of conversation {conversation!r} "
                    f"does not extend its previous prompt and completion ({len(last.tokens)} "
                    f"tokens): they differ from position {at} on"
                )
                if policy == "error":
                    raise TurnPrefixError(
                        f"{why}; its tokens cannot be stitched into one sample (a chat template "
                        "that drops earlier reasoning does this): send policy 'repair' to start "
                        "a new sample there",
                        turn=last.place.turn + 1,
                        pos=at,
                    )
                self.metrics["restarted"] += 1
                logger.info("%s; sample %d starts", why, place.sample)
            self._busy.add(conversation)
            self._last[conversation] = last
            self._last.move_to_end(conversation)
            self.metrics["turns"] += 1
            return place

    def finish(self, conversation: str, place: TurnPlace, tokens: Sequence[int]) -> None:
        """The turn placed at ``place`` ended with ``tokens`` (its prompt and completion)."""
        with self._lock:
            self._busy.discard(conversation)
            self._last[conversation] = _History(tokens=tuple(int(t) for t in tokens), place=place)
            self._last.move_to_end(conversation)
            idle = [c for c in self._last if c not in self._busy]
            for name in idle[: max(len(self._last) - self.max_conversations, 0)]:
                del self._last[name]
                self.metrics["forgotten"] += 1

    def abort(self, conversation: str) -> None:
        """The running turn failed: the conversation keeps its previous history."""
        with self._lock:
            self._busy.discard(conversation)
            if self._last.get(conversation, 0) is None:  # a first turn that never finished
                del self._last[conversation]
