"""Memfd-backed staging: same-host consumers map a publisher's snapshot and copy at memcpy speed.

Why: ``process_vm_readv`` pays a kernel cost per row (a 2 GiB TP=2 -> TP=1 pull is 65k rows), on one
thread. A mapping of the publisher's pages turns each row into a plain ``memcpy`` that the native
``copy_rows`` spreads over threads.

Publisher side: :func:`shared_mapping` allocates memory as a sealed memfd
(``F_SEAL_SHRINK | F_SEAL_GROW``: it can never shrink under a reader, so a mapped read
cannot fault with SIGBUS), keeps the fd open while the mapping lives, and
:func:`fd_of` tells the transport which registered range a memfd backs; the region's
descriptor entry then lists that fd number.

Consumer side: :func:`map_peer_region` only for a peer already *proven* on the same-host
path (``same_host.Proof``: its pid is the process behind its UCX endpoint, and a pidfd of
it is held). The fd number comes from etcd, so nothing is taken on the peer's word:

1. ``pidfd_getfd`` duplicates that fd from the proven process (the kernel applies the
   same ptrace rule as ``process_vm_readv``);
2. it must be a regular file sealed against shrinking, large enough;
3. ``/proc/<pid>/maps`` of that process must show this very file (device and inode)
   mapped over the whole region, at consecutive file offsets: reading the file at those
   offsets is then reading the peer's memory at the region's addresses.

Anything else returns the reason, and the region stays on ``process_vm_readv``.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import stat
import threading
import weakref
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from astate_store.background import SerialWorker
from astate_store.transport.config import env_on
from astate_store.transport.vmas import MapsReader

__all__ = ["PeerMapping", "enabled", "fd_of", "map_peer_region", "preallocate", "shared_mapping"]

log = logging.getLogger("astate_store")

_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (new syscalls are unified)

_lock = threading.Lock()
_starts: list[int] = []  # sorted start addresses of live shared mappings
_live: dict[int, tuple[int, int]] = {}  # start -> (length, fd)


def _address(mm: mmap.mmap) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)


def _forget(start: int, fd: int) -> None:
    with _lock:
        if _live.pop(start, None) is not None:
            _starts.remove(start)
    os.close(fd)


def enabled() -> bool:
    """memfd staging is on unless ``ASTATE_MEMFD=0`` (then staging is anonymous memory, read
    by same-host consumers with process_vm_readv as before)."""
    return env_on("ASTATE_MEMFD")


def shared_mapping(length: int, name: str = "astate-staging") -> mmap.mmap | None:
    """A read-write MAP_SHARED mapping of a new sealed memfd of ``length`` bytes (zeroed);
    None when this system cannot make one (the caller falls back to anonymous memory).

    The fd stays open as long as the mapping object lives (a consumer duplicates it from
    this process); it is closed when the mapping is collected.
    """
    if length <= 0 or not hasattr(os, "memfd_create") or not enabled():
        return None
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        log.debug("memfd_create failed (%s): anonymous staging", exc)
        return None
    try:
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _huge(mm)
    except (OSError, ValueError, AttributeError) as exc:
        os.close(fd)
        log.debug("memfd staging of %d bytes failed (%s): anonymous staging", length, exc)
        return None
    start = _address(mm)
    with _lock:
        _live[start] = (length, fd)
        _starts.insert(bisect_right(_starts, start), start)
    weakref.finalize(mm, _forget, start, fd)
    return mm


def _huge(mm: mmap.mmap) -> None:
    """Ask for huge pages (best effort). Where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
    is ``advise`` this makes the staging 2 MiB pages: a 512th of the page faults for the publisher's
    first write and of the entries a consumer's prefault maps; with ``never`` (this project's test
    machines) it does nothing, so that path is unmeasured here."""
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        pass


def fd_of(address: int, nbytes: int) -> int:
    """The memfd behind ``[address, +nbytes)`` if one shared mapping holds all of it, else -1."""
    with _lock:
        held = _holder(address, nbytes)
    return held[1] if held is not None else -1


def _holder(address: int, nbytes: int) -> tuple[int, int] | None:
    """(start, fd) of the live shared mapping holding all of ``[address, +nbytes)``; under ``_lock``."""
    i = bisect_right(_starts, address) - 1
    if i < 0 or nbytes <= 0:
        return None
    start = _starts[i]
    length, fd = _live[start]
    return (start, fd) if address + nbytes <= start + length else None


def preallocate(address: int, nbytes: int) -> bool:
    """Allocate the memfd pages behind ``[address, +nbytes)`` in one ``fallocate``, where the
    first write would allocate them one 4 KiB page fault at a time (a pool that grows pays that on
    every rank at once). The writes then only map pages that exist. The pages follow the range's
    memory policy (an ``mbind`` of the mapping is the file's shared policy). False where no
    memfd holds the range, or the kernel refused (the writes then allocate as before)."""
    with _lock:
        held = _holder(address, nbytes)
        if held is None:
            return False
        start, fd = held
        try:
            os.posix_fallocate(fd, address - start, nbytes)  # under the lock: the fd stays open
        except OSError as exc:
            log.debug(
                "fallocate of %d bytes of staging failed (%s): pages allocate on first write", nbytes, exc
            )
            return False
    return True


# ---- consumer side -------------------------------------------------------------------------

_libc = None


def _pidfd_getfd(pidfd: int, target: int) -> int:
    _libc_fn()
    fd = int(
        _libc.syscall(
            ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(target), ctypes.c_uint(0)
        )
    )
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return fd


def _file_offset(pid: int, base: int, size: int, st: os.stat_result) -> int | str:
    """File offset of ``base`` if ``/proc/<pid>/maps`` maps the file ``st`` over all of
    ``[base, +size)`` at consecutive offsets; else why not."""
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    end, pos, first = base + size, base, None
    try:
        with MapsReader(pid) as maps:
            while first is None or pos < end:
                v = maps.at(pos)
                if v is None:
                    return f"0x{pos:x} is not mapped"
                if v.dev != dev or v.inode != st.st_ino:
                    return f"0x{pos:x} is not mapped from that file"
                off = v.offset + (pos - v.start)
                if first is None:
                    first = off
                elif off != first + (pos - base):
                    return "the file is not mapped contiguously over the region"
                pos = v.end
    except (OSError, ValueError, IndexError) as exc:
        return f"cannot read its memory map ({exc})"
    return first


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


class PeerMapping:
    """A peer's region mapped read-only here; unmapped when the last reference goes.

    ``address``: where the region's first byte is mapped in this process. Before rows are
    copied from it, :meth:`prepare` maps the pages of the byte runs they read with
    ``madvise(MADV_POPULATE_READ)`` (one call per run, where the copy would otherwise fault
    them in one 4 KiB page at a time on the first read of a slot). Only runs a pull reads
    (``spans.span_runs``): not at map time (pages the publisher has not written would be
    allocated), not the rest of a region (a thread prefaulting that competed with the pulls
    on a small host), and not the other consumers' copies between this one's (a column-split
    consumer mapped three times what it read). :meth:`prefault_later` starts runs on a
    background thread as soon as a pull knows them, so the kernel maps pages while the pull
    still plans in Python; ``prepare`` then takes what chunks are left and waits for those in
    flight. A pull already prepared (the same window: first byte, end and row count) costs
    one lookup.
    """

    _MAX_SPANS = 1024  # a few slots' runs per region; an older one is prefaulted again at worst
    _MAX_WINDOWS = 16

    def __init__(self, mm: mmap.mmap, delta: int) -> None:
        self._mm = mm  # the mapping lives as long as this object
        self.address = _address(mm) + delta
        self._done: list[tuple[int, int]] = []  # region byte spans prefaulted: sorted, disjoint
        self._pending: list[_Job] = []  # spans background jobs prefault
        self._windows: dict[tuple[int, int, int], None] = {}  # pulls prepared (insertion order: LRU)
        self._lock = threading.Lock()

    def __del__(self) -> None:
        # The last mapping of a file its publisher already released frees the file's pages on
        # unmap (a cost per GiB freed): a pool that grew made the next pull pay that inline.
        mm = getattr(self, "_mm", None)
        if mm is not None:
            _unmap_later(mm)

    def ready(self, window: tuple[int, int, int]) -> bool:
        """Whether a pull reading ``window`` = (first byte, end, rows) was prepared already."""
        with self._lock:
            return window in self._windows

    def prepare(self, spans: Sequence[tuple[int, int]], window: tuple[int, int, int] | None = None) -> None:
        """Prefault region byte spans ``[lo, hi)`` where not done yet: background jobs on them
        are helped from their far end (this thread would only wait), the rest done here; a
        failure leaves the pages to fault. ``window``: remembered for :meth:`ready`."""
        with self._lock:
            jobs = [job for job in self._pending if any(job.lo < hi and lo < job.hi for lo, hi in spans)]
        for job in jobs:
            while self._step(job, from_end=True):
                pass
            job.done.wait(_PREFAULT_WAIT)
        with self._lock:
            todo = [part for lo, hi in spans for part in _minus(lo, hi, self._done)]
        for a, b in todo:
            if _populate(self.address + a, b - a):
                self._add_done(a, b)
        if window is not None:
            with self._lock:
                self._windows.pop(window, None)
                self._windows[window] = None
                while len(self._windows) > self._MAX_WINDOWS:
                    del self._windows[next(iter(self._windows))]

    def prefault_later(self, spans: Sequence[tuple[int, int]]) -> None:
        """Start prefaulting the parts of the spans ``[lo, hi)`` neither done nor under way, on
        the background thread (a hint: nothing happens where no thread can start)."""
        with self._lock:
            busy = _merged(self._done + [(j.lo, j.hi) for j in self._pending])
            jobs = [_Job(a, b) for lo, hi in _merged(list(spans)) for a, b in _minus(lo, hi, busy)]
            self._pending += jobs
        for job in jobs:
            if not _PREFAULTER.submit(lambda job=job: self._run(job)):
                with self._lock:
                    job.next_lo = job.next_hi  # nothing left to take: done once no chunk is in flight
                self._release(job)

    def _run(self, job: _Job) -> None:
        try:
            while self._step(job, from_end=False):
                pass
        except Exception as exc:  # a hint: its failure leaves the pages to fault
            log.debug("prefault: %s", exc)

    def _step(self, job: _Job, *, from_end: bool) -> bool:
        """Populate one chunk of ``job`` (from its start, or from its end for a helper); False
        when none is left. In chunks: madvise holds the process's mmap lock while it populates,
        and the pull's own thread needs that lock to allocate (mmap/brk) while it plans."""
        with self._lock:
            if job.next_lo >= job.next_hi:
                return False
            if from_end:
                b = job.next_hi
                a = job.next_hi = max(b - _PREFAULT_CHUNK, job.next_lo)
            else:
                a = job.next_lo
                b = job.next_lo = min(a + _PREFAULT_CHUNK, job.next_hi)
            job.inflight += 1
        ok = False
        try:
            ok = _populate(self.address + a, b - a)
            if ok:
                self._add_done(a, b)
        finally:
            with self._lock:
                job.inflight -= 1
                if not ok:
                    job.next_lo = job.next_hi  # madvise refused: leave the rest to page faults
            self._release(job)
        return ok

    def _release(self, job: _Job) -> None:
        """Mark ``job`` done once no chunk is left or in flight."""
        with self._lock:
            if job.next_lo < job.next_hi or job.inflight or job.done.is_set():
                return
            self._pending.remove(job)
            job.done.set()

    def _add_done(self, lo: int, hi: int) -> None:
        """Record ``[lo, hi)`` as prefaulted, merged into its neighbours (a chunk at a time: a
        bisect, not a sort); beyond ``_MAX_SPANS`` the lowest go (prefaulted again at worst)."""
        with self._lock:
            done = self._done
            i = bisect_right(done, (lo, hi))
            if i and done[i - 1][1] >= lo:
                i -= 1
                lo = done[i][0]
            j = i
            while j < len(done) and done[j][0] <= hi:
                hi = max(hi, done[j][1])
                j += 1
            done[i:j] = [(lo, hi)]
            if len(done) > self._MAX_SPANS:
                del done[: len(done) - self._MAX_SPANS]


class _Job:
    """A span being prefaulted in chunks: the background thread takes them from ``next_lo`` up,
    a pull that needs the span takes them from ``next_hi`` down; ``done`` is set once none is
    left or in flight."""

    __slots__ = ("lo", "hi", "next_lo", "next_hi", "inflight", "done")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.next_lo, self.next_hi = lo, hi, lo, hi
        self.inflight = 0
        self.done = threading.Event()


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif a < b:
            out.append((a, b))
    return out


def _minus(lo: int, hi: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` that none of ``spans`` (sorted, disjoint) covers, in order."""
    out, pos = [], lo
    first = max(bisect_right(spans, (lo, lo)) - 1, 0)
    for a, b in spans[first:]:
        if b <= pos:
            continue
        if a >= hi:
            break
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
        if pos >= hi:
            return out
    if pos < hi:
        out.append((pos, hi))
    return out


_PREFAULT_CHUNK = 2 << 20
_PREFAULT_WAIT = 60.0  # seconds a pull waits for a background prefault before doing it itself


# Serial workers (``background.py``): their jobs keep what they reference alive until they have run.
_UNMAPPER = SerialWorker("astate-unmap")
_PREFAULTER = SerialWorker("astate-prefault")


def _unmap_later(mm: mmap.mmap) -> None:
    """Close ``mm`` on a background thread (``mmap.close`` releases the GIL while it unmaps);
    inline while the interpreter shuts down (no new threads then; the process is going anyway)."""
    if not _UNMAPPER.submit(lambda: _close(mm)):
        _close(mm)


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except (BufferError, OSError) as exc:  # a view still exported: it unmaps when that goes
        log.debug("unmap: %s", exc)


def _populate(address: int, length: int) -> bool:
    page = mmap.PAGESIZE
    start = address // page * page
    return _madvise(start, address + length - start, _MADV_POPULATE_READ) == 0


def _libc_fn() -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)


def _madvise(address: int, length: int, advice: int) -> int:
    """libc ``madvise`` through ctypes, which releases the GIL (``mmap.madvise`` holds it)."""
    _libc_fn()
    return int(_libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)))


def map_peer_region(pidfd: int, pid: int, fd_num: int, base: int, size: int) -> PeerMapping | str:
    """The peer's region ``[base, +size)`` mapped read-only from its memfd ``fd_num`` (see
    the module docstring), or the reason it cannot be."""
    try:
        fd = _pidfd_getfd(pidfd, fd_num)
    except (OSError, AttributeError) as exc:
        return f"pidfd_getfd refused ({exc})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "its fd is not a regular file"
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # EINVAL: not a memfd (a file that can shrink under a reader)
            seals = 0
        if seals & _SEALS != _SEALS:
            return "it is not a memfd sealed against resizing"
        off = _file_offset(pid, base, size, st)
        if isinstance(off, str):
            return off
        if off + size > st.st_size:
            return "the region reaches past the end of its memfd"
        page = mmap.ALLOCATIONGRANULARITY
        lo = off - off % page
        # Not MAP_POPULATE: it would allocate (and zero) every page the publisher has not
        # written yet, e.g. a snapshot slot not used so far, on the consumer's clock. Faults
        # on written pages are cheap (the kernel maps 64 KiB around each).
        mm = mmap.mmap(fd, off + size - lo, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=lo)
        _huge(mm)
    except (OSError, ValueError) as exc:
        return f"cannot map its memfd ({exc})"
    finally:
        os.close(fd)
    return PeerMapping(mm, off - lo)
