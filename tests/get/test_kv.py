"""The key-value surface (get/kv.py): ``keys`` lists a committed version from its manifests and
``get`` allocates whole tensors and fills them with one ``get_into``.

One process, real etcd, real stores: a publisher store puts, a consumer store reads. The
shape-change retries are driven by the publisher putting a new version at the exact moment
between ``get``'s listing and its pull (``get_into`` is the hook kv.get calls there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from astate_store import Shard
from astate_store.errors import LayoutError, VersionNotFound, WaitTimeout
from astate_store.get import kv
from astate_store.get.kv import KeyInfo
from astate_store.store import Store
from tests.support.data import value


class _Hooked:
    """``kv.get``'s consumer with a hook between the listing and the first pull: there the hook
    puts a newer version, and the read ``get`` began is given up, as when its version is retired
    under it (the first pull then asks for the newest version, as a retry does)."""

    def __init__(self, cons: Store, hook: Callable[[], object]):
        self.cons, self.hook, self.pulls = cons, hook, []
        self.begin, self.end = cons._consumer.begin, cons._consumer.end

    def get_into(
        self, bufs: Mapping[str, torch.Tensor], step: int, timeout: float | None, progress: Any, *, begun: Any
    ) -> int:
        self.pulls.append(step)
        if len(self.pulls) == 1:
            self.hook()
            self.end(step)
            return self.cons.get_into(bufs, step=step, timeout=timeout)
        return self.cons._consumer.get_into(bufs, step, timeout, progress, begun=begun)


SPEC = {"a.w": ((4, 6), "float32"), "b": ((10,), "bfloat16"), "c": ((3, 2, 2), "int64")}


def _tensors(step: int, spec: Mapping[str, tuple[tuple[int, ...], str]] = SPEC) -> dict[str, torch.Tensor]:
    return {n: value(n, s, dt, step) for n, (s, dt) in spec.items()}


OPTIONS = {"retire_timeout": 5.0, "read_timeout": 60.0}


@pytest.fixture
def pub(store_factory: Callable[..., Store]) -> Store:
    return store_factory(**OPTIONS)


@pytest.fixture
def cons(store_factory: Callable[..., Store], pub: Store) -> Store:
    return store_factory(**OPTIONS)


def test_keys_list_the_newest_or_a_named_version(pub: Store, cons: Store) -> None:
    assert cons.keys() == {}
    pub.put(1, _tensors(1))
    pub.put(2, _tensors(2, {**SPEC, "d": ((5,), "float16")}))
    want = {
        "a.w": KeyInfo((4, 6), "float32", 96),
        "b": KeyInfo((10,), "bfloat16", 20),
        "c": KeyInfo((3, 2, 2), "int64", 96),
    }
    assert cons.keys(1) == want
    newest = cons.keys()
    assert list(newest) == ["a.w", "b", "c", "d"]  # sorted by name
    assert newest == {**want, "d": KeyInfo((5,), "float16", 10)}
    with pytest.raises(VersionNotFound):
        cons.keys(7)
    with pytest.raises(LayoutError):
        cons.keys(-1)


def test_keys_merge_the_ranks_shards_and_outlive_the_writers(
    store_factory: Callable[..., Store], cons: Store
) -> None:
    whole = value("w", (8, 3), "float32", 4)
    r0 = store_factory(rank=0, world_size=2, session_id="kv", **OPTIONS)
    r1 = store_factory(rank=1, world_size=2, session_id="kv", **OPTIONS)
    assert r0.put(4, {"w": Shard(whole[:5], (0, 0), (8, 3))}) is False
    assert r1.put(4, {"w": Shard(whole[5:], (5, 0), (8, 3))}) is True
    assert cons.keys() == {"w": KeyInfo((8, 3), "float32", 96)}
    r1.close()
    r0.close()
    # Both writers are gone: the manifests still describe the version.
    assert cons.keys(4) == {"w": KeyInfo((8, 3), "float32", 96)}


def test_get_allocates_whole_tensors_of_one_step(pub: Store, cons: Store) -> None:
    pub.put(3, _tensors(3))
    step, got = cons.get(timeout=30)
    assert step == 3 and list(got) == ["a.w", "b", "c"]
    for n, t in got.items():
        assert t.device.type == "cpu"
        assert t.dtype == getattr(torch, SPEC[n][1]) and torch.equal(t, value(n, *SPEC[n], 3)), n
    step, one = cons.get("b", timeout=30)
    assert step == 3 and list(one) == ["b"] and torch.equal(one["b"], value("b", *SPEC["b"], 3))
    step, two = cons.get(["c", "a.w", "c"], timeout=30)  # duplicates collapse; the order given is kept
    assert list(two) == ["c", "a.w"]
    assert torch.equal(two["a.w"], value("a.w", *SPEC["a.w"], 3))


def test_get_names_what_it_cannot_fetch(pub: Store, cons: Store) -> None:
    pub.put(1, _tensors(1))
    with pytest.raises(
        LayoutError, match=r"tensors \['x', 'y'\] are not in step 1's published tensors \(a.w, b, c\)"
    ):
        cons.get(["a.w", "x", "y"], timeout=30)
    with pytest.raises(LayoutError, match="must be None, a name or names, got int"):
        cons.get(5, timeout=30)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="names are strings"):
        cons.get(["a.w", 3], timeout=30)  # type: ignore[list-item]
    with pytest.raises(WaitTimeout):
        cons.get(step=2, timeout=0.5)


def test_get_lists_again_when_the_shapes_change_under_it(pub: Store, cons: Store) -> None:
    pub.put(1, _tensors(1))
    grown = {"a.w": ((6, 6), "float32"), "b": ((10,), "bfloat16")}
    reads = _Hooked(cons, lambda: pub.put(2, _tensors(2, grown)))  # after the listing of step 1
    pulls = reads.pulls
    step, got = kv.get(cons.catalog, reads, timeout=30)
    # The pull of step 1's shapes found step 2 newest and refused; get listed step 2 and pulled it.
    assert pulls == [1, 2] and step == 2
    assert list(got) == ["a.w", "b"] and got["a.w"].shape == (6, 6)
    for n, t in got.items():
        assert torch.equal(t, value(n, *grown[n], 2)), n


def test_get_allocates_again_when_a_newer_version_changed_dtypes(pub: Store, cons: Store) -> None:
    pub.put(1, _tensors(1))
    recast = {"a.w": ((4, 6), "bfloat16"), "b": ((10,), "bfloat16"), "c": ((3, 2, 2), "int64")}
    reads = _Hooked(cons, lambda: pub.put(2, _tensors(2, recast)))  # same shapes, a.w now bfloat16
    pulls = reads.pulls
    step, got = kv.get(cons.catalog, reads, timeout=30)
    # The first pull converted step 2 into float32 buffers; get does not return converted
    # tensors as the published ones: it allocates bfloat16 and pulls again.
    assert step == 2 and pulls == [1, 2]
    assert got["a.w"].dtype == torch.bfloat16
    for n, t in got.items():
        assert torch.equal(t, value(n, *recast[n], 2)), n


def test_a_one_shot_get_is_three_etcd_requests_and_one_in_the_background(pub: Store, cons: Store) -> None:
    """A store that opens, gets once and closes (an agent session resuming): the newest step, the
    begun read (commit, live ranks, reader and consumer records in one transaction), the manifests
    and layouts together (with the meta records of a version of a few ranks); and the grant of the
    store's reader lease (a session hub's stores share one). The source's step word proved the
    bytes untorn, so the end of the read (unregister, delivered) runs in the background. Its meta
    then costs no request."""
    pub.put(1, _tensors(1), meta={"turn": 1})
    before, bg = cons.stats.etcd_rpcs, cons.stats.etcd_background_rpcs
    step, got = cons.get(timeout=30)
    assert step == 1 and all(torch.equal(got[n], t) for n, t in _tensors(1).items())
    assert cons.stats.etcd_rpcs - before == 3 + 1
    assert cons.meta(1) == {"turn": 1}
    assert cons.stats.etcd_rpcs - before == 3 + 1
    assert cons.catalog.readers.flush_ends()
    assert cons.stats.etcd_background_rpcs - bg >= 1  # the end (and any retention pass)
    assert not pub.catalog.client.raw.get_prefix_response(pub.catalog.client.key("readers", "")).kvs
    # the consumer registered in the begun read's transaction: a draining publisher counts it
    assert cons.catalog.consumers.pending(cons.consumer_id) is None


def test_meta_read_with_a_small_versions_layouts_is_checked_like_any_record(pub: Store, cons: Store) -> None:
    """``get`` reads a small version's meta records with its layouts; a bad one there is skipped
    and counted, and ``meta`` then reads the record itself and raises, as without the shortcut."""
    from astate_store.catalog.records import pad20
    from astate_store.errors import CatalogCorrupted
    from astate_store.model import codec

    pub.put(1, _tensors(1), meta={"turn": 1})
    epoch = pub.catalog.session.epoch
    raw, key = pub.catalog.client.raw, pub.catalog.client.key
    # another rank's record under rank 5's key (the version has 1 rank: nobody reads rank 5)
    raw.put(
        key("meta", pad20(1), pad20(epoch), pad20(5)),
        codec.encode("meta", {"step": 1, "epoch": epoch, "rank": 3, "data": b"\x80"}),
    )
    skipped = cons.stats.bad_records
    assert cons.get(timeout=30)[0] == 1
    assert cons.stats.bad_records == skipped + 1
    before = cons.stats.etcd_rpcs
    assert cons.meta(1) == {"turn": 1}  # read again (one request: the epoch is known)
    assert cons.stats.etcd_rpcs == before + 1
    with pytest.raises(CatalogCorrupted, match="another version or rank"):
        cons.meta(1, rank=5)
