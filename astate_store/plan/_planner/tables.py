"""The planner's output tables: one declared, frozen record that ``planner._assemble`` builds and
that ``materialize`` (one consumer's reads) and ``packing`` (pre-pack items) read.

Indices used below:

- *instance* (``pi_*``): one (consumer, piece) pair; the unit that is given one source replica.
- *piece* (``P_*``): one destination box intersected with one distinct publisher box.
- *row* (``row_*``): one destination record of a distinct request sequence.
- *record* (``rec_*``): one source record (a layout shard, or a packed copy appended after them).
- *consumer*: the index of a consumer id in ``consumers`` (``cindex`` maps id -> index).

Arrays are numpy and never written after assembly; the dataclass is frozen so that the plan,
shared by callers and caches, cannot be edited field by field.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from astate_store.plan._planner.templates import Templates


@dataclass(frozen=True, eq=False)
class PlanTables:
    """Compact reads of every consumer plus the totals computed without materializing a read."""

    # -- consumers ---------------------------------------------------------------------------
    #: consumer ids in plan order (sorted); index ``c`` below refers to ``consumers[c]``
    consumers: tuple
    #: consumer id -> index into ``consumers``
    cindex: dict[Hashable, int]
    #: per consumer, the stagger index: its read order over links starts at link ``stagger % n_links``
    stagger: np.ndarray
    #: instance ids grouped by consumer: ``perm[cstart[c]:cstart[c + 1]]`` are consumer ``c``'s
    perm: np.ndarray
    #: per consumer plus one, the start of its slice of ``perm`` (``cstart[-1]`` = instance count)
    cstart: np.ndarray

    # -- totals (exact, no read materialized) ------------------------------------------------
    #: per consumer, the number of reads it will issue (merged-away tails excluded)
    read_counts: np.ndarray
    #: per consumer, the source bytes it reads
    dst_bytes: np.ndarray
    #: per source link (a rank, or a shared (host, NIC)), the bytes read over it
    link_bytes: np.ndarray
    #: publisher ranks that serve at least one byte (sorted)
    src_ranks: np.ndarray
    #: bytes served by each of ``src_ranks``
    src_rank_bytes: np.ndarray

    # -- instances ---------------------------------------------------------------------------
    #: per instance, its consumer index
    pi_c: np.ndarray
    #: per instance, its piece
    pi_P: np.ndarray
    #: per instance, the source record it reads (after balancing and packed overrides)
    pi_src: np.ndarray
    #: per instance, its run template id in ``tmpl`` (from the chosen source's strides)
    pi_tm: np.ndarray
    #: per instance, the source byte offset of its first run inside the source region
    pi_sbase: np.ndarray
    #: per instance, the bytes of each run (widened for the head of a merged group)
    pi_mlen: np.ndarray
    #: per instance, merged into the preceding instance's read (issues no read of its own)
    pi_tail: np.ndarray
    #: per instance, worth a contiguous packed copy on its publisher (``CostModel``)
    pi_pack: np.ndarray
    #: per instance, the piece's bytes
    pi_bytes: np.ndarray

    # -- pieces ------------------------------------------------------------------------------
    #: per piece, the destination row (request record) it lands in
    P_row: np.ndarray
    #: per piece, the tensor index into the plan's tensor names
    P_t: np.ndarray
    #: per piece, the global lower corner of its box (``D`` columns, left padded with 0)
    P_lo: np.ndarray
    #: per piece, the sizes of its box (``D`` columns, left padded with 1)
    P_sz: np.ndarray
    #: per piece, the destination byte offset of its first element inside the destination region
    P_dbase: np.ndarray

    # -- destination rows --------------------------------------------------------------------
    #: per row, the consumer's buffer id (the read's ``dst_region``)
    row_region: np.ndarray
    #: per row, its position in the consumer's request sequence (the read's ``dst_index``)
    row_index: np.ndarray
    #: per row, the dtype code of the source tensor
    row_scode: np.ndarray
    #: per row, the dtype code of the destination buffer (differs from ``row_scode``: convert)
    row_code: np.ndarray

    # -- source records ----------------------------------------------------------------------
    #: per record, its publisher rank
    rec_rank: np.ndarray
    #: per record, its memory region id on that rank
    rec_region: np.ndarray
    #: per record, the source link its bytes travel over
    rec_link: np.ndarray
    #: per record, the ``ShardRecord`` itself (for pack items)
    rec_obj: list

    # -- geometry ----------------------------------------------------------------------------
    #: the box rank every piece is padded to (the largest tensor rank)
    D: int
    #: the number of source links
    n_links: int
    #: run templates shared by all instances of equal geometry
    tmpl: Templates
    #: per template, its run count
    T_n: np.ndarray
