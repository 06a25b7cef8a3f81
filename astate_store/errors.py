"""Typed exceptions: every failure a caller can handle has its own class."""

from __future__ import annotations

__all__ = [
    "AStateError",
    "LayoutError",
    "CodecError",
    "CatalogError",
    "CatalogUnavailable",
    "CatalogRejected",
    "CatalogAuthError",
    "UnsafeRendezvousError",
    "CatalogCorrupted",
    "StaleSessionError",
    "StaleStepError",
    "VersionNotFound",
    "WaitTimeout",
    "PlanError",
    "TransportError",
    "PeerUnreachable",
    "NoLiveSource",
    "TornReadError",
    "DeltaMismatch",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupted",
    "CheckpointNotCommitted",
    "CheckpointInUse",
    "RecoveryError",
    "ReplicationTimeout",
]


class AStateError(Exception):
    """Base of every error astate-store raises on purpose."""


class LayoutError(AStateError, ValueError):
    """Bad tensors, shards or buffers; raised before any byte moves."""


class CodecError(AStateError, ValueError):
    """A record that does not decode: unknown schema version, truncated or malformed bytes."""


class CatalogError(AStateError):
    """The etcd control plane refused or failed an operation."""


class CatalogUnavailable(CatalogError):
    """etcd could not be reached within the retry budget."""


class CatalogRejected(CatalogError):
    """etcd answered and refused the request (too large, not permitted, invalid): retrying cannot help."""


class CatalogAuthError(CatalogRejected):
    """The client's security settings do not match etcd's: TLS (scheme, CA, client certificate),
    credentials (user, password), or permissions (no role for the namespace's keys). Raised at
    once, not after the retry budget; the message says what to check (option and env var)."""


class UnsafeRendezvousError(CatalogError, PermissionError):
    """The embedded etcd's rendezvous directory or file is not safe to trust: owned by another
    user, or writable by group/others. The message names the path and the fix."""


class CatalogCorrupted(CatalogError):
    """A record that others depend on (``latest``, ``epoch``, a ``commit``, the ``session``, a piece
    of a committed version) does not decode or is not what its key says. ``key``: the etcd key.
    Raised instead of acting on it: no bytes of a version with a bad commit are ever returned."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:  # keep the key across processes (pickle)
        return (type(self), self.args, {"key": self.key})


class StaleStepError(CatalogError):
    """A put of a step that can never commit: a newer step is already committed."""


class StaleSessionError(CatalogError):
    """A write from a session that a newer session of the namespace has fenced."""


class ReplicationTimeout(CatalogError):
    """A put with ``replicas=K`` is committed, but fewer than K replica servers (``astate serve``)
    held it within ``replica_timeout``. ``step``: that version; ``held``: servers that held it."""

    def __init__(self, message: str, *, step: int | None = None, held: int = 0):
        super().__init__(message)
        self.step, self.held = step, held

    def __reduce__(self) -> tuple[object, ...]:  # keep step and held across processes (pickle)
        return (type(self), self.args, {"step": self.step, "held": self.held})


class VersionNotFound(CatalogError, KeyError):
    """The requested version is not (or no longer) committed."""


class WaitTimeout(AStateError, TimeoutError):
    """No committed version appeared before the deadline."""


class PlanError(AStateError, ValueError):
    """The planner cannot serve a request (a box no source covers, a dtype it cannot convert)."""


class TransportError(AStateError):
    """A data-path failure; the message carries the UCX status text."""


class PeerUnreachable(TransportError):
    """A source process is gone or cannot be connected."""


class NoLiveSource(PeerUnreachable):
    """Some bytes a pull asked for are held only by publisher ranks that are gone (their leases
    ended), and no live publisher, replica or re-serving consumer holds them. Raised before any
    byte moves. ``step``: the version; ``holes``: (tensor, box offsets, box sizes, ranks that
    held that box) for each piece that has no live source."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        holes: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None = None,
    ):
        super().__init__(message)
        self.step = step
        self.holes = list(holes or [])

    def __reduce__(self) -> tuple[object, ...]:  # keep step and holes across processes (pickle)
        return (type(self), self.args, {"step": self.step, "holes": self.holes})


class TornReadError(AStateError):
    """The version was retired while being read; the bytes may mix two steps."""


class DeltaMismatch(AStateError):
    """``verify=True``: after a pull, a buffer's bytes disagree with the digests its publisher
    recorded (a buffer changed behind the store's back, or a fault on the way): the tensor and
    the tiles are named. The next pull into these buffers is whole."""

    def __init__(self, message: str, *, step: int | None = None, tensors: tuple[str, ...] = ()):
        super().__init__(message)
        self.step, self.tensors = step, tensors

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_mismatch, (self.args[0], self.step, self.tensors))


def _rebuild_mismatch(message: str, step: int | None, tensors: tuple[str, ...]) -> DeltaMismatch:
    return DeltaMismatch(message, step=step, tensors=tensors)


class CheckpointError(AStateError):
    """A checkpoint could not be written or read."""


class CheckpointNotFound(CheckpointError):
    """No complete checkpoint exists for the request."""


class CheckpointCorrupted(CheckpointError):
    """A shard file is missing, short, or fails its checksum."""


class CheckpointNotCommitted(CheckpointError):
    """``checkpoint(step)`` waited for ``step`` to commit and it did not: the session was fenced,
    a newer step committed first (the step is stale), a rank whose piece is missing left the
    session, or the timeout passed. ``step``; ``missing``: the ranks whose pieces of the step are
    not in the catalog; ``reason``: ``"fenced"``, ``"stale"``, ``"rank_gone"`` or ``"timeout"``."""

    def __init__(
        self, message: str, *, step: int | None = None, missing: list[int] | None = None, reason: str = ""
    ):
        super().__init__(message)
        self.step = step
        self.missing = list(missing or [])
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:  # keep the fields across processes (pickle)
        return (type(self), self.args, {"step": self.step, "missing": self.missing, "reason": self.reason})


class CheckpointInUse(CheckpointError):
    """A checkpoint cannot be removed: it is the newest complete one, a restore holds a live reader
    lease on it, or it is not complete (another session may still be writing it)."""


class RecoveryError(AStateError):
    """The ranks of a recovering publisher session found no step they can all recover, or a rank
    could not fetch the agreed one; every rank of the session raises the same error, before any
    of them republishes. ``step``: the step that could not be recovered (None if unknown);
    ``failures``: rank -> why it failed (or that it did not report in time)."""

    def __init__(self, message: str, *, step: int | None = None, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.step = step
        self.failures = dict(failures or {})

    def __reduce__(self) -> tuple[object, ...]:  # keep step and failures across processes (pickle)
        return (type(self), self.args, {"step": self.step, "failures": self.failures})
