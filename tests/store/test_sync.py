"""End to end: publisher processes put, this process pulls over real UCX, byte-exact."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from astate_store import LayoutError, PeerUnreachable, Shard, WaitTimeout
from astate_store.store import Store
from tests._procs import CTX
from tests._store_workers import SPECS, STAGES, publisher_main, split, value, whole


class Group:
    """A publisher group of separate processes driven through queues."""

    def __init__(
        self,
        endpoint: str,
        ns: str,
        world: int,
        tp: int,
        transport: str,
        spec: str = "mixed",
        copy: bool = True,
    ):
        self.ns, self.world = ns, world
        self.cmds = [CTX.Queue() for _ in range(world)]
        self.out = CTX.Queue()
        session = uuid.uuid4().hex[:8]  # one id per group: a restarted group is a new session
        self.procs = [
            CTX.Process(
                target=publisher_main,
                daemon=True,
                args=(endpoint, ns, r, world, tp, spec, transport, self.cmds[r], self.out, copy, session),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.pids = {}
        for _ in range(world):
            msg = self.out.get(timeout=120)
            assert msg[0] == "ready", msg
            self.pids[msg[1]] = msg[2]

    def put(self, step: int) -> None:
        for q in self.cmds:
            q.put(("put", step))
        for _ in range(self.world):
            msg = self.out.get(timeout=60)
            assert msg[0] == "put", msg

    def kill(self, rank: int) -> None:
        os.kill(self.pids[rank], signal.SIGKILL)
        self.procs[rank].join(10)

    def close(self) -> None:
        for p, q in zip(self.procs, self.cmds):
            if p.is_alive():
                q.put(("exit",))
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()


@pytest.fixture
def consumer(etcd: Any, transport: str) -> Iterator[Any]:
    made: list[Store] = []

    def make(ns: str, **kw: Any) -> Store:
        s = Store(ns, endpoint=etcd.endpoint, transport=transport, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def group(etcd: Any, transport: str, world: int = 2, tp: int = 2, **kw: Any) -> Group:
    return Group(etcd.endpoint, "sync-" + uuid.uuid4().hex[:10], world, tp, transport, **kw)


def expected(
    name: str, step: int, box: tuple[tuple[int, ...], tuple[int, ...]] | None = None
) -> torch.Tensor:
    shape, dtype, _ = SPECS["mixed"][name]
    full = value(name, shape, dtype, step)
    if box is None:
        return full
    return full[tuple(slice(o, o + s) for o, s in zip(*box))]


def whole_buffers() -> dict[str, torch.Tensor]:
    return {n: torch.full(shape, 0, dtype=dt) for n, (shape, dt, _) in SPECS["mixed"].items()}


def column_buffers(index: int, parts: int = 2) -> dict[str, Shard]:
    """A rollout rank laid out differently: split on the last dim where the trainer split rows."""
    out = {}
    for n, (shape, dt, _) in SPECS["mixed"].items():
        offs, sizes = split(shape, len(shape) - 1, parts, index) if shape else whole(shape)
        out[n] = Shard(torch.zeros(sizes, dtype=dt), offs, shape)
    return out


def spy_builds(c: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(builder, step) of each batch a consumer's pulls plan from now on: from the layouts'
    columns (``_build_columns``) or with the general planner (``_build_pull``), both of the
    consumer's batches (``get/batches.py``)."""
    built: list[tuple[str, int]] = []
    for builder in ("_build_columns", "_build_pull"):

        def spy(v: Any, *a: Any, _real: Any = getattr(c.batches, builder), _name: str = builder) -> Any:
            work = _real(v, *a)
            if work is not None:
                built.append((_name, v.step))
            return work

        monkeypatch.setattr(c.batches, builder, spy)
    return built


def assert_exact(buffers: dict[str, Any], step: int) -> None:
    for n, b in buffers.items():
        if isinstance(b, Shard):
            exp = expected(n, step, (b.offsets, tuple(b.tensor.shape)))
            got = b.tensor
        else:
            exp, got = expected(n, step), b
        assert torch.equal(got.reshape(-1).view(torch.uint8), exp.reshape(-1).view(torch.uint8)), n


def test_reshard_n_to_m_byte_exact_several_steps(etcd: Any, transport: str, consumer: Any) -> None:
    g = group(etcd, transport)
    try:
        full = consumer(g.ns)
        col = [consumer(g.ns), consumer(g.ns)]
        bufs, cols = whole_buffers(), [column_buffers(0), column_buffers(1)]
        ptrs = {n: t.data_ptr() for n, t in bufs.items()}
        plans, reads = [], []
        for step in (1, 2, 3, 4):
            g.put(step)
            assert full.get_into(bufs, step=step, timeout=30) == step
            assert_exact(bufs, step)
            for c, b in zip(col, cols):
                assert c.get_into(b, step=step, timeout=30) == step
                assert_exact(b, step)
            plans.append(full.stats.plans)
            reads.append(col[0].stats.last_pull.reads)
        assert {n: t.data_ptr() for n, t in bufs.items()} == ptrs  # in place
        # Steady state: once the publishers built the pre-packed copies the column consumers
        # asked for (one step later), the layout stops changing and nobody re-plans.
        assert plans[2] == plans[3]
        assert reads[-1] < reads[0]  # the strided column slices now come as contiguous copies
    finally:
        g.close()


