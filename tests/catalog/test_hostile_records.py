"""An untrusted etcd: bad records written straight into the namespace while a publisher and a
consumer keep working. Each bad record is skipped and counted (``Store.stats.bad_records``)
and stops nobody; a bad *authority* record (``latest``, ``epoch``, a commit, a committed piece, the
session) raises ``CatalogCorrupted`` naming its key, and no bytes are returned for it. Then every
decoder is fuzzed: arbitrary bytes and records raise nothing but ``CodecError`` (or the typed
catalog errors).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astate_store.catalog import Catalog, CheckpointEntry
from astate_store.catalog.blobs import blob_from_kvs, blob_requests
from astate_store.catalog.records import pad20, version_from_kvs
from astate_store.catalog.shard_tables import (
    layout_from_record,
    layout_id_of,
    layout_record,
    manifest_from_record,
    manifest_id_of,
    manifest_record,
)
from astate_store.catalog.version_reads import _checked_blob_kvs
from astate_store.errors import CatalogCorrupted, CodecError, VersionNotFound, WaitTimeout
from astate_store.model import codec
from astate_store.model.dtypes import DTYPE_CODES
from astate_store.model.layout import Box, ShardRecord
from astate_store.store import Store
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w": (64,), "m": (8, 16)}


def _tensors(step: int) -> dict[str, torch.Tensor]:
    return {
        n: torch.arange(int(torch.tensor(s).prod()), dtype=torch.float32).reshape(s) + 1000.0 * step
        for n, s in SHAPES.items()
    }


def _whole(name: str, shape: tuple[int, ...] | None = None, dtype: str = "float32") -> ShardRecord:
    shape = shape or SHAPES[name]
    strides = tuple(int(torch.empty(shape).stride(d)) for d in range(len(shape)))
    return ShardRecord(name, dtype, shape, Box((0,) * len(shape), shape), strides, 0, 0, 0)


class World:
    """A publisher and a consumer of one namespace, and a raw etcd client to write bad records with."""

    def __init__(self, endpoint: str):
        self.ns = "hostile-" + uuid.uuid4().hex[:10]
        self.pub = Store(self.ns, endpoint=endpoint, transport="shm", session_id=self.ns, retire_timeout=8.0)
        self.cons = Store(self.ns, endpoint=endpoint, transport="shm")
        self.raw = self.pub.catalog.client.raw
        self.step = 0
        self.bufs = {n: torch.full(s, -1.0) for n, s in SHAPES.items()}

    def key(self, *parts: str) -> str:
        return self.pub.catalog.client.key(*parts)

    @property
    def epoch(self) -> int:
        return self.pub.catalog.session.epoch

    def skipped(self) -> int:
        return self.pub.stats.bad_records + self.cons.stats.bad_records

    def put(self, step: int) -> None:
        self.pub.put(step, _tensors(step))
        self.step = step

    def torn_marks(self) -> int:
        """The torn markers under this namespace: a retire that waited out ``retire_timeout`` on a
        reader it could not see finish writes one."""
        return sum(1 for _ in self.raw.get_prefix(self.key("torn") + "/", keys_only=True))

    def pull(self, step: int) -> None:
        assert self.cons.get_into(self.bufs, step=step, timeout=20) == step
        for n, t in _tensors(step).items():
            assert torch.equal(self.bufs[n], t), f"{n}: not the bytes of step {step}"

    def close(self) -> None:
        self.cons.close()
        self.pub.close()


@pytest.fixture(scope="module")
def world(etcd: Any) -> Iterator[World]:
    w = World(etcd.endpoint)
    w.pub.catalog.checkpoints.record(CheckpointEntry(1, "file:///nowhere/1", 1, 10, 1.0))
    for step in range(1, 6):  # more versions than retention keeps: retention runs on every commit
        w.put(step)
        w.pull(step)
    yield w
    w.close()


# ---- bad records, and how to write them ------------------------------------------------------

GARBAGE = b"\x93\xa3not a record\xff\x00"


def _blob(w: World, key: str, data: bytes) -> list[str]:
    chunks, head = blob_requests(key, data)
    for ops in chunks:
        w.raw.transaction(compare=[], success=ops, failure=[])
    w.raw.transaction(compare=[], success=[head], failure=[])
    return [key]


def _replica(
    w: World,
    step: int,
    member: str,
    *,
    shards: list[ShardRecord] | None = None,
    transport: bytes = GARBAGE,
    man: dict[str, Any] | None = None,
    lay: dict[str, Any] | None = None,
    lay_key_id: str | None = None,
    raw_layout: bytes | None = None,
    group: str = "g",
) -> list[str]:
    """A re-serving consumer's offer (manifest, layout and replica record), as a stranger writes it."""
    shards = shards if shards is not None else [_whole("w"), _whole("m")]
    man = man if man is not None else manifest_record(shards)
    lay = lay if lay is not None else layout_record(0, 0, man, shards, transport)
    lid = lay_key_id or lay["layout_id"]
    keys = _blob(w, w.key("layouts", "replicas", member, man["manifest_id"]), codec.encode("manifest", man))
    lkey = w.key("layouts", "replicas", member, lid)
    if raw_layout is None:
        keys += _blob(w, lkey, codec.encode("layout", lay))
    else:
        w.raw.put(lkey, raw_layout)
        keys.append(lkey)
    rec = codec.encode(
        "replica",
        {"step": step, "group": group, "member": member, "layout_id": lid, "manifest_id": man["manifest_id"]},
    )
    rkey = w.key("versions", pad20(step), "replicas", group, member)
    w.raw.put(rkey, rec)
    return keys + [rkey]


