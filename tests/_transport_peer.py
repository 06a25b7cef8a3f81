"""Child-process entry point for tests/transport/test_transport.py: a publisher that serves reads.

Runs in a ``spawn``ed process: registers tensors with known contents, sends its
descriptor through the pipe and then answers commands until told to exit. The
transport's progress thread serves the reads meanwhile.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    """Deterministic bytes with no short period (so misplaced reads are caught)."""
    i = np.arange(nbytes, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed * 97 + 13)) >> np.uint64(7)).astype(np.uint8)


def _tensor(n: int, seed: int, memfd: bool) -> torch.Tensor:
    if not memfd:
        return torch.from_numpy(pattern(n, seed=seed).copy())
    from astate_store.transport.topology import alloc_on_node

    x = alloc_on_node(n, None, shared=True)  # what a publisher's snapshot pool allocates
    x.copy_(torch.from_numpy(pattern(n, seed=seed)))
    return x


def _decoys(keep: list[Any]) -> dict[str, int]:
    """fds a forged descriptor may name: an unsealed memfd, a sealed memfd mapped elsewhere,
    a plain file (all mapped in this process, none over a registered region)."""
    import fcntl
    import mmap
    import tempfile

    out: dict[str, int] = {}
    for name, seal in (("unsealed", False), ("elsewhere", True)):
        fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 20)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        keep.append(mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED))
        out[name] = fd
    f = tempfile.TemporaryFile()
    f.write(b"x" * (1 << 20))
    f.flush()
    keep.append(f)
    out["file"] = f.fileno()
    return out


def serve(conn: Any, mode: str, sizes: list[int], memfd: bool = False) -> None:
    from astate_store.transport import UcxTransport

    t = UcxTransport(mode)
    tensors: list[Any] = []
    for k, n in enumerate(sizes):
        x = _tensor(n, k, memfd)
        tensors.append(x)
        t.register_tensor(x)
    decoys: list[Any] = []  # kept open and mapped while serving
    conn.send({"descriptor": t.descriptor(), "pid": os.getpid(), "decoys": _decoys(decoys)})
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "unregister":
                t.unregister(int(args[0]))
                conn.send(t.descriptor())
            elif cmd == "register":
                x = _tensor(int(args[0]), len(tensors), memfd)
                tensors.append(x)
                t.register_tensor(x)
                conn.send(t.descriptor())
    except EOFError:
        pass
    finally:
        t.close()


def hold_secret(conn: Any, nbytes: int) -> None:
    """A process that is *not* a publisher: it holds bytes nobody was offered (a "secret")
    and tells its pid and their address, so tests can forge descriptors pointing at it."""
    secret = pattern(nbytes, seed=99)
    conn.send({"pid": os.getpid(), "address": int(secret.ctypes.data), "nbytes": nbytes})
    try:
        conn.recv()  # any message (or EOF): exit
    except EOFError:
        pass
    del secret
