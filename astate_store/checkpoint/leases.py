"""Removing checkpoints safely: reader leases held by restores, the ``REMOVING`` tombstone, and
retention (``apply_retention``) and removal by hand (``remove_checkpoint``) on top of them.

Everything lives on the checkpoint's own storage, next to the data, because a checkpoint outlives
the catalog and its readers need no etcd (``astate checkpoint``, another namespace, a new job)::

    <uri>/step-<step:020d>/
        reader-<ttl_ms:09d>-<id>.lease   a restore in progress (JSON), rewritten every ttl/3
        REMOVING                         a remover's tombstone (JSON), written before it looks at leases

Protocol (docs/checkpoint.md "Retention"):

Reader (``ReaderLease``, used by ``restore`` and ``verify``):
    1. write its lease; 2. give up (``CheckpointNotFound``) if ``REMOVING`` exists;
    3. read ``COMMIT`` and the rest; the lease is renewed meanwhile and deleted at the end.
Remover (``remove_checkpoint``):
    1. write ``REMOVING`` and take its modification time as "now" (the storage's clock, so the
       hosts' clocks never matter); 2. list the leases: one modified within its ttl (+ slack) of
       "now" is live -> delete ``REMOVING`` and refuse (``CheckpointInUse``);
    3. delete ``COMMIT`` (the step is invisible from here on), then everything else.

A reader whose step 2 ran before the remover's step 1 wrote its lease before the remover's step 2
lists leases, so the remover sees it and backs off; a reader whose step 2 ran later sees the
tombstone. Storage must give read-after-write consistency for this (local and HDFS do; S3 has
since December 2020; so do GCS and Azure). A dead reader's lease stops being renewed and is
ignored once its ttl has passed; a dead remover leaves ``REMOVING`` behind: with ``COMMIT`` still
there the next remover finishes (the policy chose it already), without it the directory is debris
the next retention pass deletes.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from astate_store.checkpoint.format import COMMIT_NAME, FORMAT, STEP_RE
from astate_store.checkpoint.index import list_checkpoints
from astate_store.checkpoint.retention import REMOVE, RetentionPolicy, keep_reasons
from astate_store.checkpoint.storage import URI, Location, put_atomic, resolve
from astate_store.errors import CheckpointError, CheckpointInUse, CheckpointNotFound

__all__ = [
    "LEASE_TTL",
    "REMOVING_NAME",
    "ReaderLease",
    "live_readers",
    "remove_checkpoint",
    "apply_retention",
    "RetentionResult",
    "policy_view",
]

log = logging.getLogger("astate_store.checkpoint")

#: Seconds a reader lease lasts without renewal (it is renewed every third of that).
LEASE_TTL = 30.0
#: Added to every lease's ttl when judging it: object stores keep modification times to the second.
SLACK = 2.0
REMOVING_NAME = "REMOVING"
LEASE_RE = re.compile(r"^reader-(\d{9})-([0-9a-f]+)\.lease$")


def _lease_name(ttl: float, lease_id: str) -> str:
    return f"reader-{int(round(ttl * 1000)):09d}-{lease_id}.lease"


def _mtime(info: pafs.FileInfo) -> float | None:
    ns = info.mtime_ns
    return None if ns is None else ns / 1e9


class ReaderLease:
    """A restore's claim on ``step`` under ``loc`` while it reads (a context manager).

    On entry: write the lease, then refuse (``CheckpointNotFound``) a step being removed. A
    daemon thread rewrites the lease every ``ttl / 3``; on exit it stops and the lease is deleted.
    Writing the lease is best effort (a read-only credential cannot): the restore then goes on
    unprotected, with a warning."""

    def __init__(self, loc: Location, step: int, ttl: float = LEASE_TTL):
        self.loc, self.step, self.ttl = loc, step, float(ttl)
        self.path = posixpath.join(loc.step_dir(step), _lease_name(self.ttl, uuid.uuid4().hex[:16]))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.held = False

    def _write(self) -> None:
        body = {
            "format": FORMAT,
            "kind": "reader_lease",
            "step": self.step,
            "ttl": self.ttl,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "renewed_at": time.time(),
        }
        put_atomic(self.loc, self.path, json.dumps(body, sort_keys=True).encode(), fsync=False)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:  # never rewrites the lease after _release deleted it
                if not self.held:
                    return
                try:
                    self._write()
                except (OSError, pa.ArrowException) as exc:  # the next renewal tries again
                    log.warning("step %d: renewing reader lease %s failed: %s", self.step, self.path, exc)

    def __enter__(self) -> ReaderLease:
        sdir = self.loc.step_dir(self.step)
        if self.loc.fs.get_file_info(posixpath.join(sdir, COMMIT_NAME)).type == pafs.FileType.NotFound:
            return self  # nothing to protect (and no lease left in a directory removed meanwhile)
        try:
            self._write()
            self.held = True
        except (OSError, pa.ArrowException) as exc:
            log.warning(
                "step %d under %s: cannot write a reader lease (%s); restoring without protection "
                "against retention",
                self.step,
                self.loc.uri,
                exc,
            )
            return self
        removing = posixpath.join(sdir, REMOVING_NAME)
        if self.loc.fs.get_file_info(removing).type != pafs.FileType.NotFound:
            self._release()
            raise CheckpointNotFound(
                f"checkpoint step {self.step} under {self.loc.uri} is being removed "
                f"(retention or `astate checkpoint rm`)"
            )
        threading.Thread(target=self._renew, name="astate-ckpt-lease", daemon=True).start()
        return self

    def _release(self) -> None:
        # No join: the renewal thread wakes at once and finds the lease released (a join costs a
        # scheduling round trip per restore on a busy host).
        self._stop.set()
        with self._lock:
            if not self.held:
                return
            self.held = False
            try:
                self.loc.fs.delete_file(self.path)
            except (OSError, pa.ArrowException):
                pass  # gone with the directory, or left to expire

    def __exit__(self, *exc: object) -> None:
        self._release()


def _leases(loc: Location, step: int) -> list[pafs.FileInfo]:
    sel = pafs.FileSelector(loc.step_dir(step), allow_not_found=True)
    return [i for i in loc.fs.get_file_info(sel) if LEASE_RE.match(i.base_name)]


def live_readers(loc: Location, step: int, now: float | None = None) -> list[str]:
    """Names of the leases of ``step`` still within their ttl (+ slack) at ``now`` (default: this
    host's clock; removers pass the storage's clock, the tombstone's modification time)."""
    now = time.time() if now is None else now
    out = []
    for info in _leases(loc, step):
        m = LEASE_RE.match(info.base_name)
        assert m is not None
        at = _mtime(info)
        if at is None or at + int(m.group(1)) / 1000 + SLACK >= now:
            out.append(info.base_name)  # no time known: taken as live
    return out


def _delete_step(loc: Location, step: int) -> None:
    """``COMMIT`` first (readers stop seeing the step), then the directory."""
    sdir = loc.step_dir(step)
    try:
        loc.fs.delete_file(posixpath.join(sdir, COMMIT_NAME))
    except FileNotFoundError:
        pass
    try:
        loc.fs.delete_dir(sdir)
    except FileNotFoundError:
        pass  # another remover finished first


def remove_checkpoint(uri: URI, step: int, *, by: str = "") -> None:
    """Remove complete checkpoint ``step`` under ``uri`` (the remover's protocol above).

    Raises:
        CheckpointInUse: it is the newest complete checkpoint, a restore holds a live lease on it,
            or it is not complete (another session may be writing it).
        CheckpointNotFound: no such step.
        CheckpointError: a filesystem error.
    """
    loc = resolve(uri)
    try:
        _remove(loc, step, by)
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointError(f"step {step}: removing it under {loc.uri} failed: {exc}") from exc


def _remove(loc: Location, step: int, by: str) -> None:
    sdir = loc.step_dir(step)
    names = {i.base_name for i in loc.fs.get_file_info(pafs.FileSelector(sdir, allow_not_found=True))}
    if not names:
        raise CheckpointNotFound(f"no checkpoint of step {step} under {loc.uri}")
    if COMMIT_NAME not in names:
        if REMOVING_NAME in names:  # an earlier remover died after deleting COMMIT: finish its work
            loc.fs.delete_dir(sdir)
            return
        raise CheckpointInUse(
            f"step {step} under {loc.uri} is not complete: another session may still be "
            "writing it (it is never removed)"
        )
    complete = list_checkpoints((loc.fs, loc.root))
    if complete and step == complete[-1]:
        raise CheckpointInUse(
            f"step {step} is the newest complete checkpoint under {loc.uri}; it is never removed"
        )
    tomb = posixpath.join(sdir, REMOVING_NAME)
    put_atomic(
        loc,
        tomb,
        json.dumps(
            {
                "format": FORMAT,
                "kind": "removing",
                "step": step,
                "by": by,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "at": time.time(),
            }
        ).encode(),
        fsync=False,
    )
    now = _mtime(loc.fs.get_file_info(tomb))
    readers = live_readers(loc, step, now)
    if readers:
        try:
            loc.fs.delete_file(tomb)
        except (OSError, pa.ArrowException):
            pass  # the next remover sees a live lease again, or finishes
        raise CheckpointInUse(
            f"step {step} under {loc.uri} is being restored ({len(readers)} live reader "
            f"lease{'s' if len(readers) != 1 else ''}: {', '.join(sorted(readers)[:4])})"
        )
    _delete_step(loc, step)
    log.info("removed checkpoint step %d under %s%s", step, loc.uri, f" ({by})" if by else "")


@dataclass
class RetentionResult:
    """What one retention pass did: steps removed, kept (with why), and those the policy would
    remove but could not (with why: a live reader, a filesystem error)."""

    removed: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)
    busy: dict[int, str] = field(default_factory=dict)


