"""Streamed tcp reads (transport/stream.py) against real publishers in separate processes: bytes
exact over scattered plans, keys and bounds enforced by the server, an unreachable stream address
served by UCX instead, a stalled or dead publisher a typed error with no late write."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astate_store.errors import PeerUnreachable, TransportError
from astate_store.transport import PeerDescriptor, UcxTransport
from astate_store.transport import stream as S
from astate_store.transport.stream import client as stream_client
from astate_store.transport.stream import server as stream_server
from astate_store.transport.stream import wire as stream_wire
from tests._transport_peer import pattern
from tests.support.waiting import wait_until
from tests.transport.test_transport import Peer, _wait_stopped, ops_for

pytestmark = pytest.mark.timeout(120)


def _scattered(
    p: int, region: int, n: int, dst: torch.Tensor, rows: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """A plan of ``rows`` equal pieces of ``region`` landing at shuffled places of ``dst`` (what a
    reshard does); the permutation to check them with."""
    piece = n // rows
    perm = np.random.default_rng(seed).permutation(rows)
    ops = np.zeros((rows, 5), dtype=np.uint64)
    ops[:, 0], ops[:, 1] = p, region
    ops[:, 2] = np.arange(rows, dtype=np.uint64) * piece
    ops[:, 3] = dst.data_ptr() + perm.astype(np.uint64) * piece
    ops[:, 4] = piece
    return ops, perm


def _check_scattered(dst: torch.Tensor, perm: np.ndarray, n: int, seed: int) -> None:
    piece = n // len(perm)
    src, got = pattern(n, seed), dst.numpy()
    want = np.empty(len(perm) * piece, dtype=np.uint8)
    want.reshape(len(perm), piece)[perm] = src[: len(perm) * piece].reshape(len(perm), piece)
    assert np.array_equal(got[: len(want)], want)


def test_tcp_pull_is_streamed_and_byte_exact_over_two_regions() -> None:
    a, b = 4 << 20, 1 << 16
    peer = Peer("tcp", [a, b])
    try:
        with UcxTransport("tcp") as t:
            p = t.connect("p", peer.descriptor)
            assert t.peer_info("p").streamed
            assert PeerDescriptor.from_dict(peer.descriptor).stream
            dst_a, dst_b = torch.zeros(a, dtype=torch.uint8), torch.zeros(b, dtype=torch.uint8)
            ops_a, perm = _scattered(p, 0, a, dst_a, 4096, seed=1)
            ops_b = ops_for([(p, 1, 100, dst_b.data_ptr(), b - 100)])
            for _ in range(2):  # the second reuses the pooled connection
                dst_a.zero_(), dst_b.zero_()
                t.get(np.concatenate([ops_a[:2000], ops_b, ops_a[2000:]]), timeout=60)
                _check_scattered(dst_a, perm, a, 0)
                assert np.array_equal(dst_b.numpy()[: b - 100], pattern(b, 1)[100:])
            assert t.streamed_bytes == 2 * (a + b - 100)
        with UcxTransport("tcp", stream=False) as u:  # the same plan through UCX: the same bytes
            p = u.connect("p", peer.descriptor)
            assert not u.peer_info("p").streamed
            dst_a.zero_()
            u.get(_scattered(p, 0, a, dst_a, 4096, seed=1)[0], timeout=60)
            _check_scattered(dst_a, perm, a, 0)
            assert u.streamed_bytes == 0
    finally:
        peer.stop()


def test_same_host_peers_keep_shared_memory_in_auto_mode() -> None:
    peer = Peer("auto", [1 << 20])
    try:
        with UcxTransport("auto") as t:
            p = t.connect("p", peer.descriptor)
            info = t.peer_info("p")
            assert info.direct and not info.streamed
            dst = torch.zeros(1 << 20, dtype=torch.uint8)
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), 1 << 20)]), timeout=30)
            assert np.array_equal(dst.numpy(), pattern(1 << 20, 0)) and t.streamed_bytes == 0
    finally:
        peer.stop()


def test_a_wrong_stream_key_is_refused_and_ucx_reads_instead() -> None:
    """The server refuses a key it does not hold (checked on connecting, before any row is asked);
    the UCX rkey of the same descriptor still governs a UCX read of it."""
    peer = Peer("tcp", [1 << 20])
    try:
        forged = dict(peer.descriptor)
        forged["regions"] = [dict(r) for r in forged["regions"]]
        forged["regions"][0]["stream_key"] = b"\x01" * S.KEY_BYTES
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        with UcxTransport("tcp") as t:
            p = t.connect("p", forged)
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), 1 << 20)]), timeout=30)
            assert np.array_equal(dst.numpy(), pattern(1 << 20, 0)) and t.streamed_bytes == 0
        dst.zero_()
        with UcxTransport("tcp") as t:  # the true key streams
            p = t.connect("p", peer.descriptor)
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), 1 << 20)]), timeout=30)
            assert np.array_equal(dst.numpy(), pattern(1 << 20, 0)) and t.streamed_bytes == 1 << 20
    finally:
        peer.stop()


def _request(
    sock: socket.socket, keys: list[tuple[int, bytes]], rows: list[tuple[int, int, int]]
) -> tuple[int, bytes]:
    k = np.array(keys, dtype=S.KEY_DT)
    r = np.array(rows, dtype=S.ROW_DT)
    sock.sendall(struct.pack("<8sII", S.REQUEST, len(k), len(r)) + k.tobytes() + r.tobytes())
    head = sock.recv(20, socket.MSG_WAITALL)
    magic, status, n = struct.unpack("<8sIQ", head)
    assert magic == S.RESPONSE
    body = bytearray()
    while len(body) < n:
        chunk = sock.recv(min(1 << 20, n - len(body)))
        assert chunk
        body += chunk
    return status, bytes(body)


def test_the_server_checks_every_request_and_keeps_serving() -> None:
    """A client speaking the protocol directly: what it may read, and what it gets refused."""
    n = 1 << 16
    peer = Peer("tcp", [n, n])
    try:
        d = PeerDescriptor.from_dict(peer.descriptor)
        key0, key1 = d.regions[0].stream_key, d.regions[1].stream_key
        with socket.create_connection(S.parse_address(d.stream), timeout=30) as c:
            status, body = _request(c, [(0, key0)], [(0, 10, 100), (0, 5000, 7)])
            assert (
                status == S.OK
                and body == pattern(n, 0)[10:110].tobytes() + pattern(n, 0)[5000:5007].tobytes()
            )
            # region numbers only tie a request's rows to its keys: the key says which region is read
            status, body = _request(c, [(7, key1)], [(7, 3, 5)])
            assert status == S.OK and body == pattern(n, 1)[3:8].tobytes()
            refusals = [
                ([(0, key0)], [(0, n - 4, 5)], "outside region 0"),  # past the end
                ([(0, key0)], [(0, 0, 0)], "empty"),  # an empty row
                ([(0, key0[::-1])], [(0, 0, 8)], "wrong stream key"),  # a key nobody holds
                ([(0, key0)], [(1, 0, 8)], "region 1 has no key"),  # a row of a region not keyed
                ([(2, b"")], [(2, 0, 8)], "unknown"),  # the proof region is not streamed
            ]
            for keys, rows, why in refusals:
                status, body = _request(c, keys, rows)
                assert status == S.REFUSED and why in body.decode(), (rows, body)
            status, body = _request(c, [(1, key1)], [(1, 0, n)])  # still in step after the refusals
            assert status == S.OK and body == pattern(n, 1).tobytes()
            peer.call("unregister", 1)
            status, body = _request(c, [(1, key1)], [(1, 0, 8)])  # freed: refused
            assert status == S.REFUSED and "freed" in body.decode()
        for junk in (
            b"GET / HTTP/1.0\r\n\r\n",  # not the protocol
            struct.pack("<8sII", S.LANE, 1, 1)
            + np.array([(0, key0)], S.KEY_DT).tobytes()
            + np.array([(0, 0, 8)], S.ROW_DT).tobytes(),
        ):  # a lane's opening with rows
            with socket.create_connection(S.parse_address(d.stream), timeout=30) as c:
                c.sendall(junk)  # the server hangs up
                try:
                    assert c.recv(100) == b""
                except ConnectionResetError:  # hung up with our bytes unread
                    pass
        with socket.create_connection(S.parse_address(d.stream), timeout=30) as c:
            status, _ = _request(c, [(0, key0)], [(0, 0, n)])  # a fresh connection is served
            assert status == S.OK
    finally:
        peer.stop()


def test_an_unreachable_stream_address_is_served_by_ucx() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    peer = Peer("tcp", [1 << 20])
    try:
        desc = dict(peer.descriptor, stream=dead)
        with UcxTransport("tcp") as t:
            p = t.connect("p", desc)
            dst = torch.zeros(1 << 20, dtype=torch.uint8)
            for _ in range(2):
                dst.zero_()
                t.get(ops_for([(p, 0, 0, dst.data_ptr(), 1 << 20)]), timeout=30)
                assert np.array_equal(dst.numpy(), pattern(1 << 20, 0))
            assert t.streamed_bytes == 0
    finally:
        peer.stop()


@pytest.fixture
def streaming() -> Iterator[tuple[Peer, UcxTransport, int, torch.Tensor]]:
    """A 64 MiB tcp publisher, a consumer that has streamed it once (the connection is up)."""
    n = 64 << 20
    peer = Peer("tcp", [n])
    try:
        with UcxTransport("tcp") as t:
            p = t.connect("p", peer.descriptor)
            dst = torch.zeros(n, dtype=torch.uint8)
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), n)]), timeout=60)
            assert t.streamed_bytes == n
            yield peer, t, p, dst
    finally:
        try:
            os.kill(peer.pid, signal.SIGCONT)  # a test may leave it stopped
        except ProcessLookupError:
            pass
        peer.stop()


def test_a_stalled_stream_times_out_and_writes_nothing_later(
    streaming: tuple[Peer, UcxTransport, int, torch.Tensor],
) -> None:
    peer, t, p, dst = streaming
    n = dst.numel()
    ops = ops_for([(p, 0, 0, dst.data_ptr(), n)] * 64)  # 4 GiB: many seconds over tcp
    os.kill(peer.pid, signal.SIGSTOP)
    _wait_stopped(peer.pid)
    with pytest.raises(PeerUnreachable, match="timed out") as ei:  # the peer never answers: only the
        t.get(ops, timeout=1.0)  # timeout ends the get (a hang fails the test at its time limit)
    assert ei.value.status_text == "timed out"  # type: ignore[attr-defined]
    dst.fill_(0x77)  # the caller owns its buffer again
    os.kill(peer.pid, signal.SIGCONT)  # the peer sends what it was asked before it stopped, then
    probe = torch.zeros(n, dtype=torch.uint8)  # answers a new connection's read after it
    t.get(ops_for([(p, 0, 0, probe.data_ptr(), n)]), timeout=60)
    assert np.array_equal(probe.numpy(), pattern(n, 0))  # a new connection reads normally
    assert bool((dst == 0x77).all()), "a streamed byte landed after get() returned"


def test_a_publisher_killed_mid_stream_raises_peer_unreachable(
    streaming: tuple[Peer, UcxTransport, int, torch.Tensor],
) -> None:
    peer, t, p, dst = streaming
    os.kill(peer.pid, signal.SIGKILL)
    peer.proc.join(10)
    with pytest.raises(PeerUnreachable):
        t.get(ops_for([(p, 0, 0, dst.data_ptr(), dst.numel())] * 8), timeout=30)


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("stream", "localhost:80", "not 'ip:port'"),
        ("stream", "10.0.0.1:0", "not 'ip:port'"),
        ("stream", "0.0.0.0:80", "not 'ip:port'"),
        ("stream", 5, "not 'ip:port'"),
        ("stream_key", b"short", "stream_key of 5 bytes"),
        ("stream_key", "text", "must be bytes"),
    ],
)
def test_descriptor_stream_fields_are_checked(field: str, value: object, why: str) -> None:
    d = {"kind": "ucx", "worker_address": b"x", "regions": [{"base": 4096, "size": 8, "rkey": b"k"}]}
    if field == "stream":
        d["stream"] = value
    else:
        d["regions"][0]["stream_key"] = value  # type: ignore[index]
    with pytest.raises(TransportError, match=why):
        PeerDescriptor.from_dict(d)
    ok = dict(d, stream="[::1]:9") if field == "stream" else d
    if field == "stream":
        assert PeerDescriptor.from_dict(ok).stream == "[::1]:9"


def _all_idle(server: stream_server.StreamServer) -> bool:
    """Every connection the server holds waits for its next request (none is mid-answer)."""
    with server._lock:
        return all(since is not None for since in server._conns.values())


class _Local:
    """A stream server in this process over one tensor (real sockets and threads, no UCX)."""

    def __init__(self) -> None:
        self.src = torch.from_numpy(pattern(1 << 20, 5).copy())
        self.key = S.new_key()
        self.server = S.StreamServer("127.0.0.1", self._lookup)

    def _lookup(self, key: bytes) -> S.Served | None:
        return (
            S.Served(self.src.data_ptr(), self.src.numel(), self.key, self.src) if key == self.key else None
        )

    def job(self, dst: torch.Tensor | None = None, *, address: int = 0, n: int = 0) -> S.Job:
        if dst is not None:
            address, n = dst.data_ptr(), dst.numel()
        keys = np.array([(0, self.key)], dtype=S.KEY_DT)
        zero = np.zeros(1, dtype=np.uint64)
        return S.jobs_for(
            {0: ("local", self.server.address, keys)},
            zero,
            zero,
            zero,
            np.array([n], dtype=np.uint64),
            np.array([address], dtype=np.uint64),
        )[0]


def test_a_pooled_connection_the_server_dropped_is_replaced() -> None:
    """A consumer pulling less often than the server's idle timeout finds its pooled connection
    closed: the read goes again on a fresh connection instead of failing."""
    local, reader = _Local(), S.StreamReader()
    try:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        assert reader.read([local.job(dst)], timeout=30) == []
        with local.server._lock:
            conns = list(local.server._conns)
        assert len(conns) == 1
        conns[0].shutdown(socket.SHUT_RDWR)  # what the server's idle timeout does
        wait_until(
            lambda: not local.server._conns, 10, interval=0.01, message="the server kept the connection"
        )
        dst.zero_()
        assert reader.read([local.job(dst)], timeout=30) == []
        assert np.array_equal(dst.numpy(), local.src.numpy())
        assert reader.bytes == 2 << 20
    finally:
        reader.close()
        local.server.close()


def test_one_publisher_is_read_over_several_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull from fewer publishers than the lanes it aims for opens several connections to each
    and cuts the publisher's rows between them (rows crossing a cut included): the same bytes, in
    the same places, and the lanes are pooled for the next pull."""
    monkeypatch.setenv("ASTATE_STREAM_LANES", "4")
    monkeypatch.setattr(stream_client, "_LANE_MIN", 64 << 10)
    n = 4 << 20
    peer = Peer("tcp", [n])
    try:
        with UcxTransport("tcp") as t:
            p = t.connect("p", peer.descriptor)
            dst = torch.zeros(n, dtype=torch.uint8)
            ops, perm = _scattered(p, 0, n, dst, 3000, seed=2)  # 3000 pieces: cuts fall inside rows
            for _ in range(2):
                dst.zero_()
                t.get(ops, timeout=60)
                _check_scattered(dst, perm, n, 0)
                assert len(t._stream_reader._idle[peer.descriptor["stream"]]) == 4
            assert t.streamed_bytes == 2 * 3000 * (n // 3000)
    finally:
        peer.stop()


def test_extra_lanes_take_at_most_half_the_servers_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server refuses extra lanes while it holds more than half its connections: the consumer
    reads over the lanes it got, and the other half stays free for other consumers' first
    connections (neither is sent to UCX nor takes the address for down)."""
    monkeypatch.setattr(stream_server, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(stream_client, "_LANE_MIN", 1 << 10)
    monkeypatch.setattr(stream_server, "_EVICT_IDLE_S", 600.0)  # nothing is evicted: the halves alone decide
    local = _Local()
    readers = [S.StreamReader(lanes=4), S.StreamReader(lanes=4)]
    try:
        for _ in range(2):
            for reader in readers:
                dst = torch.zeros(1 << 20, dtype=torch.uint8)
                assert reader.read([local.job(dst)], timeout=30) == []
                assert np.array_equal(dst.numpy(), local.src.numpy()) and not reader._down
        assert [len(r._idle[local.server.address]) for r in readers] == [2, 1]
        assert all(r.bytes == 2 << 20 for r in readers)
        assert local.server.lanes_refused >= 3 and local.server.refused == 0
    finally:
        for r in readers:
            r.close()
        local.server.close()


def test_a_full_server_evicts_idle_pooled_connections_for_a_new_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pooled connections of earlier consumers fill the server; the next consumer is still
    streamed (the server closes the longest-idle connection for it) and is not sent to UCX; the
    first consumer, its pooled connection gone, reconnects on its next pull."""
    monkeypatch.setattr(stream_server, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(stream_server, "_EVICT_IDLE_S", 0.0)  # idle at all: evictable
    local = _Local()
    readers = [S.StreamReader(lanes=1) for _ in range(3)]
    try:
        for i, reader in enumerate([*readers, readers[0]]):
            wait_until(lambda: _all_idle(local.server), 10, interval=0.01)  # every answer is out
            dst = torch.zeros(1 << 20, dtype=torch.uint8)
            assert reader.read([local.job(dst)], timeout=30) == [], i
            assert np.array_equal(dst.numpy(), local.src.numpy()) and not reader._down
        assert [r.bytes for r in readers] == [2 << 20, 1 << 20, 1 << 20]
        assert len(local.server._conns) <= 2
    finally:
        for r in readers:
            r.close()
        local.server.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 9))
