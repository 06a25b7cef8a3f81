"""Delta versions end to end (docs/delta.md): publisher processes put with ``delta=True``, stores in
this process pull. A delta pull leaves its buffers bit-identical to a whole pull of the same
version (every element compared as raw bits), resharded and converted, over shared memory,
streamed tcp and UCX tcp; it moves only the changes, and goes whole when it cannot be exact."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from astate_store import Shard
from astate_store.catalog.records import pad20
from astate_store.errors import DeltaMismatch
from astate_store.model import codec
from astate_store.store import Store
from tests._delta_workers import SPEC, delta_publisher, sparse, split, whole
from tests._procs import CTX

pytestmark = pytest.mark.timeout(240)

OPTS: dict[str, Any] = {"prepack": False, "lease_ttl": 3.0, "read_timeout": 60.0}


class Pubs:
    """A publisher group of separate processes putting the sparse model with ``delta=True``."""

    def __init__(self, endpoint: str, ns: str, world: int, transport: str, **options: Any):
        self.world, self.dense = world, []  # dense: every dense event so far (sparse() replays them)
        self.cmds = [CTX.Queue() for _ in range(world)]
        self.out = CTX.Queue()
        session = uuid.uuid4().hex[:8]
        self.procs = [
            CTX.Process(
                target=delta_publisher,
                daemon=True,
                args=(endpoint, ns, r, world, transport, self.cmds[r], self.out, session, options),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        for _ in range(world):
            msg = self.out.get(timeout=120)
            assert msg[0] == "ready", msg

    def put(self, step: int, *dense: Any) -> None:
        """Publish ``step``; ``dense``: "all" (every element changes) or tensor names that change whole."""
        self.dense += [step if d == "all" else (d, step) for d in dense]
        for q in self.cmds:
            q.put(("put", step, list(self.dense)))
        for _ in range(self.world):
            msg = self.out.get(timeout=60)
            assert msg[0] == "put", msg

    def close(self) -> None:
        for p, q in zip(self.procs, self.cmds):
            if p.is_alive():
                q.put(("exit",))
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()


@pytest.fixture(params=["shm", "tcp"])
def transport(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "ucx-tcp":  # tcp without the streamed reads: UCX's own tcp
        monkeypatch.setenv("ASTATE_STREAM", "0")
        return "tcp"
    return str(request.param)


@pytest.fixture
def world(etcd: Any, transport: str) -> Iterator[Any]:
    """``make(world=2, **publisher options)`` -> (Pubs, consumer factory) on one namespace."""
    made: list[Any] = []

    def make(world: int = 2, ns: str | None = None, **options: Any) -> tuple[Pubs, Any]:
        ns = ns or "delta-" + uuid.uuid4().hex[:10]
        pubs = Pubs(etcd.endpoint, ns, world, transport, **options)
        made.append(pubs)

        def store(**kw: Any) -> Store:
            s = Store(ns, endpoint=etcd.endpoint, transport=transport, **{**OPTS, **kw})
            made.append(s)
            return s

        return pubs, store

    yield make
    for m in reversed(made):
        m.close()


# ---- buffers and checks -----------------------------------------------------------------------

CONVERT = {"emb": torch.bfloat16, "qkv": torch.float32}  # the column buffers' dtypes (conversion on pull)


def buffers(kind: str) -> dict[str, Any]:
    """``whole``: every tensor whole; ``cols``: the second half of the last dim, two of them in
    another dtype; ``rows``: the first of three uneven row blocks."""
    out: dict[str, Any] = {}
    for n, (shape, dt, _) in SPEC.items():
        if kind == "whole" or not shape:
            out[n] = torch.zeros(shape, dtype=dt)
            continue
        if kind == "cols":
            offs, sizes = split(shape, len(shape) - 1, 2, 1)
            dt = CONVERT.get(n, dt)
        else:
            offs, sizes = split(shape, 0, 3, 0, uneven=True)
        out[n] = Shard(torch.zeros(sizes, dtype=dt), offs, shape)
    return out


def _t(b: Any) -> torch.Tensor:
    return b.tensor if isinstance(b, Shard) else b


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose buffers differ in any bit."""
    return [n for n in a if not torch.equal(bits(_t(a[n])), bits(_t(b[n])))]


def expected_whole(step: int, dense: list[Any]) -> dict[str, torch.Tensor]:
    return {n: sparse(n, step, tuple(dense)) for n in SPEC}


