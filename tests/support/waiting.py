"""The tests' one way to wait for something another thread or process brings about.

``wait_until(predicate, timeout)`` polls ``predicate`` until it returns a truthy value and returns
that value; past ``timeout`` seconds it raises ``AssertionError`` with ``message``, so a state that
never comes is a failure with a reason, never a hang and never a silent pass. Prefer a real event
(a ``threading.Event``, a queue, a process's exit) where the code under test offers one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.05, message: str | None = None
) -> T:
    """``predicate()``'s first truthy value, polled every ``interval`` seconds (checked once more at
    the deadline, so a slow last poll is not lost); ``AssertionError`` with ``message`` past
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(message or f"not within {timeout:g}s: {_name(predicate)}")
        time.sleep(min(interval, left))


def _name(predicate: Callable[[], object]) -> str:
    return getattr(predicate, "__qualname__", None) or repr(predicate)
