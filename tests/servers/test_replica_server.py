"""Replica servers (``astate serve``) and the key-value surface (``get``, ``keys``), over real etcd.

Separate processes where it matters: a writer with several namespaces is SIGKILLed and every
namespace is read back — ``get`` and ``recover`` — from ``python -m astate_store.servers.replica``
processes; a server is SIGKILLed and reads fall back to the second one, then (both gone) recovery
falls back to the checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from astate_store import LayoutError, PeerUnreachable, ReplicationTimeout, Shard, VersionNotFound, WaitTimeout
from astate_store.get.kv import KeyInfo
from astate_store.servers.replica import ReplicaServer, parse_bytes
from astate_store.store import Store, connect
from tests._procs import CTX
from tests.support.data import value

pytestmark = pytest.mark.timeout(120)

_SPECS = {"w": ((40, 24), torch.float32), "emb": ((10, 8), torch.bfloat16), "pos": ((3,), torch.int64)}


def _shape(name: str, i: int) -> tuple[int, ...]:
    shape, _dt = _SPECS[name]
    return (shape[0] + i, *shape[1:])  # namespaces differ in shape: each is held as published


def _value(name: str, i: int, step: int) -> torch.Tensor:
    """Deterministic contents of tensor ``name`` of namespace ``i`` at ``step``."""
    return value(f"{name}.{i}", _shape(name, i), _SPECS[name][1], step)


def _tensors(i: int, step: int) -> dict[str, torch.Tensor]:
    return {n: _value(n, i, step) for n in _SPECS}


def writer_main(endpoint: str, names: list[str], uri: str, out: Any) -> None:
    """A trainer process holding several namespaces; each put waits until 2 servers hold it."""
    stores = [
        connect(ns, etcd=endpoint, transport="shm", lease_ttl=2.0, replicas=2, replica_timeout=60.0)
        for ns in names
    ]
    try:
        for step in (1, 2):
            for i, st in enumerate(stores):
                st.put(step, _tensors(i, step))
        stores[-1].checkpoint(2, uri)
        out.put(("ready", os.getpid()))
    except Exception as exc:  # reported to the test, which fails on it
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    time.sleep(300)  # SIGKILLed by the test


def _server(endpoint: str, prefix: str, log: Path, *, cli: bool) -> subprocess.Popen[bytes]:
    """A replica server process: ``astate serve`` (the CLI), or the module's own ``main``."""
    entry = ["-m", "astate_store.cli", "-v", "serve"] if cli else ["-m", "astate_store.servers.replica", "-v"]
    return subprocess.Popen(
        [
            sys.executable,
            *entry,
            "--etcd",
            endpoint,
            "--namespace-prefix",
            prefix,
            "--memory-bytes",
            "64MiB",
            "--transport",
            "shm",
            "--lease-ttl",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


def _kill(p: Any) -> None:
    if p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.wait() if isinstance(p, subprocess.Popen) else p.join(10)


def _assert_namespace(got: dict[str, torch.Tensor], i: int, step: int) -> None:
    assert sorted(got) == sorted(_SPECS)
    for n, t in got.items():
        want = _value(n, i, step)
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), n


def test_namespaces_outlive_their_writer_on_servers_then_the_checkpoint(etcd: Any, tmp_path: Path) -> None:
    prefix = "rs" + uuid.uuid4().hex[:8]
    names = [f"{prefix}-{i}" for i in range(3)]
    servers = [_server(etcd.endpoint, prefix, tmp_path / f"server{k}.log", cli=k == 0) for k in range(2)]
    out = CTX.Queue()
    writer = CTX.Process(
        target=writer_main, args=(etcd.endpoint, names, str(tmp_path / "ckpt"), out), daemon=True
    )
    writer.start()
    try:
        msg = out.get(timeout=90)
        assert msg[0] == "ready", msg  # every put returned: both servers held every version
        _kill(writer)
        assert writer.exitcode == -signal.SIGKILL
        # The writer is gone: every namespace is read back, whole, from the servers.
        for i, ns in enumerate(names):
            with connect(ns, etcd=etcd.endpoint, transport="shm") as st:
                assert st.keys() == {
                    n: KeyInfo(_shape(n, i), str(_SPECS[n][1]).removeprefix("torch."), _value(n, i, 2).nbytes)
                    for n in _SPECS
                }
                step, got = st.get(timeout=30)
                assert step == 2
                _assert_namespace(got, i, 2)
                # The writer's process is gone (its lease may live on): it was not dialled.
                assert st.stats.failovers == 0
        # One server killed: reads fall back to the other one (its lease may not have expired yet).
        _kill(servers[0])
        for i, ns in enumerate(names):
            with connect(ns, etcd=etcd.endpoint, transport="shm") as st:
                step, got = st.get(["w", "pos"], timeout=30)
                assert step == 2 and sorted(got) == ["pos", "w"]
                assert torch.equal(got["w"], _value("w", i, 2)) and torch.equal(
                    got["pos"], _value("pos", i, 2)
                )
                assert st.stats.failovers == 0  # the dead server is not dialled either
        # A restarted trainer recovers namespace 0 from the surviving server and republishes it.
        with connect(names[0], etcd=etcd.endpoint, transport="shm", lease_ttl=2.0) as trainer:
            bufs = {n: torch.zeros(_shape(n, 0), dtype=_SPECS[n][1]) for n in _SPECS}
            assert trainer.recover(bufs, timeout=30) == 2
            _assert_namespace(bufs, 0, 2)
            assert trainer.catalog.versions.read_version(2).epoch > 1  # republished by the new session
        # Both servers gone: namespace 2 comes back from its checkpoint, namespace 1 from nowhere.
        _kill(servers[1])
        with connect(names[2], etcd=etcd.endpoint, transport="shm", lease_ttl=2.0) as trainer:
            bufs = {n: torch.zeros(_shape(n, 2), dtype=_SPECS[n][1]) for n in _SPECS}
            assert trainer.recover(bufs, timeout=30) == 2
            _assert_namespace(bufs, 2, 2)
        with connect(names[1], etcd=etcd.endpoint, transport="shm") as st:
            with pytest.raises(PeerUnreachable):
                st.get(timeout=10)
    finally:
        _kill(writer)
        for s in servers:
            _kill(s)


def test_put_with_replicas_times_out_typed_without_a_server(etcd: Any, namespace: str) -> None:
    with pytest.raises(ValueError, match="replicas"):
        connect(namespace, etcd=etcd.endpoint, replicas=-1)
    with connect(namespace, etcd=etcd.endpoint, transport="shm", replicas=1, replica_timeout=0.5) as st:
        with pytest.raises(ReplicationTimeout, match="0 of the 1 replica servers") as ei:
            st.put(1, {"w": torch.ones(4)})
        assert (ei.value.step, ei.value.held) == (1, 0)
        assert st.latest() == 1  # committed all the same: only the replication is missing


@pytest.fixture
def pair(etcd: Any, namespace: str) -> Iterator[tuple[Store, Store]]:
    w = Store(namespace, endpoint=etcd.endpoint, transport="shm", session_id=namespace)
    r = Store(namespace, endpoint=etcd.endpoint, transport="shm")
    yield w, r
    r.close()
    w.close()


def test_get_and_keys_round_trip(pair: tuple[Store, Store]) -> None:
    w, r = pair
    assert r.keys() == {}
    with pytest.raises(WaitTimeout):
        r.get(timeout=0.2)
    w.put(1, _tensors(0, 1))
    info = r.keys()
    assert list(info) == sorted(_SPECS)
    assert info["emb"] == KeyInfo((10, 8), "bfloat16", 160) and info["w"].nbytes == 40 * 24 * 4
    step, got = r.get(timeout=10)
    assert step == 1
    _assert_namespace(got, 0, 1)
    assert list(r.get("pos")[1]) == ["pos"]
    with pytest.raises(LayoutError, match=r"\['zz', 'yy'\]"):
        r.get(["w", "zz", "yy"])
    with pytest.raises(LayoutError, match="names"):
        r.get([1, 2])  # type: ignore[list-item]
    with pytest.raises(VersionNotFound):
        r.keys(step=7)
    # A new version with other shapes and names: get allocates for it; keys(1) still lists step 1.
    w.put(2, {"w": torch.full((5, 3), 2.0), "extra": torch.arange(6, dtype=torch.int32)})
    step, got = r.get(step=2, timeout=10)
    assert step == 2 and sorted(got) == ["extra", "w"]
    assert torch.equal(got["w"], torch.full((5, 3), 2.0))
    assert torch.equal(got["extra"], torch.arange(6, dtype=torch.int32))
    assert r.keys(1)["w"].global_shape == (40, 24) and "extra" not in r.keys(1)


def test_get_assembles_shards_of_several_ranks(etcd: Any, namespace: str) -> None:
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    ranks = [
        Store(namespace, endpoint=etcd.endpoint, transport="shm", rank=k, world_size=2, session_id=namespace)
        for k in range(2)
    ]
    try:
        for k, st in enumerate(ranks):
            st.put(3, {"m": Shard(full[:, 3 * k : 3 * k + 3].clone(), (0, 3 * k), (8, 6))})
        with Store(namespace, endpoint=etcd.endpoint, transport="shm") as r:
            assert r.keys()["m"] == KeyInfo((8, 6), "float32", 192)
            step, got = r.get(timeout=10)
            assert step == 3 and torch.equal(got["m"], full)
    finally:
        for st in ranks:
            st.close()


def test_get_never_mixes_versions_while_shapes_change(pair: tuple[Store, Store]) -> None:
    w, r = pair
    steps = 30

    def tensors(s: int) -> dict[str, torch.Tensor]:
        # Every fourth step changes the shapes: a get listing one version may pull a newer one.
        k = s // 4 % 3
        return {"a": torch.full((k + 1, 4), float(s)), "b": torch.full((2, k + 2), float(-s))}

    w.put(1, tensors(1))
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            for s in range(2, steps + 1):
                w.put(s, tensors(s))
                time.sleep(0.01)  # a trainer step takes a while
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    seen = set()
    while t.is_alive() or not seen:
        step, got = r.get(timeout=10)
        want = tensors(step)
        for n in want:
            assert got[n].shape == want[n].shape and torch.equal(got[n], want[n]), (step, n)
        seen.add(step)
    t.join()
    assert not errors, errors
    assert r.get()[0] == steps


def test_server_budget_keeps_the_most_recently_committed(etcd: Any) -> None:
    prefix = "rb" + uuid.uuid4().hex[:8]
    names = [f"{prefix}-{i}" for i in range(3)]
    one = torch.ones(64 << 10, dtype=torch.uint8)  # 64 KiB per namespace
    server = ReplicaServer(etcd.endpoint, prefix, parse_bytes("160KiB"), transport="shm", lease_ttl=2.0)
    th = threading.Thread(target=server.run)
    writers = [
        Store(ns, endpoint=etcd.endpoint, transport="shm", session_id=ns, replicas=1, replica_timeout=30)
        for ns in names
    ]
    th.start()
    try:
        for i, st in enumerate(writers):
            st.put(1, {"x": one * i})  # returns once the server holds it
        # Room for two namespaces (single-buffered): the least recently committed one was evicted.
        assert sorted(server.held) == names[1:]
        assert server.used_bytes <= 160 << 10
        writers[0].put(2, {"x": one * 10})  # namespace 0 is now the newest: namespace 1 makes room
        assert sorted(server.held) == [names[0], names[2]]
        with connect(names[0], etcd=etcd.endpoint, transport="shm") as r:
            assert torch.equal(r.get(timeout=10)[1]["x"], one * 10)
        assert parse_bytes("1.5k") == 1500 and parse_bytes("2MiB") == 2 << 20
        with pytest.raises(ValueError):
            parse_bytes("lots")
    finally:
        server.stop()
        th.join(30)
        for st in writers:
            st.close()
    assert not th.is_alive() and server.held == {}
