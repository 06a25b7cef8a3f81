"""Same-host mapped reads: a publisher's memfd-backed regions are mapped by a proven
consumer and read with memcpy (transport/memfd.py), never on the descriptor's word alone.

Real processes, real UCX endpoints, real memfds; the forged descriptors name fds that
really exist in the publisher (an unsealed memfd, a sealed one mapped elsewhere, a
plain file) so each check of ``map_peer_region`` is what refuses them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch

from astate_store.errors import PeerUnreachable, TransportError
from astate_store.transport import UcxTransport, memfd
from astate_store.transport.ucx import native
from tests._transport_peer import pattern
from tests.support.waiting import wait_until
from tests.transport.test_transport import Peer, _with_region0, ops_for

N = 4 << 20


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count rows passed to the native function ``name`` (still calling it)."""
    nat = native()
    real = getattr(nat, name)
    seen: list[int] = []

    def spy(plan: np.ndarray, **k: Any) -> None:
        seen.append(int(plan.shape[0]))
        return real(plan, **k)

    monkeypatch.setattr(nat, name, spy)
    return seen


def _strided_ops(p: int, dst: torch.Tensor, n: int, row: int = 4096, step: int = 8192) -> np.ndarray:
    """Every other ``row`` bytes of region 0 into the front of ``dst``."""
    k = n // step
    return ops_for([(p, 0, i * step, dst.data_ptr() + i * row, row) for i in range(k)])


