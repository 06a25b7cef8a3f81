"""State beyond tensors: the small dict a publisher stores with a version (``put(..., meta=...)``).

RNG states, step counters, a dataloader's position: a trainer's full state is more than its
tensors. Each publisher rank may give one msgpack-able dict per step; it is written in the same
etcd transaction as the rank's piece (so it commits with the version, atomically, and retention
drops it with the version) and into the rank's checkpoint part (so ``restore`` brings it back).

It must stay small: it travels inside one etcd transaction. Big state belongs in tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import torch

from astate_store.errors import LayoutError

__all__ = ["MAX_META_BYTES", "encode_meta", "decode_meta", "rng_state", "set_rng_state"]

# etcd refuses requests over --max-request-bytes (1.5 MiB by default); the piece, the commit and
# the fences share the transaction, so the meta keeps well below it.
MAX_META_BYTES = 512 * 1024
_MAX_DEPTH = 32


def encode_meta(meta: Mapping[str, Any] | None, what: str = "put(meta)") -> bytes | None:
    """The user's dict as msgpack bytes, checked before anything is published (None: no meta).

    Allowed: string keys; values None, bool, int (64-bit), float, str, bytes, lists/tuples and
    dicts of those. torch's RNG states are tensors: :func:`rng_state` turns them into bytes.

    Raises:
        LayoutError: not a dict, a key that is not a string, a value of another type or a
            non-finite float (naming its path), or more than ``MAX_META_BYTES`` encoded.
    """
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise LayoutError(f"{what} must be a dict, got {type(meta).__name__}")
    _check(meta, what, 0)
    data = msgpack.packb(dict(meta), use_bin_type=True)
    if len(data) > MAX_META_BYTES:
        raise LayoutError(
            f"{what} is {len(data)} bytes encoded, over the {MAX_META_BYTES} byte limit "
            "(it travels in one etcd transaction); publish big state as tensors"
        )
    return data


def decode_meta(data: bytes, what: str) -> dict[str, Any]:
    """msgpack bytes back to the dict (tuples come back as lists).

    Raises:
        LayoutError: bytes that are not a msgpack map with string keys.
    """
    try:
        value = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise LayoutError(f"{what}: not a msgpack map ({exc})") from None
    if not isinstance(value, dict):
        raise LayoutError(f"{what}: expected a map, got {type(value).__name__}")
    return value


def _check(value: Any, path: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise LayoutError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str, bytes)):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise LayoutError(f"{path}: integer {value} does not fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LayoutError(f"{path}: {value} is not a finite float")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise LayoutError(f"{path}: key {key!r} is not a string")
            _check(item, f"{path}[{key!r}]", depth + 1)
        return
    raise LayoutError(
        f"{path}: a {type(value).__name__} cannot be stored as meta (None, bool, int, float, str, "
        "bytes, lists and dicts of those)"
    )


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, every visible CUDA device, Python's ``random``) as
    meta-ready values, for ``put(step, tensors, meta={"rng": rng_state(), ...})``."""
    import random

    out: dict[str, Any] = {"torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available():
        out["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    version, internal, gauss = random.getstate()
    out["python"] = [version, list(internal), gauss]
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (as read back by ``Store.meta``).

    Raises:
        LayoutError: a state of the wrong form.
    """
    import random

    try:
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in state["cuda"]]
            )
        if "python" in state:
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise LayoutError(f"set_rng_state: not a state captured by rng_state() ({exc})") from None