def _put(
    key_parts: Callable[[World, int], tuple[str, ...]], value: Callable[[World, int], bytes]
) -> Callable[[World, int], list[str]]:
    def inject(w: World, step: int) -> list[str]:
        key = w.key(*key_parts(w, step))
        w.raw.put(key, value(w, step))
        return [key]

    return inject


def _enc(kind: str, **rec: Any) -> bytes:
    return codec.encode(kind, rec)


def _piece(w: World, step: int, *, rank: int = 0, epoch: int | None = None, world_size: int = 1) -> bytes:
    return _enc(
        "piece",
        step=step,
        epoch=w.epoch if epoch is None else epoch,
        rank=rank,
        world_size=world_size,
        layout_id="0" * 24,
        base_offset=0,
        manifest_id="0" * 24,
    )


def _bad_box_manifest() -> dict[str, Any]:
    import numpy as np

    cols = {
        "names": ["w"],
        "dtypes": bytes([DTYPE_CODES["float32"]]),
        "ndims": bytes([1]),
        "global_shapes": np.array([64], "<i8").tobytes(),
        "offsets": np.array([60], "<i8").tobytes(),
        "sizes": np.array([10], "<i8").tobytes(),
    }
    return {"manifest_id": manifest_id_of(cols), **cols}


def _chunked_layout(w: World, step: int, member: str, *, tamper: bool) -> list[str]:
    """A layout blob in two chunks (head last), one of them replaced when ``tamper``."""
    shards = [_whole("w"), _whole("m")]
    man = manifest_record(shards)
    lay = layout_record(0, 0, man, shards, GARBAGE)
    data = codec.encode("layout", lay)
    parts = [data[: len(data) // 2], data[len(data) // 2 :]]
    lkey = w.key("layouts", "replicas", member, lay["layout_id"])
    for i, p in enumerate(parts):
        w.raw.put(f"{lkey}/{i:06d}", (b"X" * len(p)) if tamper and i == 1 else p)
    head = {"size": len(data), "codec": "none", "digest": xxhash.xxh3_64_hexdigest(data), "chunks": 2}
    w.raw.put(lkey, codec.encode("blob", head))
    return _replica(
        w, step, member, shards=shards, man=man, lay=lay, raw_layout=codec.encode("blob", head)
    ) + [lkey]


def _blob_head(**head: Any) -> bytes:
    return codec.encode("blob", {"size": 10, "codec": "none", "digest": "0" * 16, "chunks": 0, **head})


@dataclass(frozen=True)
class Case:
    inject: Callable[[World, int], list[str]]
    after_put: bool = True  # write it once the step is committed (else before the put)
    counted: bool = True  # some reader of etcd meets the record (and skips it)
    check: Callable[[World], None] | None = None  # the read path that meets it, beyond put and get_into


def _live_ranks(w: World) -> None:
    assert w.pub.catalog.sessions.live_ranks(w.epoch) == {0}


def _checkpoints(w: World) -> None:
    assert [e.step for e in w.pub.catalog.checkpoints.list()] == [1]


def _plans(w: World) -> None:
    assert w.pub._recovery.agreement.plans() == {}  # the store's own: its skips count in its stats


def _consumers(w: World) -> None:
    assert w.pub.catalog.consumers.ids() == {w.cons.consumer_id}
    w.pub.catalog.consumers.pack_requests(0)


def _retention(w: World) -> None:
    assert w.pub.catalog.versions.flush_retention(30)
    kept = w.pub.catalog.versions.committed_steps()
    assert kept == list(range(w.step - 3, w.step + 1)), (
        kept
    )  # retention 4: bogus index entries push nothing out


def _step_key(*tail: str) -> Callable[[World, int], tuple[str, ...]]:
    return lambda w, step: ("versions", pad20(step), *tail)


CASES: dict[str, Case] = {
    # versions/<step>/: read by every consumer's begin_read
    "extra key under the version": Case(_put(_step_key("junk"), lambda w, s: GARBAGE)),
    "extra deep key under the version": Case(_put(_step_key("pieces", "x", "y", "z"), lambda w, s: GARBAGE)),
    "piece key with a non-numeric epoch": Case(
        _put(lambda w, s: ("versions", pad20(s), "pieces", "epoch!", pad20(0)), lambda w, s: _piece(w, s))
    ),
    "piece key with a short rank": Case(
        _put(
            lambda w, s: ("versions", pad20(s), "pieces", pad20(w.epoch), "7"),
            lambda w, s: _piece(w, s, rank=7),
        )
    ),
    "piece key with an int()-friendly rank": Case(
        _put(
            lambda w, s: ("versions", pad20(s), "pieces", pad20(w.epoch), "+" + pad20(0)[1:]),
            lambda w, s: _piece(w, s),
        )
    ),
    "piece of a rank outside the world": Case(
        _put(
            lambda w, s: ("versions", pad20(s), "pieces", pad20(w.epoch), pad20(5)),
            lambda w, s: _piece(w, s, rank=5),
        )
    ),
    "garbage piece of a fenced epoch (ignored, never read)": Case(
        _put(
            lambda w, s: ("versions", pad20(s), "pieces", pad20(w.epoch + 7), pad20(0)), lambda w, s: GARBAGE
        ),
        counted=False,
    ),
    "replica record of garbage bytes": Case(_put(_step_key("replicas", "g", "m1"), lambda w, s: GARBAGE)),
    "replica record of another kind": Case(_put(_step_key("replicas", "g", "m1"), lambda w, s: _piece(w, s))),
    "replica record naming another member": Case(
        _put(
            _step_key("replicas", "g", "m1"),
            lambda w, s: _enc(
                "replica", step=s, group="g", member="m2", layout_id="0" * 24, manifest_id="0" * 24
            ),
        )
    ),
    "replica record of another step": Case(
        _put(
            _step_key("replicas", "g", "m1"),
            lambda w, s: _enc(
                "replica", step=s + 100, group="g", member="m1", layout_id="0" * 24, manifest_id="0" * 24
            ),
        )
    ),
    "replica record whose layout id is a path": Case(
        _put(
            _step_key("replicas", "g", "m1"),
            lambda w, s: _enc(
                "replica", step=s, group="g", member="m1", layout_id="../../../latest", manifest_id="0" * 24
            ),
        )
    ),
    "replica offer with a bad transport descriptor": Case(lambda w, s: _replica(w, s, "evil")),
    "replica offer of another global shape": Case(
        lambda w, s: _replica(w, s, "evil", shards=[_whole("w", (65,)), _whole("m")])
    ),
    "replica manifest with a box outside its tensor": Case(
        lambda w, s: _replica(
            w, s, "evil", man=_bad_box_manifest(), lay={"layout_id": "0" * 24}, raw_layout=GARBAGE
        )
    ),
    "replica layout filed under another id": Case(lambda w, s: _replica(w, s, "evil", lay_key_id="ab" * 12)),
    "replica layout of another epoch and rank": Case(
        lambda w, s: _replica(
            w,
            s,
            "evil",
            lay=layout_record(4, 3, manifest_record([_whole("w")]), [_whole("w")], GARBAGE),
            shards=[_whole("w")],
        )
    ),
    "replica layout blob with a chunk replaced": Case(
        lambda w, s: _chunked_layout(w, s, "evil", tamper=True)
    ),
    "replica layout blob head of garbage": Case(lambda w, s: _replica(w, s, "evil", raw_layout=GARBAGE)),
    "replica layout blob head claiming 10^15 chunks": Case(
        lambda w, s: _replica(w, s, "evil", raw_layout=_blob_head(chunks=10**15))
    ),
    "replica layout blob of bad zlib": Case(
        lambda w, s: _replica(
            w,
            s,
            "evil",
            raw_layout=_blob_head(
                codec="zlib", data=b"not zlib", digest=xxhash.xxh3_64_hexdigest(b"not zlib")
            ),
        )
    ),
    "replica layout blob head of another kind": Case(
        lambda w, s: _replica(w, s, "evil", raw_layout=_piece(w, s))
    ),
    # torn/<step>/: a stranger's marker of a source this read did not use fails nothing
    "torn marker of a stranger replica": Case(
        _put(lambda w, s: ("torn", pad20(s), "r-stranger"), lambda w, s: GARBAGE), counted=False
    ),
    "torn marker under a non-rank key": Case(
        _put(lambda w, s: ("torn", pad20(s), "zz"), lambda w, s: GARBAGE), counted=False
    ),
    # readers/<step>/: the publisher's retire of the slot it reuses does not wait for non-readers
    "reader record of garbage bytes": Case(
        lambda w, s: [
            _put(lambda w, s: ("readers", pad20(s - d), "stranger"), lambda w, s: GARBAGE)(w, s)[0]
            for d in (1, 2)
        ],
        after_put=False,
    ),
    "reader record naming another reader": Case(
        lambda w, s: [
            _put(
                lambda w, s: ("readers", pad20(s - d), "stranger"),
                lambda w, s: _enc("reader", step=s - d, reader_id="someone", host="h", pid=1),
            )(w, s)[0]
            for d in (1, 2)
        ],
        after_put=False,
    ),
    "reader record of another step": Case(
        lambda w, s: [
            _put(
                lambda w, s: ("readers", pad20(s - d), "stranger"),
                lambda w, s: _enc("reader", step=s + 50, reader_id="stranger", host="h", pid=1),
            )(w, s)[0]
            for d in (1, 2)
        ],
        after_put=False,
    ),
    # consumers/: the publisher's pre-pack requests and its list of live consumers
    "consumer record of garbage bytes": Case(
        _put(lambda w, s: ("consumers", "evil"), lambda w, s: GARBAGE), after_put=False, check=_consumers
    ),
    "consumer record naming another consumer": Case(
        _put(lambda w, s: ("consumers", "evil"), lambda w, s: _enc("consumer", reader_id="other", packs=[])),
        after_put=False,
        check=_consumers,
    ),
    "consumer record of another kind": Case(
        _put(
            lambda w, s: ("consumers", "evil"),
            lambda w, s: _enc("reader", step=1, reader_id="evil", host="h", pid=1),
        ),
        after_put=False,
        check=_consumers,
    ),
    "consumer asking for a box outside the tensor (not servable)": Case(
        _put(
            lambda w, s: ("consumers", "evil2"),
            lambda w, s: _enc(
                "consumer",
                reader_id="evil2",
                packs=[{"rank": 0, "name": "w", "offsets": [60], "sizes": [10]}],
            ),
        ),
        after_put=False,
        counted=False,
    ),
    "consumer asking for a box of another rank": Case(  # and of fewer dims than the tensor
        _put(
            lambda w, s: ("consumers", "evil3"),
            lambda w, s: _enc(
                "consumer", reader_id="evil3", packs=[{"rank": 0, "name": "m", "offsets": [0], "sizes": [2]}]
            ),
        ),
        after_put=False,
        counted=False,
    ),
    # members/<epoch>/: who is alive in the session (recovery waits on it)
    "member record of garbage bytes": Case(
        _put(lambda w, s: ("members", pad20(w.epoch), pad20(3)), lambda w, s: GARBAGE), check=_live_ranks
    ),
    "member record of another rank": Case(
        _put(
            lambda w, s: ("members", pad20(w.epoch), pad20(3)),
            lambda w, s: _enc("member", epoch=w.epoch, rank=4, host="h", pid=1),
        ),
        check=_live_ranks,
    ),
    "member record of another epoch": Case(
        _put(
            lambda w, s: ("members", pad20(w.epoch), pad20(3)),
            lambda w, s: _enc("member", epoch=w.epoch + 1, rank=3, host="h", pid=1),
        ),
        check=_live_ranks,
    ),
    "member key that is not a rank": Case(
        _put(
            lambda w, s: ("members", pad20(w.epoch), "three"),
            lambda w, s: _enc("member", epoch=w.epoch, rank=3, host="h", pid=1),
        ),
        check=_live_ranks,
    ),
    # checkpoints/: the index restore and recover read
    "checkpoint record of garbage bytes": Case(
        _put(lambda w, s: ("checkpoints", pad20(7)), lambda w, s: GARBAGE), check=_checkpoints
    ),
    "checkpoint record of another step": Case(
        _put(
            lambda w, s: ("checkpoints", pad20(7)),
            lambda w, s: _enc("checkpoint", step=8, uri="file:///x", world_size=1, bytes=1, written_at=0.0),
        ),
        check=_checkpoints,
    ),
    "checkpoint record of another kind": Case(
        _put(
            lambda w, s: ("checkpoints", pad20(7)),
            lambda w, s: _enc("commit", step=7, epoch=1, world_size=1, committed_at=0.0),
        ),
        check=_checkpoints,
    ),
    "checkpoint key that is not a step": Case(
        _put(
            lambda w, s: ("checkpoints", "latest"),
            lambda w, s: _enc("checkpoint", step=7, uri="file:///x", world_size=1, bytes=1, written_at=0.0),
        ),
        check=_checkpoints,
    ),
    # recovery/<epoch>/: the rounds a recovering session agrees on
    "recovery plan of garbage bytes": Case(
        _put(lambda w, s: ("recovery", pad20(w.epoch), pad20(0), "plan"), lambda w, s: GARBAGE), check=_plans
    ),
    "recovery plan of another round": Case(
        _put(
            lambda w, s: ("recovery", pad20(w.epoch), pad20(0), "plan"),
            lambda w, s: _enc(
                "recovery_plan", epoch=w.epoch, round=5, rank=0, action="nothing", reason="x", decided_at=0.0
            ),
        ),
        check=_plans,
    ),
    "recovery outcome of another rank": Case(
        _put(
            lambda w, s: ("recovery", pad20(w.epoch), pad20(0), "ranks", pad20(1)),
            lambda w, s: _enc("recovery_outcome", epoch=w.epoch, round=0, rank=2, status="ok"),
        ),
        check=_plans,
    ),
    "recovery key that is not a round": Case(
        _put(lambda w, s: ("recovery", pad20(w.epoch), "1_0", "plan"), lambda w, s: GARBAGE), check=_plans
    ),
    # commits/: the index retention reads
    "commit index key that is not a step": Case(
        _put(lambda w, s: ("commits", "zzz"), lambda w, s: b""), after_put=False, check=_retention
    ),
    "commit index entry without a version": Case(
        _put(lambda w, s: ("commits", pad20(10**18)), lambda w, s: b""), after_put=False, check=_retention
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_a_bad_record_is_skipped_counted_and_stops_no_one(world: World, case: Case) -> None:
    step = world.step + 1
    torn_before, skipped_before = world.cons.stats.torn_retries, world.skipped()
    keys = [] if case.after_put else case.inject(world, step)
    try:
        world.put(step)
        assert world.torn_marks() == 0  # no stranger's record held a retire until it marked a version torn
        if case.after_put:
            keys = case.inject(world, step)
        world.pull(step)
        if case.check is not None:
            case.check(world)
        assert world.cons.stats.torn_retries == torn_before  # read once, not torn by a stranger
        if case.counted:
            assert world.skipped() > skipped_before
    finally:
        for k in keys:
            world.raw.delete_prefix(k)  # the key and any chunks under it
    world.put(step + 1)  # and the next step still syncs
    world.pull(step + 1)


def test_a_replica_record_gets_only_the_layout_at_its_own_key(world: World, etcd: Any) -> None:
    """A record naming a layout id already cached (verified at another member's key) does not get it."""
    step = world.step + 1
    world.put(step)
    world.pull(step)
    with Store(world.ns, endpoint=etcd.endpoint, transport="shm") as late:
        world.cons.serve(step, world.bufs, group="g")  # a real re-serving consumer
        bufs = {n: torch.zeros(s) for n, s in SHAPES.items()}
        assert late.get_into(bufs, step=step, timeout=20) == step  # caches the real replica's layout
        real = late.catalog.versions.layouts_of(late.catalog.versions.read_version(step))
        assert world.cons.consumer_id in real.replica_layouts
        rp = real.replicas[world.cons.consumer_id]
        key = world.key("versions", pad20(step), "replicas", "g", "impostor")
        world.raw.put(
            key,
            _enc(
                "replica",
                step=step,
                group="g",
                member="impostor",
                layout_id=rp.layout_id,
                manifest_id=rp.manifest_id,
            ),
        )
        v = late.catalog.versions.layouts_of(late.catalog.versions.read_version(step))
        assert "impostor" in v.replicas and "impostor" not in v.replica_layouts
        assert world.cons.consumer_id in v.replica_layouts
        world.raw.delete(key)
    world.put(step + 1)  # get_into withdraws the offer first
    world.pull(step + 1)


# ---- authority records: a typed error naming the key, never wrong bytes ------------------------


@pytest.fixture
def fresh(etcd: Any) -> Iterator[World]:
    w = World(etcd.endpoint)
    yield w
    w.close()


def _corrupt_commit(value: Callable[[World], bytes]) -> Callable[[World], str]:
    def go(w: World) -> str:
        key = w.key("versions", pad20(2), "commit")
        w.raw.put(key, value(w))
        return key

    return go


def _corrupt_piece(value: Callable[[World], bytes]) -> Callable[[World], str]:
    def go(w: World) -> str:
        key = w.key("versions", pad20(2), "pieces", pad20(w.epoch), pad20(0))
        w.raw.put(key, value(w))
        return key

    return go


VERSION_CORRUPTIONS = {
    "commit of garbage bytes": _corrupt_commit(lambda w: GARBAGE),
    "commit of another kind": _corrupt_commit(lambda w: _piece(w, 2)),
    "commit of another step": _corrupt_commit(
        lambda w: _enc("commit", step=1, epoch=w.epoch, world_size=1, committed_at=0.0)
    ),
    "commit of another epoch": _corrupt_commit(
        lambda w: _enc("commit", step=2, epoch=w.epoch + 3, world_size=1, committed_at=0.0)
    ),
    "commit of a world of 10^15 ranks": _corrupt_commit(
        lambda w: _enc("commit", step=2, epoch=w.epoch, world_size=10**15, committed_at=0.0)
    ),
    "committed piece of garbage bytes": _corrupt_piece(lambda w: GARBAGE),
    "committed piece of another rank": _corrupt_piece(lambda w: _piece(w, 2, rank=1)),
    "committed piece of another step": _corrupt_piece(lambda w: _piece(w, 3)),
    "committed piece whose layout id is a path": _corrupt_piece(
        lambda w: _enc(
            "piece",
            step=2,
            epoch=w.epoch,
            rank=0,
            world_size=1,
            layout_id="../x",
            base_offset=0,
            manifest_id="0" * 24,
        )
    ),
}


@pytest.mark.parametrize("corrupt", list(VERSION_CORRUPTIONS.values()), ids=list(VERSION_CORRUPTIONS))
def test_a_bad_commit_or_committed_piece_is_a_typed_error_and_no_bytes(fresh: World, corrupt: Any) -> None:
    w = fresh
    w.put(1)
    w.pull(1)
    w.put(2)
    key = corrupt(w)
    sentinel = {n: torch.full(s, -7.0) for n, s in SHAPES.items()}
    for step in (2, None):
        with pytest.raises(CatalogCorrupted) as err:
            w.cons.get_into(sentinel, step=step, timeout=10)
        assert key in str(err.value) or err.value.key == key
        assert err.value.key is not None and err.value.key.startswith(w.key("versions", pad20(2)))
    assert all(bool((t == -7.0).all()) for t in sentinel.values())  # no byte of the bad version
    with pytest.raises(CatalogCorrupted):
        w.cons.catalog.versions.read_version(2)
    w.put(3)  # nobody else stops: the next version syncs
    w.pull(3)


def test_bad_latest_is_a_typed_error(fresh: World) -> None:
    w = fresh
    w.put(1)
    w.pull(1)
    w.pull(1)  # the second wait opens the consumer's watch on latest (the first is one read)
    key = w.key("latest")
    skipped = w.cons.stats.bad_records
    w.raw.put(key, b"not a counter")
    for s in (w.pub, w.cons):
        with pytest.raises(CatalogCorrupted) as err:
            s.latest()
        assert err.value.key == key
    with pytest.raises(CatalogCorrupted) as err:
        w.pub.put(2, _tensors(2))  # the commit compares latest: refused, and said why
    assert err.value.key == key
    # The consumer's watch sees the bad record and skips it.
    wait_until(
        lambda: w.cons.stats.bad_records != skipped, 10, message="the watch never skipped the bad latest"
    )
    sentinel = {n: torch.full(s, -7.0) for n, s in SHAPES.items()}
    with pytest.raises((CatalogCorrupted, WaitTimeout)):
        w.cons.get_into(sentinel, step=2, timeout=1)
    assert all(bool((t == -7.0).all()) for t in sentinel.values())
    w.pull(1)  # the committed version is still readable, byte-exact


def test_bad_epoch_is_a_typed_error(fresh: World) -> None:
    w = fresh
    w.put(1)
    key = w.key("epoch")
    w.raw.put(key, GARBAGE)
    with pytest.raises(CatalogCorrupted) as err:
        w.pub.catalog.sessions.epoch()
    assert err.value.key == key
    with pytest.raises(CatalogCorrupted) as err:
        w.pub.put(2, _tensors(2))
    assert err.value.key == key
    w.pull(1)  # consumers of committed versions are not stopped


def test_bad_session_record_is_a_typed_error(fresh: World, etcd: Any) -> None:
    w = fresh
    w.put(1)
    key = w.key("session")
    w.raw.put(key, _enc("member", epoch=1, rank=0, host="h", pid=1))  # a record of another kind
    with pytest.raises(CatalogCorrupted) as err:
        w.pub.catalog.sessions.record()
    assert err.value.key == key
    with Catalog(etcd.endpoint, w.ns) as joiner:
        with pytest.raises(CatalogCorrupted):
            joiner.sessions.open(rank=1, world_size=2, join_timeout=2)
    w.put(2)  # the open session goes on
    w.pull(2)


# ---- torn markers per source; re-registration after a lost lease ---------------------------


def test_end_read_checks_only_the_torn_markers_of_its_sources(catalog_factory: Any) -> None:
    cat = catalog_factory()
    c = cat.client
    r = cat.readers
    reader = lambda step, rid, sources: (r.begin_read(step, rid), r.end_read(step, rid, sources))[1]  # noqa: E731
    pub = catalog_factory()
    pub.sessions.open(rank=0, world_size=1)
    lid = pub.versions.write_layout([_whole("w")], b"t")
    assert pub.versions.put_piece(1, lid)
    c.raw.put(c.key("torn", pad20(1), "r-slow"), b"")  # one re-serving consumer tore its readers
    assert reader(1, "a", {0}) is True  # read from the publisher only: not torn
    assert reader(1, "b", {0, "r-fast"}) is True
    assert reader(1, "c", {0, "r-slow"}) is False  # it did read from the torn source
    assert reader(1, "d", None) is False  # no sources given: every marker counts
    assert reader(1, "e", set(range(40))) is True  # many ranks: one range compare over rank markers
    assert reader(1, "f", {f"r-m{i}" for i in range(40)}) is True
    assert reader(1, "g", {f"r-m{i}" for i in range(40)} | {"r-slow"}) is False
    assert reader(1, "g2", {f"r-m{i}" for i in range(100)}) is False  # past 64: one range over every replica
    c.raw.put(c.key("torn", pad20(1), pad20(33)), b"")
    assert reader(1, "h", set(range(40))) is False
    assert reader(1, "i", {0, 1}) is True
    # A reader whose record someone overwrote was maybe not waited for: its read fails.
    r.begin_read(1, "j")
    c.raw.put(c.key("readers", pad20(1), "j"), GARBAGE)
    assert r.end_read(1, "j", {0}) is False


def test_a_consumer_registers_again_when_its_lease_is_recreated(etcd: Any) -> None:
    ns = "rereg-" + uuid.uuid4().hex[:8]
    # A column slice of a row-major tensor: the consumer asks the publisher for a pre-packed copy.
    src = {"w": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)}
    from astate_store import Shard

    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm") as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm", lease_ttl=1.5) as cons,
    ):
        buf = torch.zeros(256, 4)
        want = {"w": Shard(buf, (0, 8), (256, 256))}
        key = cons.catalog.client.key("consumers", cons.consumer_id)
        for step in (1, 2):
            pub.put(step, src)
            assert cons.get_into(want, step=step, timeout=20) == step
            assert torch.equal(buf, src["w"][:, 8:12])
        value, meta = cons.catalog.client.raw.get(key)
        packs = codec.decode("consumer", value)["packs"]
        assert packs, "the consumer asked for no pre-packed copy: the test needs one"
        old = meta.lease_id
        cons.catalog.client.raw.revoke_lease(old)  # the lease is gone: so are its records
        assert cons.catalog.client.raw.get(key)[0] is None
        # The keep-alive notices; a new lease is made.
        wait_until(
            lambda: cons.catalog.client.reader_lease() != old, 10, message="the lost lease was never noticed"
        )
        pub.put(3, src)
        assert cons.get_into(want, step=3, timeout=20) == 3
        value, meta = cons.catalog.client.raw.get(key)
        assert value is not None and meta.lease_id not in (0, old)
        assert codec.decode("consumer", value)["packs"] == packs  # the pre-pack requests were sent again
        assert cons.consumer_id in pub.catalog.consumers.ids()
        pub.put(4, src)
        assert cons.get_into(want, step=4, timeout=20) == 4
        assert torch.equal(buf, src["w"][:, 8:12])


# ---- fuzzing every decoder ---------------------------------------------------------------------


class _Meta:
    def __init__(self, key: bytes, rev: int = 1):
        self.key, self.mod_revision = key, rev


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=24)
    | st.binary(max_size=48)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _fields(kind: str) -> list[str]:
    return sorted(codec.schema_of(kind).get("properties", {}))


