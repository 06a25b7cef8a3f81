"""The ``astate_store._ucx`` extension: loading it, and turning its errors into ours.

Every other transport module reaches the extension through :func:`native` (never a
plain import) so that ``libucx.load_library()`` has run first, and tests can patch
attributes of the one module object it returns (e.g. ``cma_read``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from astate_store.errors import PeerUnreachable, TransportError

__all__ = ["copy_rows", "copy_streaming", "copy_threads", "native", "typed_error", "is_peer_status"]

_native_mod: Any = None
_native_lock = threading.Lock()


def native() -> Any:
    """The ``astate_store._ucx`` extension, loaded after ``libucx.load_library()``.

    ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` makes the loader prefer a system UCX.
    """
    global _native_mod
    if _native_mod is None:
        with _native_lock:
            if _native_mod is None:
                _native_mod = _load()
    return _native_mod


def copy_threads() -> int:
    """Threads for the native ``copy_rows``: ``$ASTATE_COPY_THREADS`` if set, else the CPUs
    this process may run on, at most 8 (memory bandwidth, not cores, bounds a copy beyond
    that). Several pulling processes on one host may want fewer each."""
    env = os.environ.get("ASTATE_COPY_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return min(int(env), 16)
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(8, os.cpu_count() or 1))


def copy_streaming() -> int:
    """Stores of the native ``copy_rows``: ``$ASTATE_COPY_STREAMING`` ``1`` (always non-temporal),
    ``0`` (never), else -1: non-temporal for copies larger than a last-level cache (32 MiB),
    which then skip reading each destination line before writing it."""
    env = os.environ.get("ASTATE_COPY_STREAMING", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return 0
    return 1 if env in ("1", "true", "yes", "on") else -1


def copy_rows(plan: Any, threads: int | None = None) -> None:
    """Copy rows ``(src_addr, dst_addr, length)`` of a uint64 ``(n, 3)`` array with the native
    loop (GIL released). The caller has checked every row: nothing is checked here."""
    native().copy_rows(
        plan, threads=copy_threads() if threads is None else threads, streaming=copy_streaming()
    )


def _memory_events_default() -> None:
    """Without CUDA, turn UCX's memory events off unless the user chose (``UCX_MEM_*``).

    Loading libucs installs them by patching libc's code (waiting in sched_yield loops), paid by
    every process's first step. They feed UCX's registration and memory-type caches, which only RDMA
    and CUDA transports use; this backend registers its regions explicitly and, without CUDA, runs
    over tcp, shared memory and cma. ("reloc" hooks load fast but made every C++ ``delete`` walk the
    loaded objects, process exit included.) Read once, when libucs loads.
    """
    if any(k.startswith("UCX_MEM_") for k in os.environ):
        return
    from astate_store.transport.config import cuda_present

    if not cuda_present():
        os.environ["UCX_MEM_EVENTS"] = "no"


def _load() -> Any:
    _memory_events_default()
    try:
        import libucx

        libucx.load_library()
    except ImportError:  # a system UCX found through the rpath / ld.so
        pass
    try:
        from astate_store import _ucx
    except ImportError as exc:
        raise TransportError(
            f"the UCX extension astate_store._ucx is not built or cannot load: {exc} "
            "(build it with `pip install --no-build-isolation -e .`)"
        ) from exc
    return _ucx


def is_peer_status(nat: Any, status: int) -> bool:
    """Whether a UCX status means the peer (not this process) is the problem."""
    if status in (
        nat.ERR_UNREACHABLE,
        nat.ERR_CONNECTION_RESET,
        nat.ERR_TIMED_OUT,
        nat.ERR_REJECTED,
        nat.ERR_NOT_CONNECTED,
        nat.ERR_CANCELED,
        nat.ERR_ENDPOINT_TIMEOUT,
    ):
        return True
    return (nat.ERR_LAST_ENDPOINT_FAILURE <= status <= nat.ERR_FIRST_ENDPOINT_FAILURE) or (
        nat.ERR_LAST_LINK_FAILURE <= status <= nat.ERR_FIRST_LINK_FAILURE
    )


def typed_error(exc: BaseException, message: str, *, peer_gone: bool = False) -> TransportError:
    """``message: exc`` as PeerUnreachable (peer status or ``peer_gone``) or TransportError.

    The raw UCX status stays on the error (``status``, ``status_text``) so callers can
    tell UCX's reasons apart without parsing the message.
    """
    nat = native()
    status = int(getattr(exc, "status", 0) or 0)
    cls = PeerUnreachable if (peer_gone or (status and is_peer_status(nat, status))) else TransportError
    err = cls(f"{message}: {exc}")
    err.status = status  # type: ignore[attr-defined]
    err.status_text = getattr(exc, "status_text", None)  # type: ignore[attr-defined]
    return err