def changed(step: int, dense: list[Any], before: int) -> int:
    """Elements whose bits differ between ``before`` and ``step`` (the whole model)."""
    n = 0
    for name in SPEC:
        a, b = sparse(name, before, tuple(dense)), sparse(name, step, tuple(dense))
        esize = a.element_size()
        da, db = bits(a).view(-1, esize), bits(b).view(-1, esize)
        n += int((da != db).any(dim=1).sum())
    return n


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp", "ucx-tcp"], indirect=True)
def test_delta_pulls_are_bit_identical_to_whole_pulls_and_move_only_the_changes(world: Any) -> None:
    """Row, column, uneven, expert and replicated sources; whole, column and row buffers; dtype
    conversion on pull; a tensor that changes entirely; a step where everything changes."""
    pubs, store = world(2)
    kinds = ("whole", "cols", "rows")
    delta = {k: store(delta=True, verify=True) for k in kinds}
    plain = {k: store() for k in kinds}
    bd = {k: buffers(k) for k in kinds}
    bw = {k: buffers(k) for k in kinds}
    whole_bytes = sum(t.numel() * t.element_size() for t in expected_whole(0, []).values())
    plan = [(1, ()), (2, ()), (3, ("qkv",)), (4, ("all",)), (5, ()), (6, ())]
    for step, dense in plan:
        pubs.put(step, *dense)
        before = delta["whole"].stats
        for k in kinds:
            assert delta[k].get_into(bd[k], step=step, timeout=30) == step
            assert plain[k].get_into(bw[k], step=step, timeout=30) == step
            assert same_bits(bd[k], bw[k]) == [], (step, k)
        want = expected_whole(step, pubs.dense)
        assert same_bits(bd["whole"], want) == [], step
        after = delta["whole"].stats
        assert after.last_pull is not None
        assert after.pull_bytes - before.pull_bytes == after.last_pull.bytes
        if step == 1:  # the first pull: whole
            assert after.delta_pulls == 0 and after.last_pull.bytes == whole_bytes
            continue
        # later ones as deltas, or whole where that moves fewer bytes (step 4 changed every
        # element that can change: some tiles of ``bits`` keep their 0.0s, so it may be either)
        assert after.last_pull.bytes <= whole_bytes
        if after.delta_pulls == before.delta_pulls + 1:
            # the elements applied are exactly those whose bits changed (replicas counted once)
            assert after.delta_elements - before.delta_elements == changed(step, pubs.dense, step - 1)
        else:
            assert step == 4 and after.last_pull.bytes == whole_bytes
        if step != 4:  # sparse steps: only the changes moved
            assert after.delta_pulls == before.delta_pulls + 1, step
            assert after.last_pull.bytes < whole_bytes // (2 if step == 3 else 8), (step, after.last_pull)
    for k in kinds:
        st = delta[k].stats
        assert st.delta_pulls >= 4 and st.pull_errors == 0, (k, st)
        assert plain[k].stats.delta_pulls == 0
    # verify checked the whole buffers every pull (every tile held whole, same dtype)
    assert delta["whole"].stats.verified_tiles > 0 and delta["whole"].stats.unverified_tiles == 0
    assert delta["cols"].stats.unverified_tiles > 0  # converted buffers are not verifiable


@pytest.mark.parametrize("depth", [4, 2])
def test_a_skipped_version_is_served_by_chained_changes_or_whole(world: Any, depth: int) -> None:
    """Steps 2 and 3 are skipped: with 4 staging slots every link from 1 to 4 is still held and
    the pull chains them; with 2, step 2's slot holds step 4 by then and the pull goes whole."""
    pubs, store = world(2, staging_depth=depth)
    cons = store(delta=True)
    bufs = buffers("whole")
    pubs.put(1)
    assert cons.get_into(bufs, step=1, timeout=30) == 1
    for step in (2, 3, 4):
        pubs.put(step)
    assert cons.get_into(bufs, step=4, timeout=30) == 4
    assert same_bits(bufs, expected_whole(4, pubs.dense)) == []
    st = cons.stats
    assert st.delta_pulls == (1 if depth == 4 else 0), st
    if depth == 4:  # each link's changes in turn (a tile too dense in one link is read once, whole)
        links = sum(changed(k, pubs.dense, k - 1) for k in (2, 3, 4))
        assert changed(4, pubs.dense, 1) <= st.delta_elements <= links
    # and on from there, one step at a time
    pubs.put(5)
    assert cons.get_into(bufs, step=5, timeout=30) == 5
    assert same_bits(bufs, expected_whole(5, pubs.dense)) == []
    assert cons.stats.delta_pulls == st.delta_pulls + 1