@st.composite
def _tagged(draw: st.DrawFn, kind: str | None = None) -> tuple[str, bytes]:
    """A msgpack map tagged as a ``kind`` record, with that kind's fields (and others) of any value."""
    kind = kind or draw(st.sampled_from(codec.KINDS))
    names = st.sampled_from(_fields(kind)) | st.text(max_size=8)
    rec = draw(st.dictionaries(names, _values, max_size=8))
    rec["schema"] = draw(st.sampled_from([f"{kind}/1", f"{kind}/2", "commit/1", 7]))
    return kind, msgpack.packb(rec, use_bin_type=True)


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.sampled_from(codec.KINDS), st.binary(max_size=96) | _tagged().map(lambda t: t[1]))
def test_fuzz_every_kind_decodes_or_raises_codec_error(kind: str, data: bytes) -> None:
    try:
        codec.decode(kind, data)
    except CodecError:
        pass


@_FUZZ
@given(_tagged())
def test_fuzz_records_tagged_as_their_kind(tagged: tuple[str, bytes]) -> None:
    kind, data = tagged
    try:
        codec.decode(kind, data)
    except CodecError:
        pass


_i64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6).map(
    lambda v: b"".join(x.to_bytes(8, "little", signed=True) for x in v)
)
_columns = st.fixed_dictionaries(
    {
        "names": st.lists(st.text(max_size=6), max_size=3),
        "dtypes": st.binary(max_size=3),
        "ndims": st.binary(max_size=3),
        "global_shapes": _i64s | st.binary(max_size=20),
        "offsets": _i64s | st.binary(max_size=20),
        "sizes": _i64s | st.binary(max_size=20),
    }
)


