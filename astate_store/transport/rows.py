"""A read plan checked and translated against a :class:`~.peers.PeerSnapshot`.

Every row is checked (peer connected, region exists, read inside the region, non-null
destination) before any byte moves, so a bad plan fails whole and leaves the
destination untouched. Both read paths then take the translated :class:`Rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from astate_store.errors import TransportError
from astate_store.transport.base import OP_COLUMNS
from astate_store.transport.peers import PeerSnapshot

__all__ = ["Rows", "check_ops", "resolve_rows"]


@dataclass(frozen=True)
class Rows:
    """Plan rows with peers and regions resolved; equal-length uint64/int64 columns."""

    pidx: np.ndarray  # uint64: peer index
    ep_pos: np.ndarray  # int64: position of the peer's endpoint in the snapshot's `eps`
    flat: np.ndarray  # uint64: flat region (index into the snapshot's per-region arrays)
    remote: np.ndarray  # uint64: absolute remote address
    local: np.ndarray  # uint64: local destination address
    length: np.ndarray  # uint64: bytes, never 0

    def __len__(self) -> int:
        return int(self.length.shape[0])

    def take(self, mask: np.ndarray) -> Rows:
        return Rows(
            self.pidx[mask],
            self.ep_pos[mask],
            self.flat[mask],
            self.remote[mask],
            self.local[mask],
            self.length[mask],
        )


def check_ops(ops: np.ndarray) -> np.ndarray | None:
    """The plan as uint64 after shape/dtype/sign checks; None for an empty plan."""
    ops = np.asarray(ops)
    if ops.ndim != 2 or ops.shape[1] != OP_COLUMNS or ops.dtype.kind not in "iu":
        raise TransportError(
            f"ops must be an integer array of shape (n, {OP_COLUMNS}), got {ops.dtype} {ops.shape}"
        )
    if ops.shape[0] == 0:
        return None
    if ops.dtype.kind == "i" and (ops < 0).any():
        row = int(np.argmax((ops < 0).any(axis=1)))
        raise TransportError(f"op {row}: negative value in {ops[row].tolist()}")
    return ops.astype(np.uint64, copy=False)


def resolve_rows(t: PeerSnapshot, o: np.ndarray) -> Rows | None:
    """Bounds-check every row of ``o`` against ``t`` and translate it; None if no row moves a byte.

    Zero-length rows are dropped first (they move nothing, and may name empty regions).
    Row numbers in error messages count the rows left after that drop.
    """
    length = o[:, 4]
    if not length.all():
        o = o[length != 0]
        if o.shape[0] == 0:
            return None
        length = o[:, 4]
    pidx = o[:, 0]
    bad = pidx >= np.uint64(len(t.ep_pos))
    if not bad.any():
        ep_pos = t.ep_pos[pidx]
        bad = ep_pos < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise TransportError(f"op {i}: peer index {int(pidx[i])} is not connected")
    ridx = o[:, 1]
    bad = ridx >= t.reg_n[pidx]
    if bad.any():
        i = int(np.argmax(bad))
        p = int(pidx[i])
        raise TransportError(
            f"op {i}: peer {t.keys[p]!r} has no region {int(ridx[i])} ({int(t.reg_n[p])} regions)"
        )
    flat = t.reg_off[pidx] + ridx
    size = t.size[flat]
    off = o[:, 2]
    with np.errstate(over="ignore"):
        bad = (off > size) | (length > size - off)
    if bad.any():
        i = int(np.argmax(bad))
        p, r = int(pidx[i]), int(ridx[i])
        raise TransportError(
            f"op {i}: read [{int(off[i])}, +{int(length[i])}) is out of bounds of peer {t.keys[p]!r} "
            f"region {r} (size {int(size[i])}{', unregistered' if t.rkey_pos[flat[i]] < 0 else ''})"
        )
    local = o[:, 3]
    if (local == 0).any():
        i = int(np.argmax(local == 0))
        raise TransportError(f"op {i}: null local address")
    return Rows(pidx, ep_pos, flat, t.base[flat] + off, local, length)
