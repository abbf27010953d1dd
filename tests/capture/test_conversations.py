"""Where a conversation's turns go (:mod:`rollfeed.capture.conversations`), without an engine."""

import pytest

from rollfeed.capture import CaptureError, TurnPrefixError
from rollfeed.capture.conversations import Conversations, TurnPlace


def test_a_prompt_that_extends_the_last_turn_continues_its_sample():
    book = Conversations()
    first = book.begin("c", [1, 2, 3], policy="error")
    assert first == TurnPlace()
    book.finish("c", first, [1, 2, 3, 7, 8])
    second = book.begin("c", [1, 2, 3, 7, 8, 4, 5], policy="error")
    assert second == TurnPlace(sample=0, turn=1, prompt_start=5)
    book.finish("c", second, [1, 2, 3, 7, 8, 4, 5, 9])
    # no new prompt token at all still extends (the turn is its completion alone)
    third = book.begin("c", [1, 2, 3, 7, 8, 4, 5, 9], policy="error")
    assert third == TurnPlace(sample=0, turn=2, prompt_start=8)
    assert book.metrics == {"turns": 3, "restarted": 0, "forgotten": 0}


@pytest.mark.parametrize(
    ("prompt", "at"),
    [
        ([1, 2, 3, 4, 5], 3),  # the completion [7, 8] was dropped (a template without <think>)
        ([1, 2, 3, 7], 4),  # shorter than the history
        ([1, 9, 3, 7, 8, 4], 1),  # an edited history
    ],
)
def test_a_prompt_that_does_not_extend_is_refused_or_starts_a_new_sample(prompt, at):
    book = Conversations()
    book.finish("c", book.begin("c", [1, 2, 3], policy="error"), [1, 2, 3, 7, 8])
    with pytest.raises(TurnPrefixError) as err:
        book.begin("c", prompt, policy="error")
    assert err.value.turn == 1 and err.value.pos == at
    assert f"differ from position {at} on" in str(err.value)
    # the refusal left the conversation as it was: its history still continues
    assert book.begin("c", [1, 2, 3, 7, 8, 6], policy="error").prompt_start == 5
    book.abort("c")
    place = book.begin("c", prompt, policy="repair")
    assert place == TurnPlace(sample=1, turn=0, prompt_start=0, restarted=True)
    book.finish("c", place, [*prompt, 11])
    assert book.begin("c", [*prompt, 11, 12], policy="repair") == TurnPlace(
        sample=1, turn=1, prompt_start=len(prompt) + 1
    )
    assert book.metrics["restarted"] == 1


def test_one_turn_at_a_time_and_a_failed_first_turn_leaves_nothing():
    book = Conversations()
    book.begin("c", [1, 2], policy="error")
    with pytest.raises(CaptureError, match="already has a turn running"):
        book.begin("c", [1, 2], policy="error")
    book.abort("c")
    assert book.begin("c", [5, 6], policy="error") == TurnPlace()  # still its first turn


def test_the_least_recently_used_idle_conversations_are_forgotten_beyond_the_bound():
    book = Conversations(max_conversations=2)
    for name in ("a", "b", "c"):
        book.finish(name, book.begin(name, [1], policy="error"), [1, 2])
    assert book.metrics["forgotten"] == 1
    assert book.begin("a", [1, 2, 3], policy="error") == TurnPlace()  # forgotten: a first turn
    assert book.begin("c", [1, 2, 3], policy="error").turn == 1
