"""Block checksums: the algorithms a manifest may name, the default, and running per-block sums."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from astate_store.checkpoint.format import ALIGN
from astate_store.errors import CheckpointError

__all__ = [
    "Checksum",
    "Crc32",
    "Xxh3",
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "checksum_algo",
    "check_block_size",
    "BlockSums",
]


class Checksum:
    """A block checksum: one-shot ``digest(buffer)`` and streaming ``new()`` / ``update`` / ``value``."""

    name = "?"

    def digest(self, data: Any) -> int:
        raise NotImplementedError

    def new(self) -> Any:
        raise NotImplementedError

    def update(self, state: Any, data: Any) -> Any:
        raise NotImplementedError

    def value(self, state: Any) -> int:
        raise NotImplementedError


class Crc32(Checksum):
    name = "crc32"

    def digest(self, data: Any) -> int:
        return zlib.crc32(data)

    def new(self) -> Any:
        return 0

    def update(self, state: Any, data: Any) -> Any:
        return zlib.crc32(data, state)

    def value(self, state: Any) -> int:
        return int(state)


class Xxh3(Checksum):
    name = "xxh3_64"

    def __init__(self) -> None:
        try:
            import xxhash
        except ImportError:  # pragma: no cover - depends on the environment
            raise CheckpointError(
                "checksum 'xxh3_64' needs the package xxhash (pip install xxhash), or restore "
                "with verify=False"
            ) from None
        self._x = xxhash

    def digest(self, data: Any) -> int:
        return self._x.xxh3_64_intdigest(data)  # type: ignore[no-any-return]

    def new(self) -> Any:
        return self._x.xxh3_64()

    def update(self, state: Any, data: Any) -> Any:
        state.update(data)
        return state

    def value(self, state: Any) -> int:
        return state.intdigest()  # type: ignore[no-any-return]


#: Checksum algorithms by manifest name -> factory.
CHECKSUMS: dict[str, Callable[[], Checksum]] = {"crc32": Crc32, "xxh3_64": Xxh3}


def _have_xxhash() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


#: Algorithm used when ``checksum=None``: xxh3_64 (hashes wide words at a time: faster than zlib's
#: crc32) when the ``xxhash`` package is installed, else crc32 (standard library).
DEFAULT_CHECKSUM = "xxh3_64" if _have_xxhash() else "crc32"


def checksum_algo(name: str | None) -> Checksum:
    """The algorithm called ``name`` (None: ``DEFAULT_CHECKSUM``).

    Raises:
        CheckpointError: an unknown name.
    """
    name = DEFAULT_CHECKSUM if name is None else name
    if name not in CHECKSUMS:
        raise CheckpointError(f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)}")
    return CHECKSUMS[name]()


def check_block_size(block_size: int) -> int:
    """``block_size`` if it is a positive multiple of ``ALIGN``, so blocks start on shard alignment.

    Raises:
        CheckpointError: otherwise.
    """
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < ALIGN
        or block_size % ALIGN
    ):
        raise CheckpointError(f"block_size must be a positive multiple of {ALIGN}, got {block_size!r}")
    return block_size


class BlockSums:
    """Running per-block checksums of one shard's bytes fed in order (chunks of any size)."""

    def __init__(self, algo: Checksum, block: int):
        self.algo, self.block = algo, block
        self.sums: list[int] = []
        self._state: Any = None
        self._len = 0

    def feed(self, data: np.ndarray) -> None:
        mv = memoryview(data).cast("B")
        pos, n = 0, len(mv)
        while pos < n:
            take = min(self.block - self._len, n - pos)
            piece = mv[pos : pos + take]
            if take == self.block:  # a whole block in one piece: one-shot
                self.sums.append(self.algo.digest(piece))
            else:
                if self._state is None:
                    self._state = self.algo.new()
                self._state = self.algo.update(self._state, piece)
                self._len += take
                if self._len == self.block:
                    self._flush()
            pos += take

    def _flush(self) -> None:
        self.sums.append(self.algo.value(self._state))
        self._state, self._len = None, 0

    def finish(self) -> list[int]:
        if self._len:
            self._flush()
        return self.sums