def test_staging_depth_one_compares_in_place(world: Any) -> None:
    """One slot: the put compares against the version it overwrites, and the change map is kept."""
    pubs, store = world(1, staging_depth=1, retire_timeout=2.0)
    cons = store(delta=True, verify=True)
    bufs = buffers("whole")
    for step in (1, 2, 3):
        pubs.put(step)
        assert cons.get_into(bufs, step=step, timeout=30) == step
        assert same_bits(bufs, expected_whole(step, pubs.dense)) == [], step
    assert cons.stats.delta_pulls == 2


def test_new_buffers_forget_and_a_restarted_publisher_pull_whole(world: Any, etcd: Any) -> None:
    pubs, store = world(2)
    cons = store(delta=True)
    bufs = buffers("whole")
    for step in (1, 2):
        pubs.put(step)
        cons.get_into(bufs, step=step, timeout=30)
    assert cons.stats.delta_pulls == 1
    # other buffers: whole (they hold nothing known), and the old ones are not the last pull's
    pubs.put(3)
    fresh = buffers("whole")
    assert cons.get_into(fresh, step=3, timeout=30) == 3 and cons.stats.delta_pulls == 1
    assert same_bits(fresh, expected_whole(3, pubs.dense)) == []
    pubs.put(4)
    assert cons.get_into(fresh, step=4, timeout=30) == 4 and cons.stats.delta_pulls == 2
    # forget: the caller wrote into them
    _t(fresh["emb"]).fill_(0.5)
    cons.forget(fresh)
    pubs.put(5)
    assert cons.get_into(fresh, step=5, timeout=30) == 5 and cons.stats.delta_pulls == 2
    assert same_bits(fresh, expected_whole(5, pubs.dense)) == []
    # a restarted publisher group holds no base: its first version is pulled whole, then deltas
    ns = cons.namespace
    dense = list(pubs.dense)
    pubs.close()
    again, _ = world(2, ns=ns)
    again.dense = dense
    again.put(6)
    assert cons.get_into(fresh, step=6, timeout=30) == 6 and cons.stats.delta_pulls == 2
    assert same_bits(fresh, expected_whole(6, again.dense)) == []
    again.put(7)
    assert cons.get_into(fresh, step=7, timeout=30) == 7 and cons.stats.delta_pulls == 3
    assert same_bits(fresh, expected_whole(7, again.dense)) == []


def _delta_key(s: Store, step: int, rank: int) -> tuple[str, int]:
    """The key of ``rank``'s delta record of ``step``, and its piece's slot offset."""
    v = s.catalog.versions.read_version(step)
    key = s.catalog.client.key("versions", pad20(step), "deltas", pad20(v.epoch), pad20(rank))
    return key, v.pieces[rank].base_offset


@pytest.mark.parametrize("how", ["garbage", "other tiles", "rows elsewhere"])
def test_a_corrupted_change_map_is_skipped_counted_and_the_pull_goes_whole(world: Any, how: str) -> None:
    pubs, store = world(2)
    cons = store(delta=True)
    bufs = buffers("whole")
    pubs.put(1)
    cons.get_into(bufs, step=1, timeout=30)
    pubs.put(2)
    key, slot = _delta_key(cons, 2, 1)
    raw, _ = cons.catalog.client.raw.get(key)
    rec = codec.decode("delta", raw)
    rec.pop("schema", None)
    if how == "garbage":
        bad = b"\x93not a record"
    elif how == "other tiles":  # passes its schema, contradicts its layout
        bad = codec.encode("delta", {**rec, "tiles": rec["tiles"] + 1})
    else:  # passes its schema, its rows point at the snapshot's bytes
        bad = codec.encode("delta", {**rec, "index_offset": slot})
    cons.catalog.client.raw.put(key, bad)
    bad_before = cons.stats.bad_records
    assert cons.get_into(bufs, step=2, timeout=30) == 2
    assert same_bits(bufs, expected_whole(2, pubs.dense)) == []  # never wrong
    st = cons.stats
    assert st.delta_pulls == 0 and st.bad_records > bad_before, st
    # the next version's record is good again: a delta
    pubs.put(3)
    assert cons.get_into(bufs, step=3, timeout=30) == 3
    assert same_bits(bufs, expected_whole(3, pubs.dense)) == []
    assert cons.stats.delta_pulls == 1


