"""Faults that fit in ``make test``: one trial each of the cases of ``benchmarks/fault_suite.py``
(publisher SIGKILL mid-pull with and without re-serving replicas, consumer SIGKILL mid-pull, zombie
writes, consumer churn, hostile records and API input, a short decoder fuzz, a 50-step soak).

Real etcd, real UCX, separate processes (the suite's actors). Every case must end with no wrong
bytes, no hang, no lost version and no untyped crash, and every trial correct or a typed error.
The soak reports its slopes and bounds the absolute growth over the run; there are no timing
asserts.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

_BENCH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"
)
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

import fault_suite  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# One bad record per key family (the suite writes all of them).
RECORDS = (
    "epoch_garbage",
    "session_garbage",
    "member_own_garbage",
    "manifest_wrong_content",
    "layout_garbage",
    "replica_layout_garbage",
    "piece_non_numeric_key",
    "piece_offset_out_of_range",
    "commit_garbage",
    "commits_index_garbage_key",
    "replica_garbage",
    "latest_garbage",
    "reader_leaseless",
    "consumer_pack_wrong_ndim",
    "retired_garbage",
    "torn_garbage",
    "checkpoint_garbage",
    "version_key_not_utf8",
    "manifest_key_not_utf8",
)


@pytest.fixture(scope="module")
def suite(etcd: Any) -> Iterator[fault_suite.Suite]:
    s = fault_suite.Suite(
        endpoint=etcd.endpoint, trials=1, soak_steps=50, fuzz_examples=25, churn_steps=4, seed=1234
    )
    try:
        yield s
    finally:
        s.close()


def _run(suite: fault_suite.Suite, name: str) -> dict[str, Any]:
    entry = fault_suite.run_case(suite, name)
    print(json.dumps(entry))
    return entry


def assert_sound(entry: dict[str, Any]) -> None:
    report = json.dumps(
        {k: v for k, v in entry.items() if k in ("details", "crash_examples", "skipped")}, indent=1
    )
    assert not entry.get("skipped"), report
    assert entry["trials"] > 0, report
    for field in ("wrong_bytes", "hangs", "lost_versions", "crashes", "violations", "harness_errors"):
        assert entry[field] == 0, f"{entry['name']}: {field} = {entry[field]}\n{report}"
    assert entry["completed_correct"] + entry["typed_errors"] == entry["trials"], report


def test_publisher_sigkill_mid_pull(suite: fault_suite.Suite) -> None:
    assert_sound(_run(suite, "publisher_kill_mid_pull"))


def test_publisher_sigkill_mid_pull_with_replicas(suite: fault_suite.Suite) -> None:
    entry = _run(suite, "publisher_kill_mid_pull_replicas")
    assert_sound(entry)


def test_consumer_sigkill_mid_pull_does_not_block_publisher(suite: fault_suite.Suite) -> None:
    entry = _run(suite, "consumer_kill_mid_pull")
    assert_sound(entry)
    assert entry["put_seconds_max"], entry


def test_zombie_writes_are_fenced(suite: fault_suite.Suite) -> None:
    entry = _run(suite, "zombie_writes")
    assert_sound(entry)
    assert entry["typed_kinds"] == {"StaleSessionError": entry["trials"]}, entry


def test_consumer_churn(suite: fault_suite.Suite) -> None:
    assert_sound(_run(suite, "consumer_churn"))


def test_hostile_api_input(suite: fault_suite.Suite) -> None:
    entry = _run(suite, "hostile_api")
    assert entry["inputs"] >= 30
    assert_sound(entry)


def test_hostile_records(suite: fault_suite.Suite, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        fault_suite.hostile,
        "HOSTILE_RECORDS",
        tuple(r for r in fault_suite.hostile.HOSTILE_RECORDS if r[0] in RECORDS),
    )
    entry = _run(suite, "hostile_records")
    assert entry["inputs"] == len(RECORDS)
    assert_sound(entry)


def test_fuzz_decoders(suite: fault_suite.Suite) -> None:
    entry = _run(suite, "fuzz_decoders")
    assert set(entry["per_target"]) == set(fault_suite.fuzz.fuzz_targets())
    assert_sound(entry)


def test_soak_stays_flat(suite: fault_suite.Suite) -> None:
    entry = _run(suite, "soak")
    assert_sound(entry)
    assert entry["trials"] == 50
    slopes, growth = entry["slopes_per_100_steps"], entry["growth_after_warmup"]
    assert all(v is not None for v in slopes.values()), slopes
    # Absolute growth over the 40 steps after warm-up: a handful of fds, threads or registrations
    # at most (a leak per step or per joining consumer would be dozens), and a bounded RSS.
    for key, g in growth.items():
        if key.endswith(("_fds", "_threads")):
            assert g["growth"] <= 5, (key, g, slopes)
        elif key.endswith(("_regions", "_peers")):
            assert g["growth"] <= 3, (key, g, slopes)
        elif key.endswith("_rss_kb"):
            assert g["growth"] <= 96 * 1024, (key, g, slopes)