def test_split_job_cuts_the_rows_into_lanes_covering_every_byte_once_in_order(
    lengths: list[int], k: int
) -> None:
    rows = np.zeros(len(lengths), dtype=S.ROW_DT)
    rows["region"] = np.arange(len(lengths)) % 3
    rows["offset"] = np.arange(len(lengths)) * 10_000 + 7
    rows["length"] = lengths
    local = np.arange(len(lengths), dtype=np.uint64) * 100_000 + 3
    job = S.Job("p", "127.0.0.1:1", np.zeros(0, dtype=S.KEY_DT), rows, local, np.arange(len(lengths)))
    parts = S.split_job(job, k)
    total = sum(lengths)
    assert len(parts) == min(k, total)
    sizes = [int(p.rows["length"].sum()) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and all(int(x) > 0 for p in parts for x in p.rows["length"])

    def expand(js: list[S.Job]) -> list[tuple[int, int, int]]:  # (region, source byte, destination byte)
        return [
            (int(r["region"]), int(r["offset"]) + i, int(d) + i)
            for j in js
            for r, d in zip(j.rows, j.local)
            for i in range(int(r["length"]))
        ]

    assert expand(parts) == expand([job])
    assert [int(i) for p in parts for i in p.rows_index] == sorted(
        int(i) for p in parts for i in p.rows_index
    )


def test_the_lanes_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASTATE_STREAM_LANES", raising=False)
    assert 1 <= S.lanes_wanted() <= 8
    monkeypatch.setenv("ASTATE_STREAM_LANES", "3")
    assert S.lanes_wanted() == 3 and S.StreamReader().lanes == 3
    for bad in ("0", "-2", "many", "65"):
        monkeypatch.setenv("ASTATE_STREAM_LANES", bad)
        with pytest.raises(ValueError, match="ASTATE_STREAM_LANES"):
            S.lanes_wanted()
    with pytest.raises(ValueError, match="ASTATE_STREAM_LANES"):  # at construction, before UCX starts
        UcxTransport("tcp")


def test_a_server_with_no_room_sends_the_rows_another_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_server, "MAX_CONNECTIONS", 0)  # every new connection is closed at accept
    local, reader = _Local(), S.StreamReader()
    try:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        job = local.job(dst)
        assert reader.read([job], timeout=30) == [job]  # returned untouched, for UCX
        assert not dst.numpy().any() and reader.bytes == 0
    finally:
        reader.close()
        local.server.close()


