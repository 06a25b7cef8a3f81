"""Delta pulls (docs/delta.md): pulling version N into buffers that hold exactly version M < N
moves only what changed between them.

The buffers count as holding M when they are the very buffers (the same validated entries) of
the consumer's last good pull, which delivered M, and nothing forgot them since
(``Store.forget``): the caller's promise, with ``delta=True``, that nothing else writes them.
``verify=True`` checks that promise, and every pull, against the publishers' digests.

Call sequence (``Consumer._read_once`` -> :meth:`DeltaPulls.pull`), the buffers untouched until 6:

1. the chain: per publisher rank, N's delta record names its base; the versions between are
   read (one etcd round trip each) until M: every link in the same staged layout, each with a
   step word. No chain (a restarted publisher, a new layout, a bad record): whole;
2. the plan (``delta_plan``, cached per layouts and buffers): the tiles each buffer needs; with
   ``delta_choice="time"`` (``delta_choice``), whole if that was measured faster for the bytes the
   records say the changes take;
3. the index rows of those tiles, of every link, in one batched read;
4. per tile: raw when any link says so (read from N's slot, the buffer's part only), else each
   link's encoded changes; more bytes than a whole pull of the same buffers: whole;
5. the changes, then every link's step word (a second small read): N's word changed: torn (the
   caller retries on a newer version, the buffers still hold M); an older link's: whole;
6. check every tile's encoding, then apply the links oldest first (``_delta.decode``: a
   scatter into host buffers of the published dtype; converted or device buffers through torch),
   then the raw tiles; ``verify``: digests of the tiles the buffers hold whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from astate_store.catalog import Version
from astate_store.context import StoreContext
from astate_store.errors import CatalogError, DeltaMismatch, TransportError, VersionNotFound
from astate_store.get.batches import Batches, Work
from astate_store.get.delta_choice import DeltaChoice
from astate_store.get.delta_plan import DeltaPlan, plan_delta
from astate_store.get.delta_reads import Link, Reads, convert, fields
from astate_store.get.links import Links
from astate_store.get.sources import PUBLISHERS, publisher_peer
from astate_store.model import delta_format as fmt
from astate_store.model.delta_native import hashing, native, threads
from astate_store.model.validation import Entry
from astate_store.transport.base import make_ops

__all__ = ["DeltaPulls", "Outcome"]

log = logging.getLogger("astate_store")

_MAX_CHAIN = 64  # links one pull follows (a staging pool holds at most 64 slots)
_PLANS = 4  # delta plans kept (layouts x buffers)
_WORD = np.uint64(fmt.ENC_SHIFT)
_MASK = np.uint64(fmt.COUNT_MASK)


@dataclass
class Outcome:
    """What a delta attempt did: ``done`` (the buffers hold N; ``work`` tells what moved),
    ``torn`` (N's slot changed under the read; the buffers still hold M), or neither: pull whole
    (``why``)."""

    done: bool = False
    torn: bool = False
    why: str = ""
    failed: bool = False  # a read failed (the endpoints may be closed: connect afresh)
    sources: frozenset[object] = frozenset()
    work: Work | None = None
    elements: int = 0  # elements applied


@dataclass
class _Check:
    """What ``verify`` compares: the pull's plan and, per rank, N's index rows of the needed tiles."""

    step: int
    plan: DeltaPlan
    rows: dict[int, np.ndarray]


class _Fallback(Exception):
    """This pull goes whole (the message says why)."""


class DeltaPulls:
    """One consumer's delta pulls: which step its buffers hold, and pulling only what changed."""

    def __init__(self, ctx: StoreContext, links: Links, batches: Batches):
        self.ctx, self.links, self.batches = ctx, links, batches
        self._held: tuple[list[Entry], int] | None = None  # (the buffers' entries, the step they hold)
        self._plans: dict[object, DeltaPlan | None] = {}
        # the changes read, kept for the next pull (its pages mapped: reading into fresh pages
        # cost more than the read itself over tcp); at most an eighth of the buffers' bytes
        self._scratch: np.ndarray | None = None
        self._choice = DeltaChoice(ctx.options.delta_choice)  # through the changes or whole

    # ---- what the buffers hold -------------------------------------------------------------

    def delivered(self, dests: list[Entry], step: int) -> None:
        """A good pull left exactly ``step`` in these buffers."""
        self._held = (dests, step)

    def forget(self) -> None:
        """The buffers' bytes are no base any more (written, torn, or ``Store.forget``)."""
        self._held = None

    def pulled_whole(self, dests: list[Entry], seconds: float, warm: bool) -> None:
        """A whole pull into ``dests`` took ``seconds`` (``warm``: they took the last pull too): what
        ``delta_choice="time"`` weighs the changes against."""
        self._choice.took_whole(dests, seconds, warm)

    def held(self, dests: list[Entry]) -> int | None:
        """The step these very buffers hold, if known."""
        h = self._held
        return h[1] if h is not None and h[0] is dests else None

    # ---- a pull ----------------------------------------------------------------------------

    def pull(self, version: Version, dests: list[Entry]) -> Outcome:
        """Pull ``version`` into ``dests`` through changes (module docstring); never raises for
        a reason to pull whole, which it returns instead. ``version`` has its layouts."""
        m = self.held(dests)
        if m is None:
            return Outcome(why="the buffers hold no known version")
        if m == version.step and not self.ctx.options.verify:  # they hold it already: nothing moves
            empty = Work(np.zeros((0, 5), dtype=np.int64), [], frozenset(), 0, 0)
            return Outcome(done=True, work=empty)
        if m >= version.step:
            return Outcome(why=f"the buffers hold step {m}, not older than {version.step}")
        t0 = time.perf_counter()
        try:
            chains = self._chains(version, m)
            plan = self._plan(version, dests)
            expect = expected_bytes(plan, chains)
            why = self._choice.whole_instead(dests, expect)
            if why is not None:
                self.ctx.stats.delta_declined += 1
                return Outcome(why=why)
            out = self._run(version, dests, plan, chains)
            if out.done:
                self._choice.took_delta(dests, expect, time.perf_counter() - t0)
            return out
        except _Fallback as exc:
            return Outcome(why=str(exc))
        except TransportError as exc:  # before any byte was applied
            return Outcome(why=f"a read failed ({exc})", failed=True)

    def _chains(self, version: Version, held: int) -> dict[int, list[Link]]:
        """Per rank, the links from ``held`` (exclusive) to ``version`` (inclusive), oldest first."""
        if version.missing or not version.layouts or set(version.layouts) != set(version.pieces):
            raise _Fallback("not every publisher rank is live")
        older: dict[int, Version] = {}
        chains: dict[int, list[Link]] = {}
        for r, piece in version.pieces.items():
            links: list[Link] = []
            p = piece
            while True:
                if p.delta is None or p.delta.base is None or p.step_word is None:
                    raise _Fallback(f"rank {r} has no change map from its previous put at step {p.step}")
                if p.layout_id != piece.layout_id or p.epoch != piece.epoch:
                    raise _Fallback(f"rank {r}'s layout changed after step {held}")
                links.append(Link(p.step, p.delta, p.base_offset, p.step_word))
                base = p.delta.base
                if base == held:
                    break
                if base < held or len(links) >= _MAX_CHAIN:
                    raise _Fallback(f"rank {r}'s changes do not lead back to step {held}")
                p = self._piece(older, base, r)
            chains[r] = links[::-1]
        return chains

    def _piece(self, older: dict[int, Version], step: int, rank: int) -> Any:
        """Rank ``rank``'s piece of committed ``step`` (an older link of a chain)."""
        v = older.get(step)
        if v is None:
            try:
                v = older[step] = self.ctx.catalog.versions.read_version(step)
            except (VersionNotFound, CatalogError) as exc:
                raise _Fallback(f"step {step} of the chain cannot be read ({exc})") from None
        p = v.pieces.get(rank)
        if p is None:
            raise _Fallback(f"step {step} has no piece of rank {rank}")
        return p

    def _plan(self, version: Version, dests: list[Entry]) -> DeltaPlan:
        key = (version.layout_key, self.batches.buffers.fingerprint)
        if key not in self._plans:
            group = self.batches.groups(version).get(PUBLISHERS)
            plan = None if group is None else plan_delta(group, version.layouts, dests, self.ctx.rotation)
            self._plans[key] = plan
            while len(self._plans) > _PLANS:
                self._plans.pop(next(iter(self._plans)))
        plan = self._plans[key]
        if plan is None:
            raise _Fallback("the buffers are not all served by the publishers' staged shards")
        return plan

    # ---- reading ---------------------------------------------------------------------------

    def _peers(self, version: Version) -> dict[int, int]:
        """Per rank, the transport's index of its endpoint (connected if not yet)."""
        out = {}
        for r, lay in version.layouts.items():
            peer = publisher_peer(r, lay)
            self.links.connect_peer(peer, lay)
            out[r] = self.ctx.transport.peer_index(peer)
        return out

    def _run(
        self, version: Version, dests: list[Entry], plan: DeltaPlan, chains: dict[int, list[Link]]
    ) -> Outcome:
        peers = self._peers(version)
        for r, links in chains.items():
            rp = plan.ranks[r]
            for ln in links:
                if ln.delta.tiles != int(rp.first[-1]):
                    self._bad(
                        version, r, ln, f"it lists {ln.delta.tiles} tiles, its layout has {int(rp.first[-1])}"
                    )
        index_bytes = self._read_rows(plan, chains, peers)
        reads = Reads()
        for r, links in chains.items():
            bad = self._changes(plan, r, links, peers[r], reads)
            if bad is not None:
                # Rows that make no sense: an older slot reused since (not a bad record), or one.
                torn, older = self._words(chains, peers)
                if not torn:
                    return Outcome(torn=True, sources=frozenset(chains))
                if not older:
                    raise _Fallback("an older version of the chain was overwritten during the read")
                self._bad(version, r, bad[0], bad[1])
        moved = index_bytes + reads.nbytes
        if moved >= plan.whole_bytes:
            raise _Fallback(
                f"the changes ({moved} bytes) are not smaller than the buffers ({plan.whole_bytes})"
            )
        room = self._take_scratch(reads.nbytes)
        try:
            reads.run(self.ctx.transport, self.ctx.options.read_timeout, room[: max(reads.nbytes, 1)])
            words = self._words(chains, peers)
            if not words[0]:
                return Outcome(torn=True, sources=frozenset(chains))
            if not words[1]:
                raise _Fallback("an older version of the chain was overwritten during the read")
            applied = self._apply(dests, plan, chains, reads)
        finally:  # kept for the next pull while it is small next to the buffers
            if len(room) <= plan.whole_bytes // 8:
                self._scratch = room
        if self.ctx.options.verify:
            self.verify(_Check(version.step, plan, {r: links[-1].rows for r, links in chains.items()}), dests)
        work = Work(
            np.zeros((0, 5), dtype=np.int64),
            [],
            frozenset(chains),
            moved,
            reads.count + plan_rows(plan, chains),
        )
        return Outcome(done=True, sources=frozenset(chains), work=work, elements=applied)

    def _take_scratch(self, nbytes: int) -> np.ndarray:
        """Room for ``nbytes`` of changes: the kept scratch when it is large enough (taken: a pull
        running beside this one gets its own), else a new one, a quarter larger."""
        room, self._scratch = self._scratch, None
        if room is not None and len(room) >= max(nbytes, 1):
            return room
        return np.empty(max(nbytes, 1) + nbytes // 4, dtype=np.uint8)

    def _read_rows(self, plan: DeltaPlan, chains: dict[int, list[Link]], peers: dict[int, int]) -> int:
        """Phase 1: every link's index rows of the needed tiles (into each link's ``rows``)."""
        ops_all = []
        for r, links in chains.items():
            rp = plan.ranks[r]
            for ln in links:
                ln.rows = np.zeros((len(rp.need), 4), dtype=np.uint64)
                if not len(rp.runs):
                    continue
                ops = make_ops(len(rp.runs))
                ops[:, 0] = peers[r]
                ops[:, 1] = ln.delta.region
                ops[:, 2] = ln.delta.index_offset + rp.runs[:, 0] * fmt.ROW_BYTES
                ops[:, 3] = ln.rows.ctypes.data + rp.runs[:, 2] * fmt.ROW_BYTES
                ops[:, 4] = rp.runs[:, 1] * fmt.ROW_BYTES
                ops_all.append(ops)
        if not ops_all:
            return 0
        ops = np.concatenate(ops_all)
        _get(self.ctx, ops)
        return int(ops[:, 4].sum())

    def _changes(
        self, plan: DeltaPlan, r: int, links: list[Link], peer: int, reads: Reads
    ) -> tuple[Link, str] | None:
        """Phase 2's reads of one rank: each link's encoded tiles, and the raw tiles from N;
        (the link, what is wrong) when some index row makes no sense (nothing is read then)."""
        rp = plan.ranks[r]
        tile_elems = rp.need_elems
        raw = np.zeros(len(rp.need), dtype=bool)
        for ln in links:
            enc, count, begin, end = fields(ln.rows)
            bad = (enc > fmt.ENC_RAW) | (count > tile_elems) | (end < begin)
            bad |= (enc == fmt.ENC_NONE) & (count != 0)
            bad |= ((enc == fmt.ENC_RAW) | (enc == fmt.ENC_NONE)) & (end != begin)
            coded = (enc == fmt.ENC_VARINT) | (enc == fmt.ENC_BITMAP)
            lo, hi = ln.delta.data_offset, ln.delta.data_offset + ln.delta.data_bytes
            bad |= coded & ((begin < lo) | (end > hi) | (end == begin) | (count == 0))
            if bad.any():
                return ln, f"{int(bad.sum())} malformed index rows"
            raw |= enc == fmt.ENC_RAW
        for li, ln in enumerate(links):
            enc, count, begin, end = fields(ln.rows)
            take = ~raw & (count > 0)
            reads.coded(r, li, peer, ln.delta.region, np.flatnonzero(take), begin, end)
        final = links[-1]
        for k in np.flatnonzero(raw[rp.jt_pos]).tolist():
            j = int(rp.jt_job[k])
            job = plan.jobs[j]
            s = rp.shards[job.shard]
            at = final.base_offset + s.byte_offset
            reads.raw(j, int(rp.jt_tile[k]), peer, s.region, at, job, rp.tilings[job.shard])
        return None

    def _bad(self, version: Version, r: int, ln: Link, why: str) -> None:
        """A change map that contradicts its layout or itself: skipped and counted like a bad
        record, and the pull goes whole."""
        key = self.ctx.catalog.client.key(
            "versions", "%020d" % ln.step, "deltas", "%020d" % version.epoch, "%020d" % r
        )
        self.ctx.catalog.versions.skips(key, f"change map: {why}")
        raise _Fallback(f"rank {r}'s change map of step {ln.step}: {why}")

    def _words(self, chains: dict[int, list[Link]], peers: dict[int, int]) -> tuple[bool, bool]:
        """(N's words unchanged, every older link's words unchanged), read after the changes."""
        items = [(r, i == len(links) - 1, ln) for r, links in chains.items() for i, ln in enumerate(links)]
        got = np.zeros(len(items), dtype=np.uint64)
        ops = make_ops(len(items))
        for i, (r, _last, ln) in enumerate(items):
            ops[i] = (peers[r], ln.word[0], ln.word[1], got.ctypes.data + 8 * i, 8)
        try:
            _get(self.ctx, ops)
        except TransportError:
            return True, False  # cannot tell: whole (the whole pull asks etcd)
        want = np.array([ln.word[2] for _r, _l, ln in items], dtype=np.uint64)
        ok = got == want
        last = np.array([is_last for _r, is_last, _ln in items], dtype=bool)
        return bool(ok[last].all()), bool(ok[~last].all())

    # ---- verification ----------------------------------------------------------------------

    def verify_rows(self, version: Version, dests: list[Entry]) -> _Check | None:
        """Before a whole pull with ``verify``: the index rows (with the digests) of the tiles
        the buffers need, read from N's slots (the pull's step-word check then covers them too);
        None when some rank recorded no change map (nothing to verify against)."""
        if version.missing or any(p.delta is None for p in version.pieces.values()):
            return None
        try:
            plan = self._plan(version, dests)
            chains = {
                r: [Link(version.step, p.delta, p.base_offset, p.step_word or (0, 0, 0))]
                for r, p in version.pieces.items()
                if p.delta is not None
            }
            if any(c[0].delta.tiles != int(plan.ranks[r].first[-1]) for r, c in chains.items()):
                return None
            self._read_rows(plan, chains, self._peers(version))
        except (_Fallback, TransportError):
            return None
        return _Check(version.step, plan, {r: c[0].rows for r, c in chains.items()})

    def verify(self, check: _Check, dests: list[Entry]) -> None:
        """Digest every tile the buffers hold whole, in the published dtype on the host, and
        compare with the publisher's; count the others as unverified.

        Raises:
            DeltaMismatch: naming the tensors whose tiles differ (the buffers are forgotten:
                the next pull into them is whole).
        """
        plan = check.plan
        ids, want, names, unverified = [], [], [], 0
        for j, job in enumerate(plan.jobs):
            unverified += len(job.tiles) - (len(job.within) if job.native else 0)
            if not job.native or not len(job.within):
                continue
            rp = plan.ranks[job.rank]
            pos = np.searchsorted(rp.need, rp.first[job.shard] + job.within)
            expect = check.rows[job.rank][pos, 3]
            known = expect != 0
            unverified += int((~known).sum())
            ids.append(np.stack([np.full(int(known.sum()), j, np.int64), job.within[known]], axis=1))
            want.append(expect[known])
            names.extend([job.name] * int(known.sum()))
        stats = self.ctx.stats
        stats.unverified_tiles += unverified
        if not ids or not hashing():
            stats.unverified_tiles += sum(len(w) for w in want)
            return
        tiles = np.ascontiguousarray(np.concatenate(ids))
        got = np.zeros(len(tiles), dtype=np.uint64)
        native().digest(plan.geoms, tiles, got, threads=threads())
        stats.verified_tiles += len(tiles)
        bad = np.flatnonzero(got != np.concatenate(want))
        if len(bad):
            self.forget()
            which = sorted({names[i] for i in bad.tolist()})
            raise DeltaMismatch(
                f"step {check.step}: {len(bad)} tiles of {len(which)} tensors differ from the digests "
                f"their publishers recorded: {', '.join(repr(n) for n in which[:8])}"
                f"{', ...' if len(which) > 8 else ''} (a buffer written behind the store's back?); "
                "the next pull into these buffers moves every byte",
                step=check.step,
                tensors=tuple(which),
            )

    # ---- applying --------------------------------------------------------------------------

    def _apply(self, dests: list[Entry], plan: DeltaPlan, chains: dict[int, list[Link]], reads: Reads) -> int:
        """Check every tile (pass A: the offsets of every element), then write the links oldest
        first, then the raw tiles (pass B, and torch for converted or device buffers)."""
        depth = max(len(links) for links in chains.values())
        steps = [reads.tiles(plan, chains, li) for li in range(depth)] + [reads.raw_tiles(plan)]
        applied = 0
        for tiles, _outs in steps:
            if not len(tiles):
                continue
            bad, inside = native().decode(plan.geoms, tiles, threads=threads(), check=1)
            if bad >= 0:  # read untorn (the words said so): the change map itself is wrong
                self.ctx.catalog.versions.skips(
                    f"change map of step {version_step(chains)}", "malformed tiles"
                )
                raise _Fallback("a change map's encoded tiles are malformed")
            applied += inside
        with torch.no_grad():
            for tiles, outs in steps:
                if len(tiles):
                    native().decode(plan.geoms, tiles, threads=threads(), check=0)
                    convert(dests, plan, outs)
        return applied


def expected_bytes(plan: DeltaPlan, chains: dict[int, list[Link]]) -> int:
    """What the pull would move, from the records alone (before any read): per link, the index rows
    of the tiles the buffers need and its encoded changes in the share of its tiles they need (raw
    tiles, read from N's slot, are not counted)."""
    n = 0
    for r, links in chains.items():
        rp = plan.ranks[r]
        need = len(rp.need)
        share = need / max(int(rp.first[-1]), 1)
        n += sum(need * fmt.ROW_BYTES + int(ln.delta.data_bytes * share) for ln in links)
    return n


def version_step(chains: dict[int, list[Link]]) -> int:
    return max(links[-1].step for links in chains.values())


def plan_rows(plan: DeltaPlan, chains: dict[int, list[Link]]) -> int:
    """Transport reads of phase 1."""
    return sum(len(plan.ranks[r].runs) * len(links) for r, links in chains.items())


def _get(ctx: StoreContext, ops: np.ndarray) -> None:
    if len(ops):
        ctx.transport.get(ops, timeout=ctx.options.read_timeout)
