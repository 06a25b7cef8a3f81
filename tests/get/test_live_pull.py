"""Pull from whatever is alive: after a publisher rank exits, a pull of what the live ranks hold
succeeds, and a pull of bytes only the gone rank held fails at once with ``NoLiveSource`` naming
the tensor, the box and the rank, before any byte moves.

Real processes: torchrun with two ranks and the embedded etcd (``tests/get/_live_pull.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd.test_embedded_etcd import Host

COLS = 16


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path / "home")
    yield h
    h.close()


@pytest.mark.timeout(150)
def test_pull_from_live_ranks_after_one_exited(host: Host, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "torchrun.log"
    torchrun = Path(sys.executable).parent / "torchrun"
    with open(log, "wb") as logf:
        run = host.spawn(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", "tests/get/_live_pull.py"],
            env={"LP_OUT": str(out)},
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    try:
        rc = run.wait(120)
    except subprocess.TimeoutExpired:
        rc = None
    assert rc == 0, f"torchrun exited {rc}; its log ends:\n{log.read_text(errors='replace')[-6000:]}"
    r = json.loads((out / "result-0.json").read_text())

    # While both ranks lived, the watcher pulled everything (it caches rank 1's layout).
    assert r["watcher_before"].get("step") == 3 and r["watcher_before"]["w_exact"], r["watcher_before"]
    assert r["watcher_own_before"].get("step") == 3 and r["watcher_own_before"]["norm_exact"], r
    # After rank 1 exited: its own rows and the replicated norm, by a fresh and by a warm consumer.
    for case in ("own", "watcher_own", "own_again"):
        got = r[case]
        assert got.get("step") == 3, (case, got)
        assert got["w_exact"] and got["norm_exact"], (case, got)
    # Rows only rank 1 held: the typed error (not a wait for a newer step), and nothing written.
    for case in ("full", "watcher_full"):
        got = r[case]
        assert got.get("error") == "NoLiveSource", (case, got)
        assert got["holes"] == [["w", [4, 0], [4, COLS], [1]]], (case, got)
        assert "'w'" in got["message"] and "[1]" in got["message"], got["message"]
        assert got["w_untouched"], (case, got)
        assert got.get("norm_untouched", True), (case, got)
    # A buffer across both ranks' rows: only the part rank 1 held is named.
    got = r["straddle"]
    assert got.get("error") == "NoLiveSource" and got["holes"] == [["w", [4, 0], [2, COLS], [1]]], got
    assert got["w_untouched"], got