@pytest.mark.timeout(120)
def test_memfd_regions_are_mapped_and_read_with_memcpy(monkeypatch: pytest.MonkeyPatch) -> None:
    pub = Peer("shm", [N, 1 << 16], memfd=True)
    try:
        assert all(r.get("memfd", -1) >= 0 for r in pub.descriptor["regions"][:2])  # listed by the publisher
        with UcxTransport("shm") as t:
            t.connect("pub", pub.descriptor)
            assert t.peer_info("pub").mapped_regions[:2] == (True, True)
            copies, cma = _spy(monkeypatch, "copy_rows"), _spy(monkeypatch, "cma_read")
            p = t.peer_index("pub")
            src = pattern(N, 0)
            want = src.reshape(-1, 8192)[:, :4096].reshape(-1)
            dst = torch.zeros(N, dtype=torch.uint8)
            t.get(_strided_ops(p, dst, N), timeout=30)
            assert np.array_equal(dst.numpy()[: want.size], want) and not dst.numpy()[want.size :].any()
            small = torch.zeros(1 << 16, dtype=torch.uint8)
            t.get(ops_for([(p, 1, 0, small.data_ptr(), 1 << 16)]), timeout=30)
            assert np.array_equal(small.numpy(), pattern(1 << 16, 1))
            assert copies == [N // 8192, 1] and cma == []  # every row a mapped copy, no syscall per row
            # A region registered later is mapped when its descriptor arrives.
            t.connect("pub", pub.call("register", 1 << 20))
            assert t.peer_info("pub").mapped_regions == (True, True, True)
    finally:
        pub.stop()


@pytest.mark.timeout(120)
def test_a_prefault_hint_maps_pages_in_the_background_and_the_get_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``prefault`` (given before planning) populates on the background thread; a get that
    comes while it runs takes the chunks still left from the far end and waits for the rest:
    no chunk is populated twice, and every byte is read."""
    pub = Peer("shm", [2 * N], memfd=True)
    try:
        with UcxTransport("shm") as t:
            t.connect("pub", pub.descriptor)
            p = t.peer_index("pub")
            calls: list[tuple[str, int]] = []
            release, started = threading.Event(), threading.Event()
            real = memfd._populate

            def spy(address: int, length: int) -> bool:
                calls.append((threading.current_thread().name, length))
                if threading.current_thread().name == "astate-prefault":
                    started.set()
                    release.wait(30)  # still running when the get arrives (unless the timer won)
                return real(address, length)

            monkeypatch.setattr(memfd, "_populate", spy)
            # hints about what the transport does not know, or beyond a region, are ignored
            t.prefault("nobody", [(0, 0, N)])
            t.prefault("pub", [(7, 0, N), (-1, 0, N), (0, 2 * N, 3 * N), (0, 16, 16)])
            assert calls == []
            t.prefault("pub", [(0, 0, N)])
            t.prefault("pub", [(0, 4096, N // 2)])  # inside the span under way: nothing more
            assert started.wait(30)  # the background thread holds its first chunk
            threading.Timer(0.2, release.set).start()
            dst = torch.zeros(N, dtype=torch.uint8)
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), N)]), timeout=30)
            assert np.array_equal(dst.numpy(), pattern(N, 0))
            me = threading.current_thread().name
            assert "astate-prefault" in {name for name, _ in calls} <= {"astate-prefault", me}
            assert sum(n for _, n in calls) == N
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), N)]), timeout=30)  # prefaulted: not again
            assert sum(n for _, n in calls) == N
            # a hint overlapping what is done maps only the rest (and past the region's end, nothing)
            t.prefault("pub", [(0, N // 2, 4 * N)])
            t.get(ops_for([(p, 0, N, dst.data_ptr(), N)]), timeout=30)
            assert np.array_equal(dst.numpy(), pattern(2 * N, 0)[N:])
            assert sum(n for _, n in calls) == 2 * N
    finally:
        pub.stop()


@pytest.mark.timeout(120)
def test_a_get_prefaults_only_the_runs_it_reads_and_a_prepared_one_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan reading the two ends of a region (a column-split consumer between another
    one's copies) populates those runs, not the bytes between them; the same plan again
    populates nothing (its window was prepared), and a new plan only what it adds."""
    pub = Peer("shm", [4 * N], memfd=True)
    try:
        with UcxTransport("shm") as t:
            t.connect("pub", pub.descriptor)
            p = t.peer_index("pub")
            spans: list[tuple[int, int]] = []
            real = memfd._populate
            mapping = t._peers.get("pub").maps[0]  # where region 0 is mapped here

            def spy(address: int, length: int) -> bool:
                spans.append((address - mapping.address, address - mapping.address + length))
                return real(address, length)

            monkeypatch.setattr(memfd, "_populate", spy)
            dst = torch.zeros(2 * N, dtype=torch.uint8)
            ends = ops_for(
                [
                    (p, 0, 0, dst.data_ptr(), N // 2),
                    (p, 0, N // 2, dst.data_ptr() + N // 2, N // 2),
                    (p, 0, 3 * N, dst.data_ptr() + N, N),
                ]
            )
            t.get(ends, timeout=30)
            src = pattern(4 * N, 0)
            assert np.array_equal(dst.numpy(), np.concatenate([src[:N], src[3 * N :]]))
            assert sorted(spans) == [(0, N), (3 * N, 4 * N)]  # two runs; the 2N between left alone
            t.get(ends, timeout=30)
            assert len(spans) == 2
            more = ops_for([(p, 0, 0, dst.data_ptr(), N), (p, 0, 2 * N, dst.data_ptr() + N, N)])
            t.get(more, timeout=30)
            assert sorted(spans) == [(0, N), (2 * N, 3 * N), (3 * N, 4 * N)]
            assert np.array_equal(dst.numpy(), np.concatenate([src[:N], src[2 * N : 3 * N]]))
    finally:
        pub.stop()


@pytest.mark.timeout(120)
def test_mapped_reads_of_an_exited_peer_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mapping outlives the publisher, but its pid may be reused: same rule as
    process_vm_readv, the read raises PeerUnreachable instead of returning bytes."""
    pub = Peer("shm", [N], memfd=True)
    try:
        with UcxTransport("shm") as t:
            t.connect("pub", pub.descriptor)
            assert t.peer_info("pub").mapped_regions[0] is True
            copies = _spy(monkeypatch, "copy_rows")
            dst = torch.zeros(N, dtype=torch.uint8)
            ops = ops_for([(t.peer_index("pub"), 0, 0, dst.data_ptr(), N)])
            t.get(ops, timeout=30)
            assert copies and np.array_equal(dst.numpy(), pattern(N, 0))
            pub.proc.kill()
            pub.proc.join(10)
            with pytest.raises(PeerUnreachable, match="exited"):
                t.get(ops, timeout=30)
            assert len(copies) == 2  # the bytes came from the mapping, and were refused
    finally:
        pub.stop()


@pytest.mark.timeout(120)
def test_forged_memfd_numbers_are_refused_and_reads_stay_exact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A descriptor whose region 0 (anonymous memory) names another fd of the same proven
    process: none may be mapped in its place; the bytes still come from the region itself."""
    caplog.set_level(logging.INFO, logger="astate_store")
    pub = Peer("shm", [N])  # anonymous regions
    why = {
        "unsealed": "not a memfd sealed",
        "elsewhere": "not mapped from that file",
        "file": "not a memfd sealed",
        "stdin": "not a regular file",
        "missing": "pidfd_getfd refused",
        "huge": "pidfd_getfd refused",
    }
    try:
        with UcxTransport("shm") as t:
            forged = dict(pub.decoys, stdin=0, missing=999, huge=2**31 - 1)
            for name, fd in forged.items():
                caplog.clear()
                t.connect(name, _with_region0(pub.descriptor, memfd=fd))
                info = t.peer_info(name)
                assert info.direct is True and info.mapped_regions[0] is False, name
                assert any(why[name] in r.getMessage() for r in caplog.records), (name, caplog.text)
            cma = _spy(monkeypatch, "cma_read")
            src = pattern(N, 0)
            for name in forged:
                dst = torch.zeros(N, dtype=torch.uint8)
                t.get(ops_for([(t.peer_index(name), 0, 0, dst.data_ptr(), N)]), timeout=30)
                assert np.array_equal(dst.numpy(), src), name
            assert len(cma) == len(forged)  # read from the process's memory, not from the decoys
    finally:
        pub.stop()


@pytest.mark.timeout(120)
def test_a_real_memfd_named_for_another_region_is_refused() -> None:
    """Region 1's true memfd claimed for region 0: /proc/<pid>/maps shows another file
    (or another offset) at region 0's address, so region 0 is not mapped from it."""
    pub = Peer("shm", [N, N], memfd=True)
    try:
        regions = [dict(r) for r in pub.descriptor["regions"]]
        regions[0]["memfd"] = regions[1]["memfd"]
        with UcxTransport("shm") as t:
            t.connect("swapped", {**pub.descriptor, "regions": regions})
            assert t.peer_info("swapped").mapped_regions[:2] == (False, True)
            dst = torch.zeros(2 * N, dtype=torch.uint8)
            p = t.peer_index("swapped")
            t.get(ops_for([(p, 0, 0, dst.data_ptr(), N), (p, 1, 0, dst.data_ptr() + N, N)]), timeout=30)
            assert np.array_equal(dst.numpy(), np.concatenate([pattern(N, 0), pattern(N, 1)]))
    finally:
        pub.stop()


def test_memfd_field_is_validated() -> None:
    d = {"base": 4096, "size": 10, "rkey": b"k"}
    from astate_store.transport.base import RegionInfo

    assert RegionInfo.from_dict(d).memfd == -1
    assert RegionInfo.from_dict({**d, "memfd": 7}).memfd == 7
    assert RegionInfo.from_dict({**d, "memfd": 7}).to_dict()["memfd"] == 7
    for bad in (True, -5, 2**31, "3", 1.0):
        with pytest.raises(TransportError, match="memfd"):
            RegionInfo.from_dict({**d, "memfd": bad})


def test_shared_mapping_is_sealed_and_tracked() -> None:
    import fcntl

    mm = memfd.shared_mapping(1 << 20)
    assert mm is not None
    base = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
    fd = memfd.fd_of(base, 1 << 20)
    assert fd >= 0 and memfd.fd_of(base + 4096, 100) == fd
    assert memfd.fd_of(base, (1 << 20) + 1) == -1 and memfd.fd_of(base - 1, 10) == -1
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(OSError):
        os.ftruncate(fd, 4096)  # nobody can shrink it under a reader
    # preallocate: the file's pages exist before anything writes them (a staging pool's)
    assert os.fstat(fd).st_blocks == 0
    assert memfd.preallocate(base + 4096, 64 << 10)
    assert os.fstat(fd).st_blocks * 512 == 64 << 10
    assert not memfd.preallocate(base, (1 << 20) + 1) and not memfd.preallocate(base - 4096, 10)
    assert not memfd.preallocate(torch.zeros(10).data_ptr(), 10)  # not a memfd's
    assert not np.frombuffer(mm, dtype=np.uint8).any()  # still zero
    del mm
    import gc

    gc.collect()
    assert memfd.fd_of(base, 10) == -1  # released with the mapping (and its fd closed)


def test_a_dropped_peer_mapping_is_unmapped_off_the_callers_thread() -> None:
    """The last mapping of a released pool frees its pages when unmapped: that happens on a
    background thread, and it does happen (the mapping leaves /proc/self/maps)."""
    import mmap as _mmap

    from astate_store.transport.memfd import PeerMapping

    fd = os.memfd_create("astate-test")
    try:
        os.ftruncate(fd, 8 << 20)
        mm = _mmap.mmap(fd, 8 << 20, prot=_mmap.PROT_READ)
    finally:
        os.close(fd)
    m = PeerMapping(mm, 0)
    start = f"{m.address:x}-"
    del mm

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(line.startswith(start) for line in f)

    assert mapped()
    del m
    wait_until(lambda: not mapped(), 30, interval=0.01, message="the mapping outlived its last user")
    assert any(t.name == "astate-unmap" for t in threading.enumerate())
