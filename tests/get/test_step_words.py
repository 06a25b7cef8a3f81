"""Step words (put/staging.py, get/step_words.py) through real stores on real etcd: a pull from
staging slots proves its bytes untorn by reading the slots' words after its copy, so it ends its
read in the background; a changed slot is caught by its word alone; a source without a word is
decided by etcd as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from astate_store.catalog.records import pad20
from astate_store.store import Store
from tests.get.test_consumer import OPTIONS, _bufs, _holds, _tensors
from tests.support.data import value

Factory = Callable[..., Store]


def _keys(store: Store, *parts: str) -> list[str]:
    c = store.catalog.client
    kvs = c.raw.get_prefix_response(c.key(*parts) + "/").kvs
    return [kv.key.decode() for kv in kvs]


def test_a_pull_from_staging_slots_ends_its_read_in_the_background(transport_store_factory: Factory) -> None:
    pub = transport_store_factory(**OPTIONS)
    cons = transport_store_factory(**OPTIONS)
    bufs = _bufs()
    for step in (1, 2, 3, 4):  # steps 1-2 set up (the reader lease, the watch on latest)
        pub.put(step, _tensors(step))
        before = cons.stats.etcd_rpcs
        assert cons.get_into(bufs, step=step, timeout=30) == step and _holds(bufs, step)
        if step > 2:
            # a steady pull: begin_read only; the end (unregister, delivered) is off its path
            assert cons.stats.etcd_rpcs - before == 1, step
    assert cons.catalog.readers.flush_ends()
    assert _keys(cons, "readers", pad20(3)) == []
    assert _keys(cons, "delivered", pad20(3)) == [
        cons.catalog.client.key("delivered", pad20(3), cons.consumer_id)
    ]
    assert cons.stats.torn_retries == 0


def test_a_changed_slot_is_caught_by_its_step_word_alone(store_factory: Factory) -> None:
    pub, cons = store_factory(staging_depth=2, **OPTIONS), store_factory(**OPTIONS)
    pub.put(1, _tensors(1))
    pool = pub._publisher._pool
    assert pool is not None and pool.slot_step == [1, None]
    fired: list[int] = []

    def progress(done: int, total: int) -> None:
        # Step 1's bytes have landed. Its slot's word goes to 0, as a publisher's fill does before
        # it changes a byte, but no torn marker is written (etcd would call the read good), and
        # step 2 is published into the other slot.
        if total and done == total and not fired:
            fired.append(done)
            pool.clear_words()
            pub.put(2, _tensors(2))

    bufs = _bufs()
    got = cons.get_into(bufs, step=1, timeout=30, progress=progress)
    assert fired and got == 2 and _holds(bufs, 2)
    assert cons.stats.torn_retries == 1
    assert _keys(pub, "torn", pad20(1)) == []  # the word decided, not a marker


def test_a_source_without_a_step_word_is_decided_by_etcd(store_factory: Factory) -> None:
    pub, cons = store_factory(**OPTIONS), store_factory(**OPTIONS)
    bufs = _bufs()
    live = _tensors(1)  # a trainer's weights, changed in place between steps
    for step in (1, 2, 3, 4):
        for n, t in _tensors(step).items():
            live[n].copy_(t)
        pub.put(step, live, copy=False)  # in place: the caller's tensors, no slot, no word
        before = cons.stats.etcd_rpcs
        assert cons.get_into(bufs, step=step, timeout=30) == step and _holds(bufs, step)
        if step > 2:
            assert cons.stats.etcd_rpcs - before == 2, step  # begin_read and end_read, both on its path
            # ended on the pull's path: nothing registered when it returns
            assert _keys(cons, "readers", pad20(step)) == []
        pub.retire()


def test_reading_the_same_step_again_waits_for_the_queued_end(store_factory: Factory) -> None:
    pub, cons = store_factory(**OPTIONS), store_factory(**OPTIONS)
    pub.put(1, _tensors(1))
    first, second = _bufs(), _bufs()
    for _ in range(3):
        # the second read registers under the same key the first one's queued end deletes
        assert cons.get_into(first, step=1, timeout=30) == 1
        assert cons.get_into(second, step=1, timeout=30) == 1
    assert _holds(first, 1) and _holds(second, 1)
    assert cons.catalog.readers.flush_ends()
    assert _keys(cons, "readers", pad20(1)) == []
    assert cons.catalog.readers._ends.failed == 0


def test_every_fill_gets_a_fresh_token_and_a_new_layout_clears_them(store_factory: Factory) -> None:
    pub = store_factory(staging_depth=2, **OPTIONS)
    tokens = []
    for step in (1, 2, 3):
        pub.put(step, _tensors(step))
        pool = pub._publisher._pool
        assert pool is not None
        k = pool.slot_step.index(step)
        at = pool.word_offset(k)
        assert at is not None and pool.buffer is not None
        word = int(pool.buffer[at : at + 8].view(torch.int64)[0])
        assert word == pool.slot_token[k] > 0
        tokens.append(word)
    assert len(set(tokens)) == 3
    pub.put(4, {"w": value("w", (4, 4), "float32", 4)})  # a new layout: every slot retired, words zeroed
    pool = pub._publisher._pool
    assert pool is not None and pool.buffer is not None
    words = [
        int(pool.buffer[at : at + 8].view(torch.int64)[0]) for at in map(pool.word_offset, range(pool.depth))
    ]
    assert words == [pool.slot_token[0], 0] and pool.slot_token[0] not in tokens


def test_the_ends_of_many_stores_share_one_thread(store_factory: Factory) -> None:
    import threading

    pub = store_factory(**OPTIONS)
    readers = [store_factory(**OPTIONS) for _ in range(4)]
    pub.put(1, _tensors(1))
    for cons in readers:
        bufs = _bufs()
        assert cons.get_into(bufs, step=1, timeout=30) == 1 and _holds(bufs, 1)
    assert all(cons.catalog.readers.flush_ends() for cons in readers)
    # a session hub's thousands of stores must not mean thousands of threads
    assert [t.name for t in threading.enumerate()].count("astate-read-ends") == 1
    assert _keys(pub, "readers", pad20(1)) == []
    assert len(_keys(pub, "delivered", pad20(1))) == 4


def test_a_bad_step_word_is_never_taken_for_a_good_read(store_factory: Factory) -> None:
    """A piece's word comes from etcd: one naming no registered region, or bytes past its region,
    leaves the decision to etcd (None); a token the word does not hold is a torn read; a token out
    of range is reported, counted and ignored, the piece staying good."""
    from dataclasses import replace

    from astate_store.catalog.records import version_from_kvs
    from astate_store.get.step_words import StepWords
    from astate_store.model import codec

    pub, cons = store_factory(**OPTIONS), store_factory(**OPTIONS)
    pub.put(1, _tensors(1))
    bufs = _bufs()
    assert cons.get_into(bufs, step=1, timeout=30) == 1  # connects the publisher
    readers = cons.catalog.readers
    version = cons.catalog.versions.layouts_of(readers.begin_read(1, "probe"))
    try:
        region, offset, token = version.pieces[0].step_word  # type: ignore[misc]

        def with_word(word: tuple[int, int, int]) -> Any:
            return replace(version, pieces={0: replace(version.pieces[0], step_word=word)})

        words, tr = StepWords(), cons.transport
        assert words.check(tr, version, frozenset({0}), 30) is True
        assert words.check(tr, with_word((region + 1000, offset, token)), frozenset({0}), 30) is None
        assert words.check(tr, with_word((region, 1 << 60, token)), frozenset({0}), 30) is None
        assert words.check(tr, with_word((region, offset, token + 1)), frozenset({0}), 30) is False
        assert words.check(tr, version, frozenset({"r-someone"}), 30) is None  # a re-server has no word
    finally:
        readers.end_read(1, "probe")
    # a piece record whose token is out of range: reported and counted, the piece kept without a word
    c = pub.catalog.client
    kvs = c.raw.get_prefix_response(c.key("versions", pad20(1)) + "/").kvs
    pairs = []
    for kv in kvs:
        value = kv.value
        if b"pieces" in kv.key:
            rec = codec.decode("piece", value)
            rec["step_word"]["token"] = 1 << 60
            value = codec.encode("piece", rec)
        pairs.append((value, kv))
    skipped: list[str] = []
    got = version_from_kvs(c.namespace, 1, pairs, lambda key, why, rev=None: skipped.append(why))
    assert got.pieces[0].step_word is None and got.pieces[0].base_offset == version.pieces[0].base_offset
    assert len(skipped) == 1 and "2^53" in skipped[0]