def test_verify_catches_a_buffer_changed_behind_the_stores_back(world: Any) -> None:
    pubs, store = world(2)
    cons = store(delta=True, verify=True)
    bufs = buffers("whole")
    for step in (1, 2):
        pubs.put(step)
        cons.get_into(bufs, step=step, timeout=30)
    _t(bufs["experts"])[3, 5, 7] += 1  # nobody told the store
    pubs.put(3)
    with pytest.raises(DeltaMismatch, match="'experts'") as info:
        cons.get_into(bufs, step=3, timeout=30)
    assert info.value.tensors == ("experts",) and info.value.step == 3
    # the store forgot the buffers: the next pull is whole, and exact
    pulls = cons.stats.delta_pulls
    assert cons.get_into(bufs, step=3, timeout=30) == 3
    assert same_bits(bufs, expected_whole(3, pubs.dense)) == []
    assert cons.stats.delta_pulls == pulls
    pubs.put(4)
    assert cons.get_into(bufs, step=4, timeout=30) == 4 and cons.stats.delta_pulls == pulls + 1
    # a whole pull is verified too
    _t(bufs["norm"])[0] += 1
    cons.forget()
    pubs.put(5)
    assert cons.get_into(bufs, step=5, timeout=30) == 5
    assert same_bits(bufs, expected_whole(5, pubs.dense)) == []


__all__ = ["whole"]


def test_the_figures_bytes_metrics_and_inspect(store_factory: Any) -> None:
    """One publisher in this process, one 1-D tensor: a delta pull reads exactly its index rows
    and the encoded changes; the counters reach /metrics; ``astate inspect`` shows each version's
    changed fraction."""
    from prometheus_client import generate_latest

    from astate_store import metrics
    from astate_store.cli import views

    pub = store_factory(delta=True)
    cons = store_factory(delta=True, prepack=False)
    w = torch.arange(100_000, dtype=torch.float32)
    buf = {"w": torch.zeros(100_000)}
    pub.put(1, {"w": w})
    cons.get_into(buf, step=1, timeout=30)
    w[::1000] += 1  # 100 elements
    pub.put(2, {"w": w})
    assert cons.get_into(buf, step=2, timeout=30) == 2 and torch.equal(buf["w"], w)
    d = pub.catalog.versions.read_version(2).pieces[0].delta
    assert d is not None and d.base == 1 and d.changed == 100 and d.elements == 100_000
    st = cons.stats
    assert st.last_pull is not None and st.last_pull.bytes == d.tiles * 32 + d.data_bytes
    assert st.delta_pulls == 1 and st.delta_elements == 100
    text = generate_latest(metrics.REGISTRY).decode()
    labels = f'namespace="{cons.namespace}",rank="0"'
    assert f"astate_delta_pulls_total{{{labels}}} 1.0" in text
    assert f"astate_delta_elements_total{{{labels}}} 100.0" in text
    changes = {c["step"]: c for c in views.inspect(cons.catalog)["changes"]}
    assert changes[1]["fraction"] is None  # the first put: no base
    assert changes[2]["bases"] == [1] and changes[2]["fraction"] == pytest.approx(100 / 100_000)


