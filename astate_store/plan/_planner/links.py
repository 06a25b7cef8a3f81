"""Stage 4, links: map publisher records onto network links of the ``Fabric`` (a rank, or a
shared (host, NIC)) and, with placements on both sides, consumers and sources onto locality tiers.

Balancing and read order work per link, not per rank: ranks behind one NIC share its bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from astate_store.plan._planner.shards import Sources
from astate_store.plan.contracts import Fabric, Placement


@dataclass
class Links:
    """Link ids of source records and the locality inputs of the balancer."""

    n_links: int
    rec_link: np.ndarray  # source link of every source record
    ranks_all: np.ndarray  # sorted distinct publisher ranks
    use_topo: bool  # placements known on both sides: restrict candidates by tier
    tier: np.ndarray | None = None  # tier[consumer placement id, source placement id]
    rec_spl: np.ndarray | None = None  # source placement id of every record
    c_cpl: np.ndarray | None = None  # consumer placement id of every consumer


def _tier_matrix(cpl: list, spl: list) -> np.ndarray:
    """Locality tier (0 best) of every (consumer placement, source placement) pair; None = unknown."""
    m = np.full((max(len(cpl), 1), max(len(spl), 1)), 3, dtype=np.int8)
    for i, c in enumerate(cpl):
        if c is None:
            continue
        for j, s in enumerate(spl):
            if s is None:
                continue
            if c.host == s.host:
                close = (c.numa is not None and c.numa == s.numa) or (c.nic is not None and c.nic == s.nic)
                m[i, j] = 0 if close else 1
            else:
                m[i, j] = 2 if (c.nic is not None and c.nic == s.nic) else 3
    return m


def _source_links(src: Sources, splace: dict[int, Placement]) -> tuple[np.ndarray, int, np.ndarray]:
    """``(ranks_all, n_links, link per record)``: ranks sharing a named NIC on a
    host share one link, other ranks have their own."""
    ranks_all = np.unique(src.rec_rank) if len(src.rec_rank) else np.zeros(0, np.int64)
    link_of_key: dict = {}
    rank_link = {}
    for rk in ranks_all.tolist():
        pl = splace.get(rk)
        key = ("nic", pl.host, pl.nic) if (pl is not None and pl.nic is not None) else ("rank", rk)
        rank_link[rk] = link_of_key.setdefault(key, len(link_of_key))
    n_links = len(link_of_key)
    if len(ranks_all):
        lut = np.array([rank_link[r] for r in ranks_all.tolist()], np.int64)
        rec_link = lut[np.searchsorted(ranks_all, src.rec_rank)]
    else:
        rec_link = np.zeros(0, np.int64)
    return ranks_all, n_links, rec_link


def build_links(src: Sources, consumers: list, fabric: Fabric | None) -> Links:
    splace = fabric.source_map() if fabric is not None else {}
    cplace = fabric.consumer_map() if fabric is not None else {}
    ranks_all, n_links, rec_link = _source_links(src, splace)
    links = Links(
        n_links=n_links, rec_link=rec_link, ranks_all=ranks_all, use_topo=bool(splace) and bool(cplace)
    )
    if links.use_topo:
        # distinct placements get ids (0 = unknown); tiers are computed per placement pair
        spl_list = [None] + list({v: None for v in splace.values()})
        spl_id = {v: i for i, v in enumerate(spl_list) if v is not None}
        cpl_list = [None] + list({v: None for v in cplace.values()})
        cpl_id = {v: i for i, v in enumerate(cpl_list) if v is not None}
        links.tier = _tier_matrix(cpl_list, spl_list)
        rank_spl = {rk: spl_id.get(splace.get(rk), 0) for rk in ranks_all.tolist()}
        links.rec_spl = (
            np.array([rank_spl[r] for r in src.rec_rank.tolist()], np.int64)
            if len(src.rec_rank)
            else np.zeros(0, np.int64)
        )
        links.c_cpl = np.array([cpl_id.get(cplace.get(cid), 0) for cid in consumers], np.int64)
    return links
