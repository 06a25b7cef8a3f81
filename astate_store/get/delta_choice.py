"""Whether a pull into buffers that hold an older version goes through its changes or whole.

``delta_choice="bytes"`` (the default): through the changes whenever they are fewer bytes than the
buffers (``DeltaPulls`` checks that in any case). ``delta_choice="time"``: only when this consumer
has measured that way to be the faster one.

Why time: across hosts the bytes that changed are the limit, but on one host a whole pull is a
memory copy, and scattering the changes into the buffers costs about as much once more than about
1% of the elements changed (docs/delta.md, "What it costs": 0.045 s whole against 0.065 s through
2.2% of changes, over shm). Only the consumer's own pulls can tell which side of that line it is on.

What is measured (per set of buffers; new buffers start again):

- a delta pull: seconds per byte its records said it would move (index rows and encoded changes:
  known before any read, so that a pull that goes whole reads nothing first); the first one into a
  set of buffers builds its plan and maps fresh scratch, so only later ones count;
- a whole pull: seconds per pull. The first one into a set of buffers is cold (it maps the sources'
  memory and touches fresh pages: 2x to 3x a warm one over shm here), so it is kept apart, as an
  upper bound.

Call sequence (``DeltaPulls.pull``, once the chain and the plan are known):

1. :meth:`DeltaChoice.whole_instead`: None (through the changes) or why the pull goes whole;
2. the pull, either way; then :meth:`DeltaChoice.took_delta` or :meth:`DeltaChoice.took_whole`.

Each way's figure is a moving average (half the weight on the newest pull). Once both are known, one
choice in ``_EXPLORE`` takes the other way when the two predictions are within ``_CLOSE`` of each
other, so that a figure grown stale (the changed fraction falls as training goes on) is measured again.
"""

from __future__ import annotations

__all__ = ["DeltaChoice"]

_COLD = 4.0  # a cold whole pull costs at most this many times a warm one (2x to 3x measured)
_EXPLORE = 8  # with both ways measured, every 8th choice takes the slower way if they are close
_CLOSE = 1.5  # "close": the slower prediction within this factor of the faster
_NEW = 0.5  # weight of the newest pull in a moving average


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - _NEW) * old + _NEW * new


class DeltaChoice:
    """One consumer's figures for pulling each way into its current buffers, and the choice."""

    def __init__(self, by: str):
        self.by = by  # StoreOptions.delta_choice (checked there)
        self._buffers: object = None  # the buffers the figures are for (identity)
        self._reset()

    def _reset(self) -> None:
        self._deltas = 0  # delta pulls into them so far
        self._delta: float | None = None  # seconds per byte of changes, delta pulls after the first
        self._whole: float | None = None  # seconds per whole pull, warm ones
        self._whole_cold: float | None = None  # seconds of the first (cold) whole pull
        self._choices = 0  # choices made with both figures known

    def _for(self, buffers: object) -> None:
        if buffers is not self._buffers:
            self._reset()
            self._buffers = buffers

    def whole_instead(self, buffers: object, nbytes: int) -> str | None:
        """Why a pull into ``buffers`` whose changes take ``nbytes`` should go whole instead; None:
        through the changes."""
        if self.by == "bytes":
            return None
        self._for(buffers)
        if self._delta is None:
            return None  # its cost is not known yet: measure it
        delta = nbytes * self._delta
        if self._whole is None:
            if self._whole_cold is not None and delta * _COLD <= self._whole_cold:
                return None  # faster than even a warm whole pull could be
            return "a warm whole pull of these buffers has not been measured yet"
        whole = self._whole
        self._choices += 1
        explore = self._choices % _EXPLORE == 0 and max(delta, whole) <= _CLOSE * min(delta, whole)
        if (delta <= whole) != explore:
            return None
        if explore:
            return f"measuring a whole pull again ({whole:.4f} s, through changes {delta:.4f} s)"
        return f"a whole pull is expected faster ({whole:.4f} s, through changes {delta:.4f} s)"

    def took_delta(self, buffers: object, nbytes: int, seconds: float) -> None:
        """A delta pull into ``buffers`` whose changes took ``nbytes`` ran ``seconds``."""
        self._for(buffers)
        self._deltas += 1
        if self._deltas > 1 and nbytes > 0:
            self._delta = _average(self._delta, seconds / nbytes)

    def took_whole(self, buffers: object, seconds: float, warm: bool) -> None:
        """A whole pull into ``buffers`` took ``seconds``; ``warm``: they held the last pull."""
        self._for(buffers)
        if warm:
            self._whole = _average(self._whole, seconds)
        elif self._whole_cold is None:
            self._whole_cold = seconds
