"""Memory-map queries of another process (vmas.py): the kernel's PROCMAP_QUERY and the text scan
give the same answers, for the mappings the same-host path asks about."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

from astate_store.transport import vmas
from astate_store.transport.memfd import _file_offset
from astate_store.transport.same_host import _anonymous_at
from astate_store.transport.vmas import MapsReader

_CHILD = r"""
import ctypes, mmap, os, sys
anon = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
anon[0] = 1  # touched: a private anonymous mapping of its own
fd = os.memfd_create("vmas-test")
os.ftruncate(fd, 1 << 20)
shared = mmap.mmap(fd, 1 << 16, offset=1 << 16)  # the memfd's second 64 KiB
addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))
print(addr(anon), addr(shared), fd, flush=True)
sys.stdin.read()
"""


@pytest.fixture()
def child():
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        anon, shared, fd = (int(x) for x in p.stdout.readline().split())
        yield p.pid, anon, shared, fd
    finally:
        p.stdin.close()
        p.wait(timeout=30)


@pytest.mark.parametrize("query", [True, False], ids=["procmap_query", "text_scan"])
def test_both_readers_answer_the_same_questions(child, query: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    pid, anon, shared, fd = child
    monkeypatch.setattr(vmas, "_ioctl_works", query)
    with MapsReader(pid) as maps:
        a = maps.at(anon + 100)
        assert a is not None and a.start <= anon < a.end
        assert a.readable and a.writable and a.private and a.inode == 0 and a.name == ""
        s = maps.at(shared)
        assert s is not None and not s.private and s.inode != 0 and s.offset == 1 << 16
        assert "vmas-test" in s.name
        assert maps.at(8) is None  # the first page is never mapped
    assert _anonymous_at(pid, anon) and not _anonymous_at(pid, shared)
    st = os.stat(f"/proc/{pid}/fd/{fd}")
    assert _file_offset(pid, shared + 4096, 8192, st) == (1 << 16) + 4096
    assert "not mapped from that file" in str(_file_offset(pid, anon, 4096, st))
    assert "not mapped" in str(_file_offset(pid, 8, 4096, st))


def test_this_kernel_answers_with_the_query_or_the_scan() -> None:
    # whichever this kernel supports, a mapping of this process is found
    m = mmap.mmap(-1, 4096)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    with MapsReader(os.getpid()) as maps:
        v = maps.at(address)
    assert v is not None and v.start <= address < v.end
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) >= (6, 11):  # PROCMAP_QUERY exists: the scan must not have been needed
        assert vmas._ioctl_works
