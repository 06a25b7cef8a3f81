"""Replica servers (``astate serve``): processes that hold the newest committed version of every
namespace under a prefix, so state outlives the writer that published it (docs/replicas.md).

A server is an ordinary consumer that re-serves what it pulled:

- **Discovery**: one scan of the namespaces under ``/astate/<prefix>`` and their ``latest``
  counters, then one watch on that key range (only ``<namespace>/latest`` events are acted on);
  a full rescan every ``rescan_seconds``, and at once when the watch stream ends.
- **Pull**: per namespace a :class:`~astate_store.store.Store` from the server's ``SessionHub``
  (one etcd connection, lease and UCX worker for all namespaces), whose consumer fills buffers
  the server allocated — the normal ``get_into`` data path, with its reader protocol (never
  bytes of two steps).
- **Serve**: those buffers are offered as a replica of the step in the group
  ``server-<server id>`` (``catalog.replicas.server_group``), on the server's lease: readers and
  ``recover()`` plan with it like any re-serving consumer, and ``connect(..., replicas=K)`` waits
  for K such groups. A killed server's offers vanish with its lease.
- **Double buffering**: each namespace has two buffer sets. Step n stays offered from one while
  n+1 is pulled into the other; then n+1 is offered and n withdrawn (its readers waited for,
  bounded by ``retire_timeout``). The idle set is reused for n+2 when the shapes stay the same.

Memory budget (``memory_bytes``, every buffer set counted): when a pull needs memory, the server
frees, in this order, until it fits:

1. the idle (second) buffer sets of other namespaces, least recently committed first;
2. whole other namespaces (withdrawn and closed), least recently committed first — "least
   recently committed" is the etcd revision of their ``latest``, one order over all namespaces;
3. this namespace's own served copy: the new step is then pulled in place of the old one, and
   the server does not serve the namespace while it pulls (single buffering).

A version larger than the whole budget is not held (logged once per step). Several servers each
hold what fits: namespaces that fit in several are replicated; give servers disjoint
``--namespace-prefix`` values to spread namespaces over them instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from astate_store.catalog.replicas import server_group
from astate_store.errors import AStateError, CodecError
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.etcd.config import EtcdConfig
from astate_store.get.kv import KeyInfo, keys
from astate_store.hub import SessionHub
from astate_store.model import codec
from astate_store.model.dtypes import torch_dtype
from astate_store.put.serving import Serving
from astate_store.store import Store

__all__ = ["ReplicaServer", "main", "parse_bytes"]

log = logging.getLogger("astate_store.servers.replica")

ROOT = "/astate/"
_LATEST = re.compile(r"^/astate/([A-Za-z0-9_.\-]{1,128})/latest$")
_ALIGN = 4096  # each tensor of a buffer set starts on its own page: registrations never touch
_RETRY_AFTER = 2.0  # seconds before a namespace whose pull failed is tried again


@dataclass(eq=False)
class _Slot:
    """One buffer set of a namespace: one page-aligned allocation, viewed as its tensors."""

    signature: tuple[tuple[str, str, tuple[int, ...]], ...]
    nbytes: int
    tensors: dict[str, torch.Tensor]
    serving: Serving
    step: int | None = None
    offered: bool = False


@dataclass(eq=False)
class _Namespace:
    """What the server knows and holds of one namespace."""

    name: str
    latest: int | None = None
    revision: int = 0  # etcd mod revision of ``latest``: the eviction order
    store: Store | None = None
    slots: list[_Slot] = field(default_factory=list)
    retry_at: float = 0.0
    refused: int | None = None  # the step logged as too large for the budget
    failed: int | None = None  # the step whose pull failed (logged once)

    @property
    def served(self) -> _Slot | None:
        return next((s for s in self.slots if s.offered), None)

    @property
    def held_step(self) -> int | None:
        s = self.served
        return None if s is None else s.step

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


class ReplicaServer:
    """Hold and serve the newest committed version of every namespace under a prefix.

    Args:
        etcd: etcd's endpoints (``host:port``, comma-separated) or an :class:`EtcdConfig`.
        namespace_prefix: serve the namespaces whose names start with this ("" : all).
        memory_bytes: the most buffer memory this server holds (both buffer sets of every
            namespace counted); see the module docstring for what is freed first.
        transport: the data path of the server's stores (``"auto"``, ``"shm"``, ``"tcp"``).
        lease_ttl: seconds after which a killed server's offers vanish from the catalog.
        retire_timeout: seconds a withdrawn step's readers are waited for.
        pull_timeout: seconds one pull may take (waiting for its version, and reading it).
        rescan_seconds: full rescans of the namespaces (a safety net under the watch).
        server_id: this server's id in its replica group's name (default host-pid-random).

    Raises:
        ValueError: ``memory_bytes`` < 1.
        CatalogError: a bad endpoint or credentials.
    """

    def __init__(
        self,
        etcd: str | EtcdConfig,
        namespace_prefix: str = "",
        memory_bytes: int = 8 << 30,
        *,
        transport: str = "auto",
        lease_ttl: float = 10.0,
        retire_timeout: float = 5.0,
        pull_timeout: float = 30.0,
        rescan_seconds: float = 10.0,
        server_id: str | None = None,
    ):
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 1:
            raise ValueError(f"memory_bytes must be a positive int, got {memory_bytes!r}")
        if "/" in namespace_prefix:
            raise ValueError(f"namespace_prefix {namespace_prefix!r}: namespaces hold no '/'")
        self.config = EtcdConfig.parse(etcd)
        self.prefix, self.memory_bytes = namespace_prefix, memory_bytes
        self.transport, self.lease_ttl, self.retire_timeout = transport, lease_ttl, retire_timeout
        self.pull_timeout, self.rescan_seconds = pull_timeout, rescan_seconds
        sid = server_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.server_id = re.sub(r"[^A-Za-z0-9_.\-]", "_", sid)
        self.group = server_group(self.server_id)
        self._client = EtcdClient(
            self.config, "_replica-server", lease_ttl=lease_ttl, op_timeout=5.0, retry_deadline=15.0
        )
        # The namespaces' stores share one etcd connection, lease and UCX worker (hub.py):
        # a server holds thousands of small namespaces without a worker and threads for each.
        self._hub = SessionHub(etcd=self.config, lease_ttl=lease_ttl, transport=transport)
        self._cond = threading.Condition()
        self._dirty = False
        self._watch: Any = None
        self._watch_alive = False
        self._stop = threading.Event()
        self._ns: dict[str, _Namespace] = {}
        self._last_scan = -1e9

    # ---- what it holds -------------------------------------------------------------------

    @property
    def held(self) -> dict[str, int]:
        """Namespace -> the step this server offers now."""
        return {n.name: n.held_step for n in list(self._ns.values()) if n.held_step is not None}  # type: ignore[misc]

    @property
    def used_bytes(self) -> int:
        return sum(n.nbytes for n in list(self._ns.values()))

    # ---- lifetime ------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`; then withdraw every offer and close (blocking)."""
        log.info(
            "replica server %s: serving namespaces %r* within %d bytes (etcd %s)",
            self.server_id,
            self.prefix,
            self.memory_bytes,
            self.config.url,
        )
        try:
            while not self._stop.is_set():
                if not self._watch_alive or time.monotonic() - self._last_scan >= self.rescan_seconds:
                    self._scan()
                for ns in self._due():
                    if self._stop.is_set():
                        break
                    self._refresh(ns)
                with self._cond:
                    if not self._dirty and not self._stop.is_set():
                        self._cond.wait(self._wait_seconds())
                    self._dirty = False
        finally:
            self._close()

    def stop(self) -> None:
        """Ask :meth:`run` to finish (safe from a signal handler or another thread)."""
        self._stop.set()
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

    def _wait_seconds(self) -> float:
        pending = [n.retry_at for n in self._ns.values() if n.retry_at and self._wants(n)]
        nxt = min([self._last_scan + self.rescan_seconds, *pending]) - time.monotonic()
        return max(0.05, min(nxt, self.rescan_seconds))

    def _close(self) -> None:
        self._cancel_watch()
        for ns in list(self._ns.values()):
            _evict(ns, "the server stops")
        self._client.close()
        self._hub.close()
        log.info("replica server %s: stopped", self.server_id)

    # ---- discovery -----------------------------------------------------------------------

    def _scan(self) -> None:
        """Every namespace under the prefix and its ``latest``, then the watch from that revision."""
        c = self._client
        start, end = (ROOT + self.prefix).encode(), range_end(ROOT + self.prefix)
        seen: dict[str, tuple[int | None, int]] = {}
        rev = None
        while True:
            first = start
            resp = c.call(
                "list namespaces", lambda: c.raw.get_range_response(first, end, keys_only=True, limit=1)
            )
            rev = int(resp.header.revision) if rev is None else rev
            if not resp.kvs:
                break
            name = resp.kvs[0].key.decode("utf-8", "replace")[len(ROOT) :].split("/", 1)[0]
            key = f"{ROOT}{name}/latest"
            got = c.call("get latest", lambda: c.raw.get_response(key))
            if got.kvs:
                seen[name] = (self._counter(key, got.kvs[0].value), int(got.kvs[0].mod_revision))
            start = (ROOT + name + "0").encode()  # past every key of this namespace ('/' + 1)
        with self._cond:
            for name, (latest, mrev) in seen.items():
                self._saw(name, latest, mrev)
            for name in [n for n in self._ns if n not in seen]:
                self._ns[name].latest = None  # its latest is gone (versions deleted): no longer held
        if not self._watch_alive:
            self._start_watch(rev)
        self._last_scan = time.monotonic()

    def _counter(self, key: str, raw: bytes) -> int | None:
        try:
            return codec.decode_counter(raw)
        except CodecError as exc:
            log.warning("replica server: skipping %s: not a counter (%s)", key, exc)
            return None

    def _saw(self, name: str, latest: int | None, revision: int) -> None:
        """A namespace's ``latest`` as read or watched (``_cond`` held)."""
        ns = self._ns.get(name)
        if ns is None:
            ns = self._ns[name] = _Namespace(name)
        if latest is not None and (ns.latest is None or latest > ns.latest):
            ns.latest, ns.revision, ns.retry_at = latest, max(ns.revision, revision), 0.0
            self._dirty = True
            self._cond.notify_all()

    def _start_watch(self, rev: int) -> None:
        c, key = self._client, ROOT + self.prefix
        self._cancel_watch()
        self._watch = c.call(
            "watch namespaces",
            lambda: c.raw.add_watch_callback(
                key, self._on_event, range_end=range_end(key), start_revision=rev + 1
            ),
        )
        self._watch_alive = True

    def _cancel_watch(self) -> None:
        w, self._watch, self._watch_alive = self._watch, None, False
        if w is not None:
            try:
                self._client.raw.cancel_watch(w)
            except Exception:  # the stream may already be gone
                pass

    def _on_event(self, resp: Any) -> None:
        """Watch callback (the watch thread): only ``<namespace>/latest`` keys matter."""
        with self._cond:
            if isinstance(resp, Exception):
                self._watch_alive = False  # re-watched (with a rescan) by the loop
                self._dirty = True
                self._cond.notify_all()
                return
            for ev in getattr(resp, "events", ()):
                m = _LATEST.match(ev.key.decode("utf-8", "replace"))
                if m is None:
                    continue
                if type(ev).__name__ == "DeleteEvent":
                    if m.group(1) in self._ns:
                        self._ns[m.group(1)].latest = None
                        self._dirty = True
                    continue
                self._saw(m.group(1), self._counter(m.group(0), ev.value), int(ev.mod_revision))
            self._cond.notify_all()

    # ---- pulling and serving -------------------------------------------------------------

    def _wants(self, ns: _Namespace) -> bool:
        """Whether a namespace needs work: a newer step to pull, or buffers of deleted versions."""
        if ns.latest is None:
            return bool(ns.slots)
        return ns.latest != ns.held_step and ns.refused != ns.latest

    def _due(self) -> list[_Namespace]:
        """Namespaces to act on now, most recently committed first."""
        now = time.monotonic()
        with self._cond:
            todo = [n for n in self._ns.values() if self._wants(n) and n.retry_at <= now]
        return sorted(todo, key=lambda n: -n.revision)

    def _refresh(self, ns: _Namespace) -> None:
        if ns.latest is None:
            _evict(ns, "its versions are gone")
            return
        step = ns.latest
        try:
            store = self._store(ns)
            info = keys(store.catalog, step)
            slot = self._slot_for(ns, info, step)
            if slot is None:
                return
            got = store.get_into(slot.tensors, step=step, timeout=self.pull_timeout)
            old = ns.served
            slot.step, slot.offered = got, True  # before the offer is visible (``held`` is read by others)
            try:
                slot.serving.serve(got, slot.tensors, self.group)
            except BaseException:
                slot.offered = False
                raise
            if old is not None and old is not slot:
                old.offered = False
                old.serving.withdraw()
            log.info("replica server: holds %s step %d (%d bytes)", ns.name, got, slot.nbytes)
        except AStateError as exc:
            # The writer may be gone before the server pulled, or the step dropped meanwhile:
            # retried shortly (another server may hold it by then; it is a source too).
            first = ns.failed != step
            ns.failed = step
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "replica server: could not pull %s step %d: %s: %s (retrying every %.0fs)",
                ns.name,
                step,
                type(exc).__name__,
                exc,
                _RETRY_AFTER,
            )
            ns.retry_at = time.monotonic() + _RETRY_AFTER

    def _store(self, ns: _Namespace) -> Store:
        if ns.store is None:
            # No pre-pack requests: the server reads whole tensors, and must not make publishers
            # build copies for it; a pull is bounded by pull_timeout (one hung peer stalls the loop).
            ns.store = self._hub.open(
                ns.name, retire_timeout=self.retire_timeout, read_timeout=self.pull_timeout, prepack=False
            )
        return ns.store

    def _slot_for(self, ns: _Namespace, info: dict[str, KeyInfo], step: int) -> _Slot | None:
        """The buffer set to pull ``step`` into: the idle one when its shapes fit, else a new one,
        freeing memory by the budget policy; None when the version cannot be held."""
        sig = tuple((n, k.dtype, k.global_shape) for n, k in info.items())
        idle = [s for s in ns.slots if not s.offered]
        fit = next((s for s in idle if s.signature == sig), None)
        if fit is not None:
            return fit
        for s in idle:  # wrong shapes: freed (nobody reads an idle set)
            ns.slots.remove(s)
        need = _slot_bytes(info)
        if need > self.memory_bytes:
            return self._refuse(ns, step, f"{need} bytes exceed the budget of {self.memory_bytes}")
        self._make_room(ns, need)
        if self._fits(need):
            return self._new_slot(ns, sig, info, need)
        served = ns.served
        if served is not None:
            # Single buffering: stop serving the old step and pull the new one in its place.
            log.info(
                "replica server: %s: no room for a second buffer set; not serving it during the pull", ns.name
            )
            served.offered = False
            served.serving.withdraw()
            if served.signature == sig:
                return served
            ns.slots.remove(served)
            if self._fits(need):
                return self._new_slot(ns, sig, info, need)
        return self._refuse(
            ns, step, f"no room for {need} bytes: the other namespaces held were committed more recently"
        )

    def _fits(self, need: int) -> bool:
        return self.used_bytes + need <= self.memory_bytes

    def _refuse(self, ns: _Namespace, step: int, why: str) -> None:
        """Not holding ``step`` (logged once per step); an older step held is dropped too (a
        stale copy serves nobody: readers and recovery ask for the newest)."""
        if ns.refused != step:
            log.warning("replica server: not holding %s step %d: %s", ns.name, step, why)
        ns.refused = step
        _evict(ns, "its newest version is not held")
        return None

    def _make_room(self, ns: _Namespace, need: int) -> None:
        """Free memory, by the policy of the module docstring, until ``need`` more bytes fit:
        other namespaces' idle buffer sets, then whole namespaces committed before this one,
        least recently committed first."""
        others = sorted(
            (n for n in list(self._ns.values()) if n is not ns and n.slots), key=lambda n: n.revision
        )
        for other in others:
            if self._fits(need):
                return
            other.slots = [s for s in other.slots if s.offered]  # nobody reads an idle set
        for other in others:
            if self._fits(need) or other.revision > ns.revision:
                return
            _evict(other, f"room for {ns.name} (least recently committed first)")

    def _new_slot(self, ns: _Namespace, sig: tuple[Any, ...], info: dict[str, KeyInfo], need: int) -> _Slot:
        store = self._store(ns)
        flat = store.serving_memory(need)  # page-aligned and NUMA-local to the server's transport
        tensors, off = {}, 0
        for name, k in info.items():
            dt = torch_dtype(k.dtype, tensor=name)
            tensors[name] = flat[off : off + k.nbytes].view(dt).view(k.global_shape)
            off += _round(k.nbytes)
        # Each buffer set has its own registry and offer: withdrawing one leaves the other served.
        slot = _Slot(sig, need, tensors, store.offer())
        ns.slots.append(slot)
        return slot