def test_a_destination_the_kernel_cannot_write_goes_back_for_ucx() -> None:
    """Device memory nobody registered (here: a read-only page) fails the receive with EFAULT: the
    job comes back for UCX, which can write such memory, instead of failing the pull."""
    local, reader = _Local(), S.StreamReader()
    ro = mmap.mmap(-1, 1 << 20, prot=mmap.PROT_READ)
    try:
        job = local.job(address=np.frombuffer(ro, dtype=np.uint8).ctypes.data, n=1 << 20)
        assert reader.read([job], timeout=30) == [job] and reader.bytes == 0
        dst = torch.zeros(1 << 20, dtype=torch.uint8)  # the reader (and the server) go on
        assert reader.read([local.job(dst)], timeout=30) == []
        assert np.array_equal(dst.numpy(), local.src.numpy())
    finally:
        reader.close()
        local.server.close()
        ro.close()


def test_a_stream_address_reaching_another_server_is_served_by_ucx() -> None:
    """A descriptor's address may reach some other process's stream server (a loopback address seen
    from another host): it does not know this descriptor's keys, so the rows go through UCX."""
    local = _Local()
    peer = Peer("tcp", [1 << 20])
    try:
        with UcxTransport("tcp") as t:
            p = t.connect("p", dict(peer.descriptor, stream=local.server.address))
            dst = torch.zeros(1 << 20, dtype=torch.uint8)
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), 1 << 20)]), timeout=30)
            assert np.array_equal(dst.numpy(), pattern(1 << 20, 0)) and t.streamed_bytes == 0
    finally:
        peer.stop()
        local.server.close()