@_FUZZ
@given(_columns, st.booleans())
def test_fuzz_manifests(cols: dict[str, Any], honest_id: bool) -> None:
    rec = {"manifest_id": manifest_id_of(cols) if honest_id else "0" * 24, **cols}
    try:
        m = manifest_from_record(rec, rec["manifest_id"])
    except CodecError:
        return
    assert len(m.records(0)) == len(m.names)  # what decodes can be used


@_FUZZ
@given(
    st.lists(st.sampled_from([_whole("w"), _whole("m"), _whole("w", (3, 5))]), max_size=3),
    st.fixed_dictionaries(
        {"strides": _i64s | st.binary(max_size=20), "regions": _i64s, "byte_offsets": _i64s}
    ),
    st.none() | _columns.map(lambda c: {**c, "regions": b"\0" * 8, "byte_offsets": b"\0" * 8}),
    st.integers(0, 3),
    st.integers(0, 3),
    st.booleans(),
)
def test_fuzz_layouts(
    shards: list[ShardRecord],
    cols: dict[str, bytes],
    packed: dict[str, Any] | None,
    epoch: int,
    rank: int,
    honest_id: bool,
) -> None:
    man = manifest_record(shards)
    m = manifest_from_record(man, man["manifest_id"])
    rec: dict[str, Any] = {
        "epoch": epoch,
        "rank": rank,
        "manifest_id": man["manifest_id"],
        "transport": b"t",
        **cols,
    }
    if packed is not None:
        rec["packed"] = packed
    rec["layout_id"] = layout_id_of(rec) if honest_id else "1" * 24
    try:
        layout_from_record(rec, m, key_id=rec["layout_id"], epoch=0, rank=rank)
    except CodecError:
        pass


