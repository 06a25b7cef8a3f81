"""``tests.support.waiting.wait_until``: the tests' one bounded wait."""

from __future__ import annotations

import threading

import pytest

from tests.support.waiting import wait_until


def test_returns_the_predicates_first_truthy_value() -> None:
    answers = iter([None, 0, "", "here", "later"])
    assert wait_until(lambda: next(answers), 5, interval=0.001) == "here"


def test_sees_what_another_thread_brings_about() -> None:
    done: list[int] = []
    threading.Timer(0.05, done.append, (7,)).start()
    assert wait_until(lambda: done, 10, interval=0.01) == [7]


def test_raises_with_its_message_when_the_state_never_comes() -> None:
    calls: list[None] = []
    with pytest.raises(AssertionError, match="the door never opened"):
        wait_until(lambda: calls.append(None), 0.1, interval=0.01, message="the door never opened")
    assert len(calls) >= 2  # polled, and once more at the deadline


def test_names_the_predicate_without_a_message() -> None:
    def door_open() -> bool:
        return False

    with pytest.raises(AssertionError, match="door_open"):
        wait_until(door_open, 0.05, interval=0.01)