def test_a_delta_read_torn_by_the_publisher_is_discarded_and_retried(
    store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher overwrites the version's slot while its changes are being read (after the
    reads, before the step words are checked): nothing is applied, the buffers still hold the
    older step, and the retry delivers a newer version whole and exact."""
    from astate_store.get import delta_reads

    pub = store_factory(delta=True, staging_depth=2, retire_timeout=0.0)  # never waits for readers
    cons = store_factory(delta=True, prepack=False, read_timeout=60.0)
    w = torch.arange(50_000, dtype=torch.float32)
    buf = {"w": torch.zeros(50_000)}
    pub.put(1, {"w": w})
    cons.get_into(buf, step=1, timeout=30)
    w[::100] += 1
    pub.put(2, {"w": w})
    later = {3: w.clone(), 4: w.clone()}
    later[3][::50] += 2
    later[4][::70] += 3
    run, fired = delta_reads.Reads.run, []

    def run_then_overwrite(self: Any, *a: Any) -> None:
        run(self, *a)
        if not fired:  # steps 3 and 4 take both slots: step 2's is reused under the reader
            fired.append(True)
            pub.put(3, {"w": later[3]})
            pub.put(4, {"w": later[4]})

    monkeypatch.setattr(delta_reads.Reads, "run", run_then_overwrite)
    got = cons.get_into(buf, step=2, timeout=30)
    assert fired and got in (3, 4)
    assert torch.equal(buf["w"], later[got])
    st = cons.stats
    assert st.torn_retries == 1 and st.pull_errors == 0


def test_a_failed_delta_read_goes_whole_through_the_usual_path(
    store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transport error while the changes are read (before any byte is applied): the pull goes
    whole (which fails over as whole pulls do) and is exact; the next one is a delta again."""
    from astate_store.errors import TransportError
    from astate_store.get import delta_reads

    pub = store_factory(delta=True)
    cons = store_factory(delta=True, prepack=False)
    w = torch.arange(50_000, dtype=torch.float32)
    buf = {"w": torch.zeros(50_000)}
    pub.put(1, {"w": w})
    cons.get_into(buf, step=1, timeout=30)
    run = delta_reads.Reads.run

    def fail(self: Any, *a: Any) -> None:
        raise TransportError("the peer hung up")

    monkeypatch.setattr(delta_reads.Reads, "run", fail)
    w[::100] += 1
    pub.put(2, {"w": w})
    assert cons.get_into(buf, step=2, timeout=30) == 2 and torch.equal(buf["w"], w)
    assert cons.stats.delta_pulls == 0 and cons.stats.pull_errors == 0
    monkeypatch.setattr(delta_reads.Reads, "run", run)
    w[::300] += 1
    pub.put(3, {"w": w})
    assert cons.get_into(buf, step=3, timeout=30) == 3 and torch.equal(buf["w"], w)
    assert cons.stats.delta_pulls == 1


def test_pulling_the_step_the_buffers_hold_moves_nothing(store_factory: Any) -> None:
    pub = store_factory(delta=True)
    cons = store_factory(delta=True, prepack=False)
    w = torch.arange(1000, dtype=torch.float32)
    buf = {"w": torch.zeros(1000)}
    pub.put(1, {"w": w})
    cons.get_into(buf, step=1, timeout=30)
    assert cons.get_into(buf, timeout=30) == 1 and torch.equal(buf["w"], w)
    assert cons.stats.last_pull is not None and cons.stats.last_pull.bytes == 0


def test_delta_choice_by_time_pulls_exactly_either_way(world: Any) -> None:
    """``delta_choice="time"``: the second and third pulls go through the changes (their cost is
    measured), later ones whichever way was measured faster; every pull is exact either way. A pull
    declined (a delta priced far above a whole pull) goes whole, and the buffers then hold its
    step, so the next pull can go through changes again."""
    pubs, store = world(2)
    cons = store(delta=True, delta_choice="time")
    bufs = buffers("whole")
    for step in range(1, 7):
        pubs.put(step)
        assert cons.get_into(bufs, step=step, timeout=30) == step
        assert same_bits(bufs, expected_whole(step, pubs.dense)) == [], step
    st = cons.stats
    assert st.delta_pulls >= 2, st
    assert st.delta_pulls + st.delta_declined == 5, st  # every pull after the first could be a delta
    choice = cons._consumer.delta._choice
    choice._delta, choice._whole = 1.0, 1e-3  # a second per byte through changes: go whole
    pubs.put(7)
    assert cons.get_into(bufs, step=7, timeout=30) == 7
    assert same_bits(bufs, expected_whole(7, pubs.dense)) == []
    assert (cons.stats.delta_pulls, cons.stats.delta_declined) == (st.delta_pulls, st.delta_declined + 1)
    choice._delta, choice._whole = 1e-12, 1.0  # and a delta far below a whole pull: through changes
    pubs.put(8)
    assert cons.get_into(bufs, step=8, timeout=30) == 8
    assert same_bits(bufs, expected_whole(8, pubs.dense)) == []
    assert cons.stats.delta_pulls == st.delta_pulls + 1


def test_delta_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="delta_choice"):
        Store("delta-choice", endpoint="127.0.0.1:1", delta=True, delta_choice="fast")