_SEGMENTS = st.sampled_from([pad20(0), pad20(1), pad20(3), "7", "x", "", "+0000000000000000001"]) | st.text(
    max_size=5
)


@st.composite
def _version_kv(draw: st.DrawFn) -> tuple[bytes, _Meta]:
    pre = "/astate/ns/versions/" + pad20(3) + "/"
    tail = draw(
        st.sampled_from(["commit", "pieces/{}/{}", "replicas/{}/{}", "{}", "pieces/{}", "{}/{}/{}/{}"])
    )
    key = pre + tail.format(*(draw(_SEGMENTS) for _ in range(tail.count("{}"))))
    if draw(st.booleans()):
        key = draw(st.sampled_from(["/astate/other/versions/x", pre[:-1]])) if draw(st.booleans()) else key
    ep = st.integers(0, 3)
    value = draw(
        st.binary(max_size=32)
        | _tagged().map(lambda t: t[1])
        | st.builds(
            lambda *v: _enc("commit", step=v[0], epoch=v[1], world_size=v[2], committed_at=0.0),
            st.integers(2, 4),
            ep,
            st.integers(1, 3) | st.integers(1, 2**62),
        )
        | st.builds(
            lambda *v: _enc(
                "piece",
                step=v[0],
                epoch=v[1],
                rank=v[2],
                world_size=v[3],
                layout_id=v[4],
                base_offset=0,
                manifest_id="0" * 24,
            ),
            st.integers(2, 4),
            ep,
            st.integers(0, 3),
            st.integers(1, 3),
            st.sampled_from(["0" * 24, "x"]),
        )
        | st.builds(
            lambda *v: _enc(
                "replica", step=v[0], group=v[1], member=v[2], layout_id="0" * 24, manifest_id="0" * 24
            ),
            st.integers(2, 4),
            _SEGMENTS,
            _SEGMENTS,
        )
    )
    raw = key.encode() if draw(st.booleans()) else key.encode() + b"\xff"
    return value, _Meta(raw)


