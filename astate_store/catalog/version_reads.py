"""Reading committed versions (the consumer's side of ``catalog.versions``): commit and pieces
in one round trip, a rank's meta, manifests and layouts by their content-addressed keys, each
record checked against its schema and its key; a bad one is skipped and counted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pyetcd import transactions as tx

from astate_store.catalog.blobs import blob_from_kvs
from astate_store.catalog.records import Skips, Version, pad20, parse_pad20, version_from_kvs
from astate_store.catalog.shard_tables import Layout, Manifest, layout_from_record, manifest_from_record
from astate_store.errors import CatalogCorrupted, CatalogError, CodecError, VersionNotFound
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.model import codec
from astate_store.model.layout import check_step

__all__ = ["VersionReads"]

log = logging.getLogger("astate_store.catalog")

# Blob range reads per transaction: a response stays well inside the client's receive limit.
_BLOBS_PER_TXN = 16
_EPOCHS_KEPT = 64  # committing epochs of the steps read lately (read_meta's shortcut)


class VersionReads:
    """Reading committed versions: a step's commit and pieces, a rank's meta, the manifests and
    the live sources' layouts. Layouts and manifests are immutable and verified against the key
    they were read at, so they are cached by key for the life of the store."""

    def __init__(self, client: EtcdClient, skips: Skips):
        self.client, self.skips = client, skips
        # Layouts by the key they were read and verified at (layouts/<epoch>/<rank>/<id>, or
        # layouts/replicas/<member>/<id>): the id is the content's, epoch and rank (or the
        # member) are the key's, so a record naming a layout can only get the one at its own key.
        self._layouts: dict[str, Layout] = {}
        # by manifest id (verified: the id is the content's); the writer adds the ones it wrote
        self._manifests: dict[str, Manifest] = {}
        # (replica manifest id, publisher manifest ids) -> why the replica does not fit the version, or ""
        self._fits: dict[tuple[str, tuple[str, ...]], str] = {}
        # step -> its committing epoch, for the versions read lately (a commit record never changes):
        # read_meta then reads the meta record alone, one round trip instead of two
        self._epochs: dict[int, int] = {}
        self.metas = MetaCache(client.namespace)  # meta records read with a small version's layouts

    def read_version(self, step: int) -> Version:
        """Commit and pieces of a committed step, in one round trip (no reader registration).

        Raises:
            VersionNotFound: the step is not committed (or its metadata was dropped by retention).
            CatalogCorrupted: its commit record, or a piece of the committing session, is bad.
        """
        kvs, _ = self.client.get_prefix_rev(self.client.key("versions", pad20(step)) + "/")
        version = version_from_kvs(self.client.namespace, step, kvs, self.skips)
        self._remember(version)
        return version

    def _remember(self, version: Version) -> None:
        """Keep the committing epoch of a version read (``read_meta``'s shortcut)."""
        if len(self._epochs) >= _EPOCHS_KEPT:
            self._epochs.clear()  # bounded; plain dict operations, safe across the store's threads
        self._epochs[version.step] = version.epoch

    def read_meta(self, step: int, rank: int) -> bytes | None:
        """The meta bytes rank ``rank`` put with committed ``step`` (None: it gave none). Only the
        committing epoch's record counts: a fenced session's leftover is not this version's.

        Raises:
            VersionNotFound: the step is not committed (or retention dropped it).
            CatalogCorrupted: its commit or meta record is bad (skipped, counted and logged too).
        """
        c, step = self.client, check_step(step, CatalogError)
        epoch = self._epochs.get(step)
        known = None if epoch is None else self.metas.get(step, epoch, rank)
        if known is not None:  # read with the version's layouts
            return known[0]
        if epoch is not None:  # the commit read lately: its meta record alone
            got = self._meta_record(step, epoch, rank)
            if got is not None:
                return got
            # no record: no meta given, or the version dropped meanwhile; the commit tells which
        ckey = c.key("versions", pad20(step), "commit")
        raw, _m = c.call("get commit", lambda: c.raw.get(ckey))
        if raw is None:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed")
        commit = self._checked(ckey, lambda: codec.decode("commit", raw))
        return self._meta_record(step, commit["epoch"], rank)

    def _meta_record(self, step: int, epoch: int, rank: int) -> bytes | None:
        """The meta bytes of (step, epoch, rank), checked against their key; None: no record."""
        c = self.client
        mkey = c.key("meta", pad20(step), pad20(epoch), pad20(rank))
        value, _m = c.call("get meta", lambda: c.raw.get(mkey))
        if value is None:
            return None
        try:
            return meta_bytes(mkey, value, (step, epoch, rank))
        except CodecError as exc:
            self.skips(mkey, str(exc))
            raise CatalogCorrupted(
                f"namespace {c.namespace!r}: meta record {mkey}: {exc}", key=mkey
            ) from None

    def _checked(self, key: str, decode: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return decode()
        except CodecError as exc:
            self._skip(key, exc)
            raise CatalogCorrupted(
                f"namespace {self.client.namespace!r}: record {key} is corrupted: {exc}", key=key
            ) from None

    def _read_blobs(
        self, keys: Sequence[str], meta: tuple[int, int] | None = None
    ) -> dict[str, bytes | None]:
        """Blobs by key, ``_BLOBS_PER_TXN`` range reads per transaction; a bad one is None (skipped).
        ``meta``: (step, epoch) whose meta records the first transaction reads too (``MetaCache``)."""
        out: dict[str, bytes | None] = {}
        for i in range(0, len(keys), _BLOBS_PER_TXN):
            batch = keys[i : i + _BLOBS_PER_TXN]
            ops = [tx.Get(k, range_end(k)) for k in batch]
            with_meta = meta is not None and i == 0  # the first transaction reads them
            mpre = self.client.key("meta", *map(pad20, meta)) + "/" if meta is not None else ""
            if with_meta:
                ops.append(tx.Get(mpre, range_end(mpre)))
            _ok, resp = self.client.txn("get blobs", [], ops)
            if with_meta and meta is not None:
                self.metas.offer(meta, mpre, resp[-1], self.skips)
            for key, kvs in zip(batch, resp):
                try:
                    out[key] = blob_from_kvs(key, _checked_blob_kvs(key, kvs))
                except (CodecError, ValueError) as exc:  # ValueError: e.g. a key that is not UTF-8
                    self._skip(key, exc)
                    out[key] = None
        return out

    def _skip(self, key: str, exc: Exception) -> None:
        self.skips(key, str(exc))

    def manifests_of(self, version: Version) -> dict[int, Manifest]:
        """Every rank's manifest of a committed version (leaseless: whichever ranks are alive).

        Raises:
            CatalogError: a manifest the version names is missing or bad.
        """
        self._fetch_manifests(
            {p.manifest_id: self.client.key("manifests", p.manifest_id) for p in version.pieces.values()}
        )
        missing = sorted(r for r, p in version.pieces.items() if p.manifest_id not in self._manifests)
        if missing:
            raise CatalogError(
                f"namespace {self.client.namespace!r}: step {version.step}: manifests of ranks "
                f"{missing} are missing or bad"
            )
        return {r: self._manifests[p.manifest_id] for r, p in version.pieces.items()}

    def _fetch_manifests(
        self, want: Mapping[str, str], also: Sequence[str] = (), meta: tuple[int, int] | None = None
    ) -> dict[str, bytes | None]:
        """Read and cache the manifests of ``want`` (id -> key) not cached yet, with the blobs at
        ``also`` (and the ``meta`` records, see ``_read_blobs``) in the same transactions; returns
        those (key -> bytes, None when bad or absent)."""
        todo = {mid: key for mid, key in want.items() if mid not in self._manifests}
        blobs = self._read_blobs([*todo.values(), *also], meta) if todo or also else {}
        for key in todo.values():
            data = blobs.get(key)
            mid = key.rsplit("/", 1)[1]
            if data is not None:
                self._decode(
                    key,
                    lambda: self._manifests.__setitem__(
                        mid, manifest_from_record(codec.decode("manifest", data), mid)
                    ),
                )
        return blobs

    def _decode(self, key: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except CodecError as exc:
            self._skip(key, exc)

    def layouts_of(self, version: Version) -> Version:
        """The version with the layouts of its live sources (cached by key: layouts are immutable
        and verified against the key they were read at). A publisher whose layout lease expired
        (the rank died) — or whose layout is bad — is listed in ``missing``; a re-serving consumer
        that died, whose records are bad, or whose tensors are not the version's, is left out.
        Ranks ``version.missing`` already names (``begin_read`` found their member record gone)
        stay missing even when their layout is cached: a source whose lease ended is not dialled."""
        self._remember(version)  # read by begin_read: its meta is one request away too
        k = self.client.key
        manifests = {p.manifest_id: k("manifests", p.manifest_id) for p in version.pieces.values()}
        manifests.update(
            {
                rp.manifest_id: k("layouts", "replicas", m, rp.manifest_id)
                for m, rp in version.replicas.items()
            }
        )
        pkeys = {
            r: k("layouts", pad20(p.epoch), pad20(p.rank), p.layout_id) for r, p in version.pieces.items()
        }
        rkeys = {m: k("layouts", "replicas", m, rp.layout_id) for m, rp in version.replicas.items()}
        want: dict[str, tuple[str, int | None, int | None]] = {}  # layout key -> (manifest id, epoch, rank)
        for r, p in version.pieces.items():
            if pkeys[r] not in self._layouts and r not in version.missing:
                want[pkeys[r]] = (p.manifest_id, p.epoch, p.rank)
        for m, rp in version.replicas.items():
            if rkeys[m] not in self._layouts:
                want[rkeys[m]] = (rp.manifest_id, 0, 0)
        # Manifests and layouts in the same transactions (their keys are all in the version's
        # records): a first read of a version is one round trip, not two. Manifests decode first:
        # a layout is checked against its manifest.
        blobs = self._fetch_manifests(manifests, also=list(want), meta=self.metas.wanted(version))
        for key in want:
            data = blobs.get(key)
            mid, epoch, rank = want[key]
            if data is not None and mid in self._manifests:
                self._decode(key, lambda: self._cache_layout(key, data, self._manifests[mid], epoch, rank))
        layouts = {
            r: self._layouts[pkeys[r]]
            for r, p in version.pieces.items()
            if r not in version.missing and self._usable(pkeys[r], p.manifest_id)
        }
        pub = tuple(sorted({p.manifest_id for p in version.pieces.values()})) if version.replicas else ()
        rlayouts = {
            m: self._layouts[rkeys[m]]
            for m, rp in version.replicas.items()
            if self._usable(rkeys[m], rp.manifest_id) and self._replica_fits(pub, rkeys[m], rp.manifest_id)
        }
        missing = frozenset(r for r in version.pieces if r not in layouts)
        return Version(
            version.step,
            version.epoch,
            version.world_size,
            version.pieces,
            version.replicas,
            layouts,
            rlayouts,
            missing,
        )

    def _usable(self, key: str, manifest_id: str) -> bool:
        """Whether the layout read at ``key`` is cached and describes the manifest its record names."""
        lay = self._layouts.get(key)
        if lay is None:
            return False
        if lay.manifest_id != manifest_id:
            self.skips(
                key,
                f"the record naming this layout names manifest {manifest_id}, the layout {lay.manifest_id}",
            )
            return False
        return True

    def _replica_fits(self, pub: tuple[str, ...], key: str, manifest_id: str) -> bool:
        """Whether a re-serving consumer's tensors are tensors of the version (whose publishers'
        manifests are ``pub``), of the same global shapes (dtypes may differ: buffers pulled with a
        conversion). Skipped (counted) if not."""
        if any(mid not in self._manifests for mid in pub):
            return True  # the version's own tensors are unknown here: nothing to compare with
        why = self._fits.get((manifest_id, pub))
        if why is None:
            shapes: dict[str, tuple[int, ...]] = {}
            for mid in pub:
                shapes.update(_global_shapes(self._manifests[mid]))
            why = ""
            for name, shape in _global_shapes(self._manifests[manifest_id]).items():
                if shapes.get(name) != shape:
                    why = (
                        f"re-serves {name!r} of global shape {shape}, the version's is "
                        f"{shapes.get(name, 'absent')}"
                    )
                    break
            if len(self._fits) > 256:
                self._fits.clear()
            self._fits[(manifest_id, pub)] = why
        if why:
            self.skips(key, why)
        return not why

    def _cache_layout(
        self, key: str, data: bytes, manifest: Manifest, epoch: int | None, rank: int | None
    ) -> None:
        lid = key.rsplit("/", 1)[1]
        rec = codec.decode("layout", data)
        self._layouts[key] = layout_from_record(rec, manifest, key_id=lid, epoch=epoch, rank=rank)


def _global_shapes(m: Manifest) -> dict[str, tuple[int, ...]]:
    """Tensor name -> global shape of a manifest's shards."""
    st, gs = m.starts.tolist(), m.global_shapes.tolist()
    return {n: tuple(gs[st[i] : st[i + 1]]) for i, n in enumerate(m.names)}


def _checked_blob_kvs(key: str, kvs: Sequence[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    """The (value, meta) pairs of one blob range read, checked before they are put together: keys
    are UTF-8, and the head asks for no more chunks than are there (so a head claiming 10^15
    chunks is refused before anything is sized by it).

    Raises:
        CodecError: either does not hold.
    """
    chunks = 0
    for _v, meta in kvs:
        try:
            k = meta.key.decode()
        except UnicodeDecodeError:
            raise CodecError(f"blob {key}: a key under it is not UTF-8 ({bytes(meta.key)[:60]!r})") from None
        if k.startswith(key + "/"):
            chunks += 1
    head = next((v for v, meta in kvs if meta.key == key.encode()), None)
    if head is not None:
        n = codec.decode("blob", head)["chunks"]
        if n > chunks:
            raise CodecError(f"blob {key}: the head names {n} chunks, {chunks} are there")
    return list(kvs)


# Versions of at most this many ranks have their meta records read with their layouts.
_META_RANKS = 8
_METAS_KEPT = 64  # (step, epoch) entries of MetaCache


def meta_bytes(key: str, value: bytes, want: tuple[int, int, int]) -> bytes:
    """The user bytes of the meta record ``value`` read at ``key`` for (step, epoch, rank) ``want``.

    Raises:
        CodecError: the record fails its schema or names another step, epoch or rank.
    """
    rec = codec.decode("meta", value)
    if (rec["step"], rec["epoch"], rec["rank"]) != want:
        raise CodecError(
            f"names another version or rank: meta of step {rec['step']} epoch {rec['epoch']} rank "
            f"{rec['rank']} under this key"
        )
    return bytes(rec["data"])


class MetaCache:
    """The meta records of the small versions read lately (at most ``_META_RANKS`` ranks), read in
    the transaction that reads their layouts: a resuming session's ``meta`` after its ``get``
    costs no request. A record is immutable once written (its step, epoch and rank are in its
    key), so it is kept as read; a (step, epoch) with a bad record is not kept (``read_meta``
    then reads it and raises as before). Bounded; plain dict operations."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._known: dict[tuple[int, int], dict[int, bytes]] = {}  # (step, epoch) -> rank -> bytes

    def wanted(self, version: Version) -> tuple[int, int] | None:
        """(step, epoch) whose records to read with ``version``'s layouts, or None."""
        key = (version.step, version.epoch)
        return key if version.world_size <= _META_RANKS and key not in self._known else None

    def offer(
        self, key: tuple[int, int], prefix: str, kvs: Sequence[tuple[bytes, Any]], skips: Skips
    ) -> None:
        """Keep the records of (step, epoch) ``key`` read under ``prefix``, if all are good."""
        got: dict[int, bytes] = {}
        for value, meta in kvs:
            k = meta.key.decode("utf-8", "replace")
            rank = parse_pad20(k[len(prefix) :])
            try:
                if rank is None:
                    raise CodecError("not a meta key (meta/<step>/<epoch>/<rank>, 20 digits each)")
                got[rank] = meta_bytes(k, value, (*key, rank))
            except CodecError as exc:
                skips(k, str(exc))
                return
        if len(self._known) >= _METAS_KEPT:
            self._known.clear()
        self._known[key] = got

    def get(self, step: int, epoch: int, rank: int) -> tuple[bytes | None] | None:
        """(the meta bytes or None when the rank gave none,) if (step, epoch) was read; else None."""
        ranks = self._known.get((step, epoch))
        return None if ranks is None else (ranks.get(rank),)
