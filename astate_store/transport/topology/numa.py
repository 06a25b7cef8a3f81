"""NUMA placement: pin threads to a node's CPUs and place host memory on a node.

* :func:`pin_current_thread` / :func:`pinned` for progress and copy threads;
* :func:`alloc_on_node` for host staging memory, through ``mbind`` (libnuma's wrapper or
  the raw syscall, :class:`_NumaCalls`) or, failing that, first touch from a pinned thread;
* :func:`node_of_address` to check where a page landed.

Nothing here raises for placement reasons: affinity is a hint, and a buffer that could not
be placed is still a valid buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import sys
import threading
from collections.abc import Iterable, Iterator

import torch

from astate_store.transport import memfd
from astate_store.transport.topology.discovery import PathLike, format_cpulist, logger, read_topology

__all__ = ["pin_current_thread", "pinned", "alloc_on_node", "node_of_address"]


# --------------------------------------------------------------------------- threads


def pin_current_thread(cpus: Iterable[int]) -> frozenset[int] | None:
    """Pin the calling thread to ``cpus``; return its previous CPU set, or None if nothing changed.

    On Linux ``sched_setaffinity(0, ...)`` acts on the calling thread only. Empty ``cpus``,
    a platform without affinity support, or a set the kernel refuses (no allowed CPU in it)
    is a no-op with a debug log.
    """
    wanted = frozenset(cpus)
    if not wanted:
        logger.debug("no cpus to pin to; leaving thread affinity alone")
        return None
    if not hasattr(os, "sched_setaffinity"):
        logger.debug("thread pinning unsupported on this platform")
        return None
    try:
        previous = frozenset(os.sched_getaffinity(0))
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        logger.debug("could not pin thread to cpus %s: %s", format_cpulist(wanted), exc)
        return None
    logger.debug("pinned thread %d to cpus %s", threading.get_native_id(), format_cpulist(wanted))
    return previous


@contextlib.contextmanager
def pinned(cpus: Iterable[int]) -> Iterator[frozenset[int] | None]:
    """Pin the calling thread to ``cpus`` for the block, then restore; yields the previous set."""
    previous = pin_current_thread(cpus)
    try:
        yield previous
    finally:
        if previous is not None:
            try:
                os.sched_setaffinity(0, previous)
            except OSError as exc:
                logger.debug("could not restore thread affinity: %s", exc)


# --------------------------------------------------------------------------- memory placement

_MPOL_PREFERRED = 1
_MPOL_BIND = 2
_MPOL_F_NODE = 1
_MPOL_F_ADDR = 2

# (mbind, get_mempolicy) syscall numbers, used when libnuma is not installed.
_SYSCALLS = {
    "x86_64": (237, 239),
    "amd64": (237, 239),
    "aarch64": (235, 236),
    "arm64": (235, 236),
    "riscv64": (235, 236),
    "ppc64le": (259, 260),
    "ppc64": (259, 260),
}


class _NumaCalls:
    """mbind / get_mempolicy through libnuma's wrappers, else the raw syscalls via libc."""

    def __init__(self) -> None:
        self.mbind = None
        self.get_mempolicy = None
        if not sys.platform.startswith("linux"):
            return
        for name in ("libnuma.so.1", ctypes.util.find_library("numa")):
            if not name:
                continue
            try:
                lib = ctypes.CDLL(name, use_errno=True)
                mb, gm = lib.mbind, lib.get_mempolicy
            except (OSError, AttributeError):
                continue
            mb.restype = ctypes.c_long
            mb.argtypes = [
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_uint,
            ]
            gm.restype = ctypes.c_long
            gm.argtypes = [
                ctypes.POINTER(ctypes.c_int),
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_void_p,
                ctypes.c_ulong,
            ]
            self.mbind, self.get_mempolicy = mb, gm
            return
        numbers = _SYSCALLS.get(platform.machine().lower())
        if numbers is None:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            syscall = libc.syscall
        except (OSError, AttributeError):
            return
        syscall.restype = ctypes.c_long
        nr_mbind, nr_getmp = numbers

        def mbind(addr, length, mode, mask, maxnode, flags):  # type: ignore[no-untyped-def]
            return syscall(
                ctypes.c_long(nr_mbind),
                ctypes.c_void_p(addr),
                ctypes.c_ulong(length),
                ctypes.c_int(mode),
                mask,
                ctypes.c_ulong(maxnode),
                ctypes.c_uint(flags),
            )

        def get_mempolicy(mode_ptr, mask, maxnode, addr, flags):  # type: ignore[no-untyped-def]
            return syscall(
                ctypes.c_long(nr_getmp),
                mode_ptr,
                mask,
                ctypes.c_ulong(maxnode),
                ctypes.c_void_p(addr),
                ctypes.c_ulong(flags),
            )

        self.mbind, self.get_mempolicy = mbind, get_mempolicy


_numa_calls: _NumaCalls | None = None
_numa_lock = threading.Lock()


def _calls() -> _NumaCalls:
    global _numa_calls
    with _numa_lock:
        if _numa_calls is None:
            _numa_calls = _NumaCalls()
        return _numa_calls


