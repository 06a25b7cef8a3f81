"""The retention policy: which complete checkpoints ``keep_last`` / ``keep_every`` keep.

Pure: a function of the list of complete steps. What storage does with the answer (reader leases,
the ``REMOVING`` tombstone, deletion) is :mod:`astate_store.checkpoint.leases`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from astate_store.errors import CheckpointError

__all__ = ["RetentionPolicy", "keep_reasons"]

#: ``keep_reasons`` value of a step the policy would remove.
REMOVE = "remove"


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the ``keep_last`` newest complete checkpoints and, with ``keep_every=K``, the oldest
    complete checkpoint of every window of ``K`` steps (``[0, K)``, ``[K, 2K)``, ...): when
    checkpoints are written at multiples of ``K`` those are exactly the steps ``n * K``.

    The newest complete checkpoint is always kept (``keep_last >= 1``)."""

    keep_last: int
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name, v, least in (("keep_last", self.keep_last, 1), ("keep_every", self.keep_every, 1)):
            if v is None and name == "keep_every":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise CheckpointError(f"{name} must be an int >= {least}, got {v!r}")

    @classmethod
    def of(cls, keep_last: Any, keep_every: Any = None) -> RetentionPolicy | None:
        """The policy of ``Store.checkpoint``'s arguments; None when neither is given (keep all).

        Raises:
            CheckpointError: a bad value, or ``keep_every`` without ``keep_last``.
        """
        if keep_last is None:
            if keep_every is not None:
                raise CheckpointError("keep_every needs keep_last (the newest checkpoints to keep as well)")
            return None
        return cls(keep_last, keep_every)


def keep_reasons(steps: Sequence[int], policy: RetentionPolicy, upto: int | None = None) -> dict[int, str]:
    """Step -> why the policy keeps it (``"newest"``, ``"last N"``, ``"every K"``, ``"newer"``)
    or ``"remove"``, for every step of ``steps`` (complete checkpoints, any order).

    ``upto``: the checkpoint just completed; steps above it (written by someone else meanwhile)
    are kept as ``"newer"`` and only older ones can be removed.
    """
    ordered = sorted(set(steps))
    last = set(ordered[-policy.keep_last :])
    first_of_window: set[int] = set()
    if policy.keep_every is not None:
        seen: set[int] = set()
        for s in ordered:
            w = s // policy.keep_every
            if w not in seen:
                seen.add(w)
                first_of_window.add(s)
    out = {}
    for s in ordered:
        if ordered and s == ordered[-1]:
            out[s] = "newest"
        elif upto is not None and s > upto:
            out[s] = "newer"
        elif s in last:
            out[s] = f"last {policy.keep_last}"
        elif s in first_of_window:
            out[s] = f"every {policy.keep_every}"
        else:
            out[s] = REMOVE
    return out