@_FUZZ
@given(st.lists(_version_kv(), max_size=8))
def test_fuzz_versions(kvs: list[tuple[bytes, _Meta]]) -> None:
    skipped: list[str] = []
    try:
        v = version_from_kvs("ns", 3, kvs, lambda k, why, rev: skipped.append(k))
    except (VersionNotFound, CatalogCorrupted):
        return
    assert sorted(v.pieces) == list(range(v.world_size))
    assert all((p.step, p.epoch, p.rank) == (3, v.epoch, r) for r, p in v.pieces.items())
    assert all(rp.step == 3 for rp in v.replicas.values())


@st.composite
def _blob_kvs(draw: st.DrawFn) -> list[tuple[bytes, _Meta]]:
    key = "/astate/ns/manifests/k"
    head = draw(
        st.binary(max_size=40)
        | _tagged("blob").map(lambda t: t[1])
        | st.builds(
            lambda size, how, chunks, data: codec.encode(
                "blob",
                {
                    "size": size,
                    "codec": how,
                    "chunks": chunks,
                    "digest": xxhash.xxh3_64_hexdigest(data),
                    "data": data,
                },
            ),
            st.integers(0, 64),
            st.sampled_from(["none", "zlib"]),
            st.integers(0, 4) | st.integers(0, 10**18),
            st.binary(max_size=32),
        )
    )
    kvs = [(head, _Meta(key.encode()))] if draw(st.integers(0, 9)) else []
    for tail in draw(
        st.lists(st.sampled_from(["000000", "000001", "000003", "x", "", "000000/1"]), max_size=4)
    ):
        kvs.append((draw(st.binary(max_size=16)), _Meta(f"{key}/{tail}".encode())))
    if draw(st.booleans()):
        kvs.append((b"", _Meta(key.encode() + b"/\xff")))
    return kvs


@_FUZZ
@given(_blob_kvs())
def test_fuzz_blobs_through_the_reading_path(kvs: list[tuple[bytes, _Meta]]) -> None:
    key = "/astate/ns/manifests/k"
    try:
        blob_from_kvs(key, _checked_blob_kvs(key, kvs))
    except CodecError:
        pass


@_FUZZ
@given(_blob_kvs().filter(lambda kvs: all(b"\xff" not in m.key for _v, m in kvs)))
def test_fuzz_blob_from_kvs(kvs: list[tuple[bytes, _Meta]]) -> None:
    # blob_from_kvs itself; heads claiming more chunks than present are refused before it (see above)
    key = "/astate/ns/manifests/k"
    try:
        _checked_blob_kvs(key, kvs)
    except CodecError:
        return
    try:
        blob_from_kvs(key, kvs)
    except CodecError:
        pass