def test_a_descriptor_listing_some_regions_streams_them_by_key() -> None:
    """A session hub's namespace publishes a subset of its worker's regions, numbered its own way
    (here: its region 0 is the worker's region 1): streamed reads still find the right bytes."""
    a, b = torch.from_numpy(pattern(1 << 16, 3).copy()), torch.from_numpy(pattern(1 << 18, 4).copy())
    with UcxTransport("tcp") as pub, UcxTransport("tcp") as con:
        pub.register_tensor(a)
        rb = pub.register_tensor(b)
        view = pub.descriptor([pub.region(rb)])  # what NamespaceTransport.descriptor publishes
        p = con.connect("ns-b", view)
        dst = torch.zeros(1 << 18, dtype=torch.uint8)
        con.get(ops_for([(p, 0, 0, dst.data_ptr(), 1 << 18)]), timeout=30)
        assert np.array_equal(dst.numpy(), b.numpy()) and con.streamed_bytes == 1 << 18


def test_a_read_of_a_region_freed_since_the_descriptor_is_refused_with_a_typed_error() -> None:
    n = 1 << 16
    peer = Peer("tcp", [n, n])
    try:
        with UcxTransport("tcp") as t:
            p = t.connect("p", peer.descriptor)
            dst = torch.zeros(n, dtype=torch.uint8)
            t.get(ops_for([(p, 1, 0, dst.data_ptr(), n)]), timeout=30)  # streamed; the connection is pooled
            peer.call("unregister", 1)  # this consumer still holds the old descriptor
            dst.zero_()
            with pytest.raises(TransportError, match="refused a streamed read.*region 1") as ei:
                t.get(ops_for([(p, 1, 0, dst.data_ptr(), n)]), timeout=30)
            assert not isinstance(ei.value, PeerUnreachable) and not dst.numpy().any()
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), n)]), timeout=30)  # the connection is still in step
            assert np.array_equal(dst.numpy(), pattern(n, 0))
    finally:
        peer.stop()