def _mbind(addr: int, length: int, node: int, strict: bool) -> str | None:
    """Bind [addr, addr+length) to ``node``; None on success, else why not."""
    calls = _calls()
    if calls.mbind is None:
        return "mbind unavailable"
    bits = 64
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    # The kernel reads maxnode-1 bits (a historical off-by-one libnuma also compensates for).
    rc = calls.mbind(addr, length, _MPOL_BIND if strict else _MPOL_PREFERRED, mask, words * bits + 1, 0)
    if rc != 0:
        return f"mbind failed: {os.strerror(ctypes.get_errno())}"
    return None


def node_of_address(address: int) -> int | None:
    """NUMA node of the (already touched) page holding ``address``; None if unknown."""
    calls = _calls()
    if calls.get_mempolicy is None:
        return None
    node = ctypes.c_int(-1)
    rc = calls.get_mempolicy(ctypes.byref(node), None, 0, address, _MPOL_F_NODE | _MPOL_F_ADDR)
    return node.value if rc == 0 and node.value >= 0 else None


def _touch(t: torch.Tensor, page: int) -> None:
    # One write per page, single-threaded (torch would fan large fills out to unpinned
    # intra-op threads, defeating first touch).
    try:
        t.numpy()[::page] = 0
    except (RuntimeError, TypeError):  # torch without numpy
        t.view(-1, page)[:, 0] = 0


def alloc_on_node(
    nbytes: int,
    node: int | None,
    *,
    strict: bool = False,
    shared: bool = False,
    sysfs_root: PathLike = "/sys",
) -> torch.Tensor:
    """A CPU uint8 tensor of ``nbytes`` whose pages live on NUMA ``node`` (best effort).

    ``shared``: back it with a sealed memfd (``transport.memfd``) that same-host consumers
    can map and copy from at memcpy speed; anonymous memory where that fails.

    The memory is a fresh mapping (page aligned, untouched), wrapped with
    ``torch.frombuffer`` so the tensor owns it: unmapped when the last view goes, and any
    memory policy goes with it instead of lingering in the allocator's heap. Placement:

    1. ``mbind`` (MPOL_PREFERRED, or MPOL_BIND with ``strict``) on the range before the
       first touch, via libnuma's wrapper or the raw syscall, then touch every page;
    2. else first touch from a helper thread pinned to the node's CPUs
       (:func:`_first_touch_on`);
    3. else (or for ``node`` None, or ``nbytes`` 0) plain allocation, with a debug log.

    Never raises for placement reasons. Contents are unspecified (a placed buffer is
    zero-filled, as a fresh mapping is).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    page = mmap.PAGESIZE
    length = -(-nbytes // page) * page
    mm = _fresh_mapping(length, shared)
    if mm is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    del mm  # the tensor's storage keeps the mapping alive
    t = whole[:nbytes]
    if node is None:
        return t

    why = _mbind(whole.data_ptr(), length, node, strict)
    if why is None:
        # No touch here: the policy places each page on whichever thread first writes it, so
        # the first copy into the buffer (multi-threaded) pays the faults, not one thread now
        # (a fault per 4 KiB page: shared by the copy's threads instead).
        logger.debug("allocated %d bytes on numa node %d via mbind", nbytes, node)
        return t
    if _first_touch_on(whole, node, page, sysfs_root):
        logger.debug("allocated %d bytes on numa node %d by first touch (%s)", nbytes, node, why)
        return t
    # The mapping is still a valid allocation; its pages fault in wherever the kernel likes.
    logger.debug("could not place %d bytes on numa node %d (%s); plain allocation", nbytes, node, why)
    return t


def _fresh_mapping(length: int, shared: bool) -> mmap.mmap | None:
    """A page-aligned, untouched mapping of ``length`` bytes; None when none can be made.

    The one place topology reaches into the transport's memory: ``shared`` asks
    ``memfd.shared_mapping`` for a sealed memfd (same-host consumers map it), and anything
    that cannot be one is anonymous memory.
    """
    mm = memfd.shared_mapping(length) if shared else None
    try:
        if mm is None:
            mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError) as exc:
        logger.debug("anonymous mmap of %d bytes failed (%s); plain allocation", length, exc)
        return None
    # Transparent huge pages: a remote cma read pins one 2 MiB page where it would pin 512 small ones.
    if hasattr(mmap, "MADV_HUGEPAGE") and length >= (2 << 20):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mm


def _first_touch_on(whole: torch.Tensor, node: int, page: int, sysfs_root: PathLike) -> bool:
    """Fault every page of ``whole`` in from a helper thread pinned to ``node``'s CPUs.

    True when the thread was pinned and touched every page (the kernel then places each page
    on the toucher's node); False when no CPU of the node is allowed or pinning failed.
    """
    cpus = read_topology(sysfs_root).cpus_of(node)
    try:
        allowed = frozenset(os.sched_getaffinity(0))
        cpus = tuple(c for c in cpus if c in allowed)
    except (AttributeError, OSError):
        cpus = ()
    if not cpus:
        return False
    result: list[BaseException | None] = [None]
    ok = [False]

    def toucher() -> None:
        try:
            ok[0] = pin_current_thread(cpus) is not None
            _touch(whole, page)
        except BaseException as exc:  # noqa: BLE001 - reported through result, not raised
            result[0] = exc

    th = threading.Thread(target=toucher, name="astate-first-touch", daemon=True)
    th.start()
    th.join()
    return result[0] is None and ok[0]