def _evict(ns: _Namespace, why: str) -> None:
    """Withdraw a namespace's offer, free its buffers and close its store."""
    for s in ns.slots:
        if s.offered:
            try:
                s.serving.withdraw()
            except AStateError as exc:  # its lease ends with the store: readers then fail over
                log.warning("replica server: withdrawing %s failed: %s", ns.name, exc)
    had = ns.held_step
    ns.slots = []
    if ns.store is not None:
        try:
            ns.store.close()
        except AStateError as exc:
            log.warning("replica server: closing %s failed: %s", ns.name, exc)
        ns.store = None
    if had is not None:
        log.info("replica server: no longer holds %s (step %d): %s", ns.name, had, why)


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _slot_bytes(info: dict[str, KeyInfo]) -> int:
    return max(_ALIGN, sum(_round(k.nbytes) for k in info.values()))


_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"512M"``, ``"8GiB"``, ``"1.5G"`` -> bytes.

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 4096, 512M, 8GiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if n < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """``astate serve`` / ``python -m astate_store.servers.replica``: run a replica server until
    SIGINT or SIGTERM. Returns the exit status."""
    p = argparse.ArgumentParser(
        prog="astate serve",
        description="Hold and serve the newest version of every "
        "namespace under a prefix, so state outlives its writer (docs/replicas.md).",
    )
    p.add_argument("--etcd", default=None, help="etcd endpoints (default $ASTATE_ETCD)")
    p.add_argument("--namespace-prefix", default="", help="serve namespaces whose names start with this")
    p.add_argument("--memory-bytes", default="8GiB", type=parse_bytes, help="buffer memory budget (8GiB)")
    p.add_argument("--transport", default="auto", choices=("auto", "shm", "tcp"))
    p.add_argument(
        "--lease-ttl", default=10.0, type=float, help="seconds until a killed server's offers vanish"
    )
    p.add_argument("--server-id", default=None, help="id in the replica group name (default host-pid-random)")
    p.add_argument("-v", "--verbose", action="store_true", help="log info messages")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = EtcdConfig.from_args(args.etcd)
        server = ReplicaServer(
            config,
            args.namespace_prefix,
            args.memory_bytes,
            transport=args.transport,
            lease_ttl=args.lease_ttl,
            server_id=args.server_id,
        )
    except (AStateError, ValueError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