def policy_view(uri: URI, policy: RetentionPolicy) -> dict[int, str]:
    """Step -> what ``policy`` does with each complete checkpoint under ``uri`` now (as
    ``keep_reasons``; a step the policy would remove but a live restore reads says ``"reading"``)."""
    loc = resolve(uri)
    view = keep_reasons(list_checkpoints((loc.fs, loc.root)), policy)
    for s, why in view.items():
        if why == REMOVE and live_readers(loc, s):
            view[s] = "reading"
    return view


def apply_retention(
    uri: URI, policy: RetentionPolicy, upto: int | None = None, *, by: str = "retention"
) -> RetentionResult:
    """Remove the complete checkpoints under ``uri`` that ``policy`` does not keep (only steps
    below ``upto`` when given: the checkpoint just completed), and the debris of removers that
    died half-way. Safe to run from several processes at once; never raises for one step (it is
    reported in ``busy`` and retried by the next pass)."""
    loc = resolve(uri)
    res = RetentionResult()
    for s, why in keep_reasons(list_checkpoints((loc.fs, loc.root)), policy, upto).items():
        if why != REMOVE:
            res.kept[s] = why
            continue
        try:
            _remove(loc, s, by)
            res.removed.append(s)
        except CheckpointNotFound:
            res.removed.append(s)  # another remover got there first
        except CheckpointInUse as exc:
            res.busy[s] = str(exc)
        except (OSError, pa.ArrowException) as exc:
            res.busy[s] = f"filesystem error: {exc}"
    _sweep_abandoned(loc, upto, res)
    return res


def _sweep_abandoned(loc: Location, upto: int | None, res: RetentionResult) -> None:
    """Delete step directories a dead remover left (``REMOVING`` without ``COMMIT``) below ``upto``."""
    try:
        entries = loc.fs.get_file_info(pafs.FileSelector(loc.root, allow_not_found=True))
    except (OSError, pa.ArrowException):
        return
    for e in entries:
        m = STEP_RE.match(e.base_name)
        if not m or e.type != pafs.FileType.Directory or (upto is not None and int(m.group(1)) >= upto):
            continue
        step = int(m.group(1))
        sdir = loc.step_dir(step)
        infos: Any = loc.fs.get_file_info(
            [posixpath.join(sdir, REMOVING_NAME), posixpath.join(sdir, COMMIT_NAME)]
        )
        if infos[0].type == pafs.FileType.File and infos[1].type == pafs.FileType.NotFound:
            try:
                loc.fs.delete_dir(sdir)
                res.removed.append(step)
            except (OSError, pa.ArrowException) as exc:
                res.busy[step] = f"filesystem error: {exc}"
