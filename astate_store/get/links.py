"""Links to peers: connecting the sources a pull reads, dropping those no recent version names,
and telling the transport which of their pages a pull will read (prefaulting).

A consumer keeps one endpoint per peer (a publisher rank of one session epoch, or a re-serving
consumer), made from that peer's layout's transport descriptor:

1. :meth:`Links.connect` / :meth:`Links.connect_peer` before a batch is planned against a group;
2. :meth:`Links.warm` before a new batch from the publishers is planned, and
   :meth:`Links.prefault_ahead` after its first good pull (pages of the other staging slots);
3. :meth:`Links.disconnect_departed` after each good pull, so connections stay bounded;
4. :meth:`Links.forget` after a failed read (its endpoints may be closed: connect afresh).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astate_store.catalog import Version
from astate_store.context import StoreContext
from astate_store.errors import CodecError, PeerUnreachable, TransportError
from astate_store.get.conversion import Conversion
from astate_store.get.sources import SourceGroup, Wanted, byte_spans, publisher_peer, read_spans
from astate_store.model import codec

__all__ = ["Links", "RecentPeers"]

log = logging.getLogger("astate_store")

_KEEP_PEERS = 4  # pulls a peer stays connected after its last appearance in a version's sources
_SPANS = 32  # (layout, buffers) byte-span sets kept for prefaulting


@dataclass
class RecentPeers:
    """The peers of the last pulls, to drop the ones none of them names: a steady state (the
    same sources pull after pull) costs one comparison."""

    key: object = None  # the sources of the newest pull: (layout key, missing ranks)
    streak: int = 0  # pulls in a row with those sources
    peers: deque[frozenset[Hashable]] = field(default_factory=lambda: deque(maxlen=_KEEP_PEERS))


class Links:
    """One consumer's endpoints: which peers are connected, with which layout's descriptor."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx
        self.connected: dict[Any, str] = {}  # peer -> layout id its rkeys come from
        self._recent = RecentPeers()
        self._spans: dict[object, list[tuple[int, int, int]]] = {}  # (layout id, buffers) -> byte spans
        self._descriptors: dict[str, dict[str, Any]] = {}  # layout id -> its decoded transport descriptor

    def forget(self) -> None:
        """After a failed read: its endpoints may be closed, so connect afresh next time."""
        self.connected.clear()

    def connect(self, g: SourceGroup) -> None:
        """Connect every source of ``g`` (raises ``PeerUnreachable`` for one that cannot be)."""
        for peer, _rank, lay in g.sources.values():
            self.connect_peer(peer, lay)

    def connect_peer(self, peer: Any, lay: Any, *, report: bool = True) -> bool:
        """Connect ``peer`` with its layout's descriptor unless already done. Raises
        ``PeerUnreachable`` (a bad descriptor counted as a skipped record) when ``report``;
        else returns False, leaving the report to the pull's own connect."""
        if self.connected.get(peer) == lay.layout_id:
            return True
        try:
            desc = codec.decode("ucx_descriptor", lay.transport)
        except CodecError as exc:
            if not report:
                return False
            # A bad descriptor makes this source unreachable; the pull fails over to the others.
            self.ctx.catalog.versions.skips(f"transport descriptor of layout {lay.layout_id}", str(exc))
            raise PeerUnreachable(f"source {peer}: its layout's transport descriptor is bad: {exc}") from None
        try:
            self.ctx.transport.connect(peer, desc)
        except TransportError as exc:
            if not report:
                return False
            raise PeerUnreachable(f"cannot connect to source {peer}: {exc}") from exc
        self.connected[peer] = lay.layout_id
        return True

    def exited(self, groups: Mapping[str, SourceGroup]) -> frozenset[str]:
        """The groups with a source whose process is known to have exited (on this node, its pid
        gone) while its lease lives on (up to ``lease_ttl``): a pull does not plan or dial them."""
        out = set()
        for name, g in groups.items():
            for _peer, _rank, lay in g.sources.values():
                desc = self._descriptors.get(lay.layout_id)
                if desc is None:
                    try:
                        desc = codec.decode("ucx_descriptor", lay.transport)
                    except CodecError:
                        continue  # a bad descriptor: the connect reports it
                    if len(self._descriptors) >= _SPANS:
                        self._descriptors.clear()
                    self._descriptors[lay.layout_id] = desc
                if self.ctx.transport.exited(desc):
                    out.add(name)
                    break
        return frozenset(out)

    def warm(self, version: Version, wanted: Wanted, fingerprint: object) -> None:
        """Before planning a pull from the publishers: connect them and tell the transport which
        of their bytes the buffers' tensors (``wanted``) occupy, so that a mapped same-host source
        has the kernel map those pages on another core while this thread plans (mapping
        costs per GiB read, which a first pull would otherwise pay after planning, on its own
        thread). A hint: a failure here is left to the pull, which connects and reports it itself."""
        for r, lay in version.layouts.items():
            peer = publisher_peer(r, lay)
            if not self.connect_peer(peer, lay, report=False):
                continue
            key = (lay.layout_id, fingerprint)
            spans = self._spans.get(key)
            if spans is None:
                if len(self._spans) >= _SPANS:
                    self._spans.clear()
                # pre-packed copies too: a plan reads those instead of the strided shards
                spans = self._spans[key] = byte_spans(lay.shards, lay.packed, wanted, lay.columns)
            self.ctx.transport.prefault(peer, _shifted(spans, version.pieces[r].base_offset))

    def prefault_ahead(self, version: Version, ops: np.ndarray) -> None:
        """After the first good pull of a new batch: the byte ranges its ``ops`` read from each
        publisher's slot, in that publisher's other staging slots (its piece lists them), mapped
        in the background before a step first reads them — a slot's first read otherwise waits
        for that with nothing left to overlap (the plan is cached by then)."""
        spans, tr = read_spans(ops), self.ctx.transport
        for r, lay in version.layouts.items():
            piece, peer = version.pieces[r], publisher_peer(r, lay)
            if len(piece.slot_bases) < 2 or self.connected.get(peer) != lay.layout_id:
                continue
            try:
                index, base = tr.peer_index(peer), piece.base_offset
            except KeyError:  # dropped meanwhile: a hint is not worth failing a good pull over
                continue
            mine = [(region, lo - base, hi - base) for region, lo, hi in spans.get(index, ()) if lo >= base]
            for b in piece.slot_bases:
                if b != base and mine:
                    tr.prefault(peer, _shifted(mine, b))

    def sources_read(
        self, groups: Mapping[str, SourceGroup], ops: np.ndarray, conversions: list[Conversion]
    ) -> frozenset[object]:
        """The sources whose memory these ops read: their torn markers decide whether the bytes
        are good (a source that did not serve this pull cannot tear it)."""
        from astate_store.catalog.readers import replica_source

        used = set(np.unique(ops[:, 0]).tolist())
        for conv in conversions:
            for chunk_ops, _src, _dst in conv.chunks:
                used.update(np.unique(chunk_ops[:, 0]).tolist())
        out: set[object] = set()
        for g in groups.values():
            for peer, rank, _lay in g.sources.values():
                if peer in self.connected and self.ctx.transport.peer_index(peer) in used:
                    out.add(rank if rank is not None else replica_source(peer[1]))
        return frozenset(out)

    def disconnect_departed(self, version: Version, groups: Mapping[str, SourceGroup] | None) -> bool:
        """After a good pull: close the endpoints (rkeys, pidfds) of peers that no source group
        of the last ``_KEEP_PEERS`` pulled versions names (publishers that left or restarted,
        withdrawn re-servers), so connections and ``connected`` stay bounded. ``groups``: the
        version's source groups; None when its publishers are its only source (then they are
        never merged: see ``Consumer._pull``). True when some peer was disconnected: ready-made
        batches may name its index."""
        st, key = self._recent, (version.layout_key, version.missing)
        if st.key == key:
            st.streak += 1
            if st.streak > _KEEP_PEERS:
                return False  # every peer that left was disconnected when the window filled
            peers = st.peers[-1]
        else:
            peers = (
                frozenset(publisher_peer(r, lay) for r, lay in version.layouts.items())
                if groups is None
                else frozenset(peer for g in groups.values() for peer, _r, _l in g.sources.values())
            )
            st.key, st.streak = key, 1
        st.peers.append(peers)
        live = frozenset().union(*st.peers)
        tr = self.ctx.transport
        gone = [p for p in tr.peers if p not in live]
        for p in gone:
            try:
                tr.disconnect(p)
            except Exception as exc:  # the pull succeeded: a failed close must not undo it
                log.warning("disconnecting departed peer %s failed: %s", p, exc)
        for p in [p for p in self.connected if p not in live]:
            del self.connected[p]
        if gone:
            log.info(
                "step %d: disconnected %d peers no recent version lists (%s)",
                version.step,
                len(gone),
                ", ".join(map(str, gone[:4])) + (", ..." if len(gone) > 4 else ""),
            )
        return bool(gone)


def _shifted(spans: list[tuple[int, int, int]], base: int) -> list[tuple[int, int, int]]:
    return [(region, lo + base, hi + base) for region, lo, hi in spans]