# ---- the socket loop (move_rows): native and Python, tails below the wake-up mark ----------------


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    return a, b


def _rows_over(buf: np.ndarray, sizes: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``sizes`` bytes at shuffled, non-adjacent places of ``buf`` (gaps of 1 byte)."""
    starts = np.cumsum([0] + [s + 1 for s in sizes[:-1]]).astype(np.uint64)
    perm = np.random.default_rng(seed).permutation(len(sizes))
    addr = buf.ctypes.data + starts[perm]
    return addr.astype(np.uint64), np.asarray(sizes, dtype=np.uint64)[perm]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize(
    "sizes",
    [
        [1],
        [stream_wire._RCVLOWAT - 1],
        [stream_wire._RCVLOWAT + 1],
        [3 * stream_wire._RCVLOWAT + 17],
        [4096] * 3000 + [5],
        [1, 7, 65536, stream_wire._RCVLOWAT // 2 + 3, 1, 999_999],
    ],
    ids=["one byte", "below the mark", "above the mark", "tail after marks", "3000 rows", "mixed"],
)
def test_move_rows_receives_and_sends_exact_bytes_in_row_order(
    native: bool, sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sender trickles the stream in uneven pieces with pauses, so the receiver sleeps with less
    # queued than the wake-up mark (SO_RCVLOWAT) many times, the tail included: it must neither
    # hang (the deadline turns a hang into a failure) nor misplace a byte.
    monkeypatch.setenv("ASTATE_STREAM_NATIVE", "1" if native else "0")
    total = sum(sizes)
    src = np.random.default_rng(len(sizes)).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total + len(sizes), dtype=np.uint8)
    addr, length = _rows_over(dst, sizes, seed=total)
    a, b = _tcp_pair()
    with a, b:

        def trickle() -> None:
            rng = np.random.default_rng(1)
            off = 0
            while off < total:
                n = int(rng.integers(1, 300_000))
                a.sendall(src[off : off + n].tobytes())
                off += n
                if rng.random() < 0.3:
                    time.sleep(0.01)

        t = threading.Thread(target=trickle)
        t.start()
        S.move_rows(b, addr, length, send=False, deadline=time.monotonic() + 60)
        t.join()
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # a later header read is not held
        got = np.concatenate([dst[int(p) - dst.ctypes.data :][: int(n)] for p, n in zip(addr, length)])
        assert np.array_equal(got, src)
        # and back: sending from the same rows yields the same stream
        back = bytearray(total)

        def receive() -> None:
            view, off = memoryview(back), 0
            while off < total:
                off += a.recv_into(view[off:])

        r = threading.Thread(target=receive)
        r.start()
        S.move_rows(b, addr, length, send=True, deadline=time.monotonic() + 60)
        r.join(60)
        assert bytes(back) == src.tobytes()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_move_rows_raises_typed_errors_when_the_stream_stalls_or_closes(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASTATE_STREAM_NATIVE", "1" if native else "0")
    dst = np.zeros(1 << 20, dtype=np.uint8)
    addr, length = np.array([dst.ctypes.data], np.uint64), np.array([dst.size], np.uint64)
    a, b = _tcp_pair()
    with a, b:
        a.sendall(b"x" * 1000)  # then nothing more: a stall
        with pytest.raises(TimeoutError):
            S.move_rows(b, addr, length, send=False, deadline=time.monotonic() + 0.5)
        a.close()  # closed before the rest came
        with pytest.raises(ConnectionError):
            S.move_rows(b, addr, length, send=False, deadline=time.monotonic() + 30)


class _Interrupted(Exception):
    pass


def test_a_signal_stops_a_stalled_native_read_with_its_handlers_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ctrl-C on a get(timeout=None) from a stalled peer must not wait for the 120 s stall budget:
    # the loop runs the signal handlers between polls (SIGUSR1 stands in for SIGINT here).
    monkeypatch.setenv("ASTATE_STREAM_NATIVE", "1")

    def handler(signum: int, frame: object) -> None:
        raise _Interrupted()

    old = signal.signal(signal.SIGUSR1, handler)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    a, b = _tcp_pair()
    try:
        with a, b:
            a.sendall(b"y" * 1000)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            with pytest.raises(_Interrupted):  # not a TimeoutError, not a hang (deadline None: 120 s)
                S.move_rows(
                    b,
                    np.array([dst.ctypes.data], np.uint64),
                    np.array([dst.size], np.uint64),
                    send=False,
                    deadline=None,
                )
            assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
            assert bytes(dst[:1000]) == b"y" * 1000
    finally:
        signal.signal(signal.SIGUSR1, old)
