"""Child-process entry point for tests/test_transport.py: a publisher that serves reads.

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


def serve(conn: Any, mode: str, sizes: list[int]) -> None:
    from astate_store.transport import UcxTransport

    t = UcxTransport(mode)
    tensors = []
    for k, n in enumerate(sizes):
        x = torch.from_numpy(pattern(n, seed=k).copy())
        tensors.append(x)
        t.register_tensor(x)
    conn.send({"descriptor": t.descriptor(), "pid": os.getpid()})
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "unregister":
                t.unregister(int(args[0]))
                conn.send(t.descriptor())
            elif cmd == "register":
                x = torch.from_numpy(pattern(int(args[0]), seed=len(tensors)).copy())
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
