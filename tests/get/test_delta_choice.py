"""The choice between a pull's changes and a whole pull (``delta_choice``, get/delta_choice.py), from
the figures a consumer's pulls measured."""

from __future__ import annotations

from astate_store.get.delta_choice import DeltaChoice

BUFS = object()
MB = 1 << 20


def measured(delta_per_mb: float, whole: float) -> DeltaChoice:
    """A "time" choice that measured warm pulls both ways: ``delta_per_mb`` s per MB moved through
    changes, ``whole`` s per whole pull."""
    c = DeltaChoice("time")
    c.took_whole(BUFS, 4 * whole, warm=False)
    for _ in range(2):
        c.took_delta(BUFS, MB, delta_per_mb)
    c.took_whole(BUFS, whole, warm=True)
    return c


def test_by_bytes_always_goes_through_the_changes() -> None:
    c = DeltaChoice("bytes")
    c.took_whole(BUFS, 0.001, warm=True)
    c.took_delta(BUFS, MB, 10.0)
    c.took_delta(BUFS, MB, 10.0)
    assert c.whole_instead(BUFS, MB) is None


def test_the_delta_cost_is_learned_first_and_the_first_delta_pull_does_not_count() -> None:
    c = DeltaChoice("time")
    c.took_whole(BUFS, 0.2, warm=False)
    assert c.whole_instead(BUFS, MB) is None  # nothing known: through the changes
    c.took_delta(BUFS, MB, 5.0)  # the first (cold): not counted
    assert c.whole_instead(BUFS, MB) is None
    c.took_delta(BUFS, MB, 0.1)
    # a delta (0.1 s) not clearly below a quarter of the cold whole pull (0.2 s): measure a warm one
    assert "not been measured" in (c.whole_instead(BUFS, MB) or "")


def test_a_delta_far_below_a_cold_whole_pull_needs_no_warm_one() -> None:
    c = DeltaChoice("time")
    c.took_whole(BUFS, 1.0, warm=False)
    c.took_delta(BUFS, MB, 0.1)
    c.took_delta(BUFS, MB, 0.1)
    assert c.whole_instead(BUFS, MB) is None  # 0.1 * 4 <= 1.0


def test_the_faster_way_is_chosen_from_the_bytes_a_pull_would_move() -> None:
    c = measured(delta_per_mb=0.01, whole=0.05)
    assert c.whole_instead(BUFS, 2 * MB) is None  # 0.02 s against 0.05 s
    assert "expected faster" in (c.whole_instead(BUFS, 20 * MB) or "")  # 0.2 s against 0.05 s


def test_close_predictions_take_the_slower_way_now_and_then() -> None:
    c = measured(delta_per_mb=0.01, whole=0.012)
    picks = [c.whole_instead(BUFS, MB) for _ in range(16)]
    measuring = [p for p in picks if p is not None]
    assert len(measuring) == 2 and all("measuring" in p for p in measuring)
    far = measured(delta_per_mb=0.01, whole=0.05)
    assert all(far.whole_instead(BUFS, MB) is None for _ in range(16))


def test_new_buffers_start_again() -> None:
    c = measured(delta_per_mb=1.0, whole=0.01)
    assert c.whole_instead(BUFS, MB) is not None
    assert c.whole_instead(object(), MB) is None  # nothing known of these: through the changes