def test_dp_replicas_serve_as_alternative_sources(etcd: Any, transport: str, consumer: Any) -> None:
    g = group(etcd, transport, world=4, tp=2)  # ranks 0,2 and 1,3 hold identical boxes
    try:
        g.put(5)
        store = consumer(g.ns)
        bufs = whole_buffers()
        assert store.get_into(bufs, timeout=30) == 5
        assert_exact(bufs, 5)
        cols = column_buffers(1)
        assert store.get_into(cols, timeout=30) == 5
        assert_exact(cols, 5)
    finally:
        g.close()


def test_whole_buffers_of_row_split_shards_are_planned_from_the_columns(
    etcd: Any, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishers that split every tensor on dim 0 (DP replicas of each shard, a replicated norm,
    a 0-d tensor): a consumer of whole buffers plans its first pull from the layouts' columns, one
    read per shard, and reads the replicas' ranks in turn; the bytes are exact every step. Column
    buffers of the same version go through the general planner."""
    g = group(etcd, transport, world=4, tp=2, spec="dim0")  # ranks 0,2 and 1,3 hold identical boxes
    s = Store(g.ns, endpoint=etcd.endpoint, transport=transport)
    c = s._consumer
    built = spy_builds(c, monkeypatch)
    try:
        bufs = whole_buffers()
        for step in (1, 2, 3):
            g.put(step)
            assert s.get_into(bufs, step=step, timeout=30) == step
            assert_exact(bufs, step)
        assert built == [("_build_columns", 1)], built
        work = c._last
        assert work is not None and not work.conversions
        assert work.sources == {0, 1, 2, 3}  # the DP replicas' ranks share the reads
        # one read per distinct box (2 per split tensor, 1 per whole one)
        assert len(work.ops) == 10 and work.nbytes == sum(t.numel() * t.element_size() for t in bufs.values())
        cols = column_buffers(1)
        assert s.get_into(cols, step=3, timeout=30) == 3
        assert_exact(cols, 3)
        assert built[-1][0] == "_build_pull", built
    finally:
        s.close()
        g.close()


def test_subset_of_names_and_strided_destination(etcd: Any, transport: str, consumer: Any) -> None:
    g = group(etcd, transport)
    try:
        g.put(1)
        store = consumer(g.ns)
        holder = torch.zeros(48, 64 + 3)  # destination is a transposed, offset view
        view = holder[:, 3:].t()
        assert view.shape == (64, 48)
        got = store.get_into(
            {
                "emb": view,
                "experts": Shard(torch.zeros(3, 24, 16, dtype=torch.float16), (4, 0, 0), (8, 24, 16)),
            },
            timeout=30,
        )
        assert got == 1
        assert torch.equal(view, expected("emb", 1))
        assert torch.equal(holder[:, :3], torch.zeros(48, 3))  # nothing outside the view written
    finally:
        g.close()


def test_bad_buffers_fail_before_any_byte_moves(etcd: Any, transport: str, consumer: Any) -> None:
    g = group(etcd, transport)
    try:
        g.put(1)
        store = consumer(g.ns)
        keep = torch.full((64, 48), 7.0)
        with pytest.raises(LayoutError, match="'nope' is not in"):
            store.get_into({"emb": keep, "nope": torch.zeros(3)}, timeout=30)
        with pytest.raises(LayoutError, match=r"'emb'.*global shape"):
            store.get_into({"emb": torch.zeros(64, 47)}, timeout=30)
        with pytest.raises(LayoutError, match=r"'emb'.*dtype int32"):
            store.get_into({"emb": torch.zeros(64, 48, dtype=torch.int32)}, timeout=30)
        with pytest.raises(LayoutError, match=r"'emb'.*out of bounds"):
            store.get_into({"emb": Shard(torch.zeros(10, 48), (60, 0), (64, 48))}, timeout=30)
        assert torch.equal(keep, torch.full((64, 48), 7.0))
    finally:
        g.close()


def test_step_that_never_commits_times_out(etcd: Any, transport: str, consumer: Any) -> None:
    g = group(etcd, transport)
    try:
        g.put(1)
        g.cmds[0].put(("put", 2))  # only rank 0 writes step 2: it never commits
        assert g.out.get(timeout=60)[0] == "put"
        store = consumer(g.ns)
        with pytest.raises(WaitTimeout):
            store.get_into(whole_buffers(), step=2, timeout=1.5)
        assert store.get_into(whole_buffers(), timeout=5) == 1
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_dead_publisher_gives_typed_error(etcd: Any, transport: str, consumer: Any) -> None:
    g = group(etcd, transport)
    try:
        g.put(1)
        g.kill(1)
        store = consumer(g.ns, read_timeout=10.0)
        # Its lease (3 s) may not have expired yet: then the read itself fails; either way typed.
        with pytest.raises(PeerUnreachable):
            store.get_into(whole_buffers(), timeout=10)
    finally:
        g.close()


def committed_pieces(s: Store, step: int) -> dict[int, Any]:
    """The pieces of a committed version as the catalog gives them to a reader (a probe read)."""
    catalog = s._ctx.catalog
    pieces = catalog.versions.layouts_of(catalog.readers.begin_read(step, "probe")).pieces
    catalog.readers.end_read(step, "probe")
    return dict(pieces)


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "anonymous"])
def test_same_host_pull_reads_the_mapped_snapshot(
    etcd: Any, memfd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publisher processes stage snapshots in sealed memfds: a same-host consumer maps them
    and copies; with ``ASTATE_MEMFD=0`` they are anonymous and read with process_vm_readv.
    Byte-exact either way, and across steps that reuse the slots."""
    if not memfd:
        monkeypatch.setenv("ASTATE_MEMFD", "0")  # inherited by the spawned publishers
    from astate_store.transport import memfd as memfd_mod

    populated: list[str] = []  # the thread each prefault ran on
    real = memfd_mod._populate

    def spy(address: int, length: int) -> bool:
        populated.append(threading.current_thread().name)
        return real(address, length)

    monkeypatch.setattr(memfd_mod, "_populate", spy)
    g = group(etcd, "shm")
    s = Store(g.ns, endpoint=etcd.endpoint, transport="shm")
    hints: list[tuple[Any, int]] = []  # (peer, first byte hinted) per prefault hint the pulls gave
    real_hint = s._ctx.transport.prefault
    monkeypatch.setattr(
        s._ctx.transport,
        "prefault",
        lambda peer, spans: (hints.extend((peer, lo) for _r, lo, _hi in spans), real_hint(peer, spans)),
    )
    try:
        bufs = whole_buffers()
        for step in (1, 2, 3):
            g.put(step)
            assert s.get_into(bufs, step=step, timeout=30) == step
            assert_exact(bufs, step)
            if step == 1:
                # each piece lists its pool's slots; the pull hinted its own slot and then the other
                # (to be mapped before step 2 reads it)
                pieces = committed_pieces(s, 1)
                assert all(len(p.slot_bases) == 2 and p.base_offset in p.slot_bases for p in pieces.values())
                for r, p in pieces.items():
                    los = [lo for peer, lo in hints if peer[-1] == r]
                    other = max(p.slot_bases)
                    assert any(lo < other for lo in los) and any(lo >= other for lo in los), (
                        r,
                        los,
                        p.slot_bases,
                    )
        t = s._ctx.transport
        infos = [t.peer_info(k) for k in t.peers]
        assert infos and all(i.direct for i in infos)
        mapped = [m for i in infos for m in i.mapped_regions]
        assert any(mapped) if memfd else not any(mapped)
        # each new slot's pages were prefaulted from the hints (given before planning, and ahead
        # for the other slot): the pull's own thread at most helped a job under way
        assert ("astate-prefault" in set(populated)) if memfd else not populated
    finally:
        s.close()
        g.close()


def test_new_staging_slot_reuses_the_ready_made_batch(
    etcd: Any, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publisher's two snapshot slots hold the same layout at two bases: the first read of
    the second slot moves the ready-made batch's rows there instead of planning again, and
    the bytes are exact in both slots (whole and column-split buffers; pre-packing off, so
    the layout stays the same). The ranks hold different tensors (pipeline stages), so their
    slots lie at different distances and each rank's rows move by its own."""
    g = group(etcd, transport, spec=STAGES)
    s = Store(g.ns, endpoint=etcd.endpoint, transport=transport, prepack=False)
    c = s._consumer
    built = spy_builds(c, monkeypatch)
    try:
        bufs, cols = whole_buffers(), column_buffers(1)
        bases: dict[int, set[int]] = {}
        for step in (1, 2, 3, 4):
            g.put(step)
            assert s.get_into(bufs, step=step, timeout=30) == step
            assert_exact(bufs, step)
            for r, p in committed_pieces(s, step).items():
                bases.setdefault(r, set()).add(p.base_offset)
        assert all(len(b) == 2 for b in bases.values()), bases  # both slots were read
        assert len({max(b) - min(b) for b in bases.values()}) == len(bases) == 2, bases  # distinct shifts
        assert [st for _b, st in built] == [1], built  # planned once; the second slot's batch was moved
        # another set of buffers is a new batch: planned once, then moved between the slots too
        for step in (5, 6, 7):
            g.put(step)
            assert s.get_into(cols, step=step, timeout=30) == step
            assert_exact(cols, step)
        assert [st for _b, st in built] == [1, 5], built
    finally:
        s.close()
        g.close()
