"""Step words, the pull's side: after a copy, one small read tells whether its bytes are untorn.

A publisher's staging slot has a step word (``put/staging.py``): the token its piece record
names while the slot holds that step's bytes, zeroed before any of them changes. Tokens are
unique per fill, so a word read *after* the copy that still holds the token proves no byte of
the slot changed since the step was committed, hence none during the copy: what ``end_read``'s
etcd transaction (no torn marker of these sources) proves, without the round trip.

Call sequence (``Consumer._read_once``):
  1. ``Readers.begin_read`` registers the reader and reads the version with its pieces' words;
  2. the pull copies every byte from its sources;
  3. :meth:`StepWords.check` reads the sources' words in one transport ``get``:
     - every token there: untorn; the reader unregisters in the background
       (``Readers.end_read_later``), off the pull's path;
     - any other value: torn, the bytes are discarded (as for a torn marker);
     - None (a source without a word: a re-serving consumer, a device pool, a piece published
       in place; or the word could not be read): ``end_read`` asks etcd, as before.
"""

from __future__ import annotations

import numpy as np

from astate_store.catalog import Version
from astate_store.errors import TransportError
from astate_store.get.sources import publisher_peer
from astate_store.transport import Transport
from astate_store.transport.base import OP_LENGTH, OP_LOCAL, OP_OFFSET, OP_PEER, OP_REGION, make_ops

__all__ = ["StepWords"]

_WORD = 8  # bytes of a step word


class StepWords:
    """One consumer's reads of its sources' step words (a buffer reused pull after pull)."""

    def __init__(self) -> None:
        self._buf = np.zeros(0, dtype=np.uint64)  # where the words land, one per source

    def check(
        self, transport: Transport, version: Version, sources: frozenset[object], timeout: float | None
    ) -> bool | None:
        """True when every source's word still holds its piece's token, False when one does not
        (torn), None when the words cannot tell (see the module docstring)."""
        if not sources:
            return None
        words = []
        for src in sources:
            piece = version.pieces.get(src) if isinstance(src, int) else None
            lay = version.layouts.get(src) if piece is not None else None
            if piece is None or piece.step_word is None or lay is None:
                return None
            words.append((publisher_peer(src, lay), *piece.step_word))
        n = len(words)
        if len(self._buf) < n:
            self._buf = np.zeros(n, dtype=np.uint64)
        got = self._buf[:n]
        got[:] = 0
        try:
            ops = make_ops(n)
            ops[:, OP_PEER] = [transport.peer_index(peer) for peer, *_ in words]
            ops[:, OP_REGION] = [region for _p, region, _o, _t in words]
            ops[:, OP_OFFSET] = [offset for _p, _r, offset, _t in words]
            ops[:, OP_LOCAL] = got.ctypes.data + _WORD * np.arange(n, dtype=np.uint64)
            ops[:, OP_LENGTH] = _WORD
            transport.get(ops, timeout=timeout)
        except (TransportError, KeyError):  # a source disconnected since: let etcd decide
            return None
        want = np.fromiter((token for *_, token in words), dtype=np.uint64, count=n)
        return bool(np.array_equal(got, want))
