"""The read side of a restore: data files open for reading, planned reads grouped into strided copy
items, block verification, and running the items on worker threads.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from astate_store.checkpoint.checksum import Checksum
from astate_store.checkpoint.storage import Location
from astate_store.errors import CheckpointCorrupted
from astate_store.model.dtypes import DTYPE_NAMES, itemsize, torch_dtype

__all__ = ["DataFile", "CopyItem", "ReadContext", "progressions", "split_items", "run_items"]


class DataFile:
    """One data file of a checkpoint being restored: its shards (sorted by byte offset), their
    block checksums, and a way to read it (a private memory map for local files, ``read_at``
    through a pyarrow RandomAccessFile otherwise)."""

    def __init__(self, loc: Location, path: str, name: str, size: int):
        self.loc, self.path, self.name, self.size = loc, path, name, size
        self.starts = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.sum_base = np.zeros(0, np.int64)  #: index of each shard's first checksum in ReadContext.sums
        self.labels: list[str] = []
        self.verified: list[np.ndarray] = []  #: per shard, per block: verified (or claimed by a worker)
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        self.mv: memoryview | None = None
        self._remote: Any = None

    def open(self) -> None:
        if self.loc.local:
            if self.size == 0:
                self.tensor = torch.zeros(0, dtype=torch.uint8)
                self.mv = memoryview(b"")
                return
            with open(self.path, "rb") as f:
                # ACCESS_COPY: a private mapping, writable in memory (torch wants writable arrays);
                # nothing ever writes to it, so no page is copied and the file is never changed.
                self._mm = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)
            if hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                try:
                    self._mm.madvise(mmap.MADV_SEQUENTIAL)
                except OSError:
                    pass
            arr = np.frombuffer(self._mm, dtype=np.uint8)
            self.tensor = torch.from_numpy(arr)
            self.mv = memoryview(self._mm)
        else:
            self._remote = self.loc.fs.open_input_file(self.path)

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, memoryview]:
        """Bytes ``[lo, hi)`` as a writable uint8 tensor (remote files) plus a memoryview of them."""
        buf = self._remote.read_at(hi - lo, lo)
        if len(buf) != hi - lo:
            raise CheckpointCorrupted(
                f"data file {self.path} is short: wanted bytes [{lo}, {hi}), got {len(buf)}"
            )
        arr = np.frombuffer(buf, dtype=np.uint8).copy()
        return torch.from_numpy(arr), memoryview(arr)

    def close(self) -> None:
        self.tensor = None
        if self.mv is not None:
            self.mv.release()
            self.mv = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it
                pass
            self._mm = None
        if self._remote is not None:
            self._remote.close()
            self._remote = None

    def claim(self, shard: int, lo: int, hi: int) -> list[int]:
        """Blocks ``[lo, hi)`` of a shard not verified yet (marked as taken)."""
        with self._lock:
            v = self.verified[shard]
            todo = [int(b) for b in np.flatnonzero(~v[lo:hi]) + lo]
            v[todo] = True
        return todo


@dataclass
class CopyItem:
    """``n`` runs of ``length`` source bytes, the run ``j`` at source ``so + j * sdelta`` of file
    ``file`` going to destination ``do + j * ddelta`` of buffer ``dst`` (dtype codes ``sdt`` -> ``ddt``)."""

    file: int
    dst: int
    so: int  # source byte offset of the first run
    do: int  # destination byte offset of the first run
    n: int  # runs
    length: int  # source bytes per run
    sdelta: int
    ddelta: int
    sdt: int
    ddt: int


@dataclass
class ReadContext:
    """What every work item of one restore reads from: the files, the destination tensors (by
    request region) and the manifest's checksums (flat, indexed through ``DataFile.sum_base``)."""

    step: int
    files: list[DataFile | None]
    dests: list[torch.Tensor]
    sums: np.ndarray
    algo: Checksum
    block: int
    verify: bool
    done: Callable[[int], None] | None = None  #: told the source bytes of each finished item (progress)


def progressions(reads: np.ndarray) -> list[CopyItem]:
    """Group reads (sorted by file and source offset) into arithmetic progressions: runs of equal
    length whose source and destination offsets advance by constant steps. A column slice of a
    row-major shard becomes one strided copy instead of one copy per row."""
    n = len(reads)
    if n == 0:
        return []
    so = reads["src_offset"].astype(np.int64)
    do = reads["dst_offset"].astype(np.int64)
    ln = reads["length"].astype(np.int64)
    fr = reads["src_rank"].astype(np.int64)
    dr = reads["dst_region"].astype(np.int64)
    sd = reads["src_dtype"].astype(np.int64)
    dd = reads["dst_dtype"].astype(np.int64)
    if n == 1:
        return [
            CopyItem(
                int(fr[0]), int(dr[0]), int(so[0]), int(do[0]), 1, int(ln[0]), 0, 0, int(sd[0]), int(dd[0])
            )
        ]
    dso = np.diff(so)
    ddo = np.diff(do)
    # link i joins read i to read i + 1
    link = (
        (fr[1:] == fr[:-1])
        & (dr[1:] == dr[:-1])
        & (ln[1:] == ln[:-1])
        & (sd[1:] == sd[:-1])
        & (dd[1:] == dd[:-1])
        & (dso >= ln[:-1])
        & (ddo > 0)
    )
    # a new link group starts where a link is invalid or its deltas differ from the previous link
    same = np.zeros(n - 1, bool)
    same[1:] = link[1:] & link[:-1] & (dso[1:] == dso[:-1]) & (ddo[1:] == ddo[:-1])
    starts = np.flatnonzero(~same)
    ends = np.append(starts[1:], n - 1)  # link group g covers links [starts[g], ends[g])
    out: list[CopyItem] = []
    nxt = 0  # first read not yet assigned
    so_l, do_l, ln_l, fr_l, dr_l, sd_l, dd_l = (a.tolist() for a in (so, do, ln, fr, dr, sd, dd))
    dso_l, ddo_l, link_l = dso.tolist(), ddo.tolist(), link.tolist()

    def single(i: int) -> None:
        out.append(CopyItem(fr_l[i], dr_l[i], so_l[i], do_l[i], 1, ln_l[i], 0, 0, sd_l[i], dd_l[i]))

    for a, b in zip(starts.tolist(), ends.tolist()):
        if not link_l[a]:
            continue
        first = max(a, nxt)  # reads first..b are a progression when first < b
        while nxt < first:
            single(nxt)
            nxt += 1
        if first >= b + 1:
            continue
        cnt = b + 1 - first
        if cnt == 1:
            continue
        out.append(
            CopyItem(
                fr_l[first],
                dr_l[first],
                so_l[first],
                do_l[first],
                cnt,
                ln_l[first],
                dso_l[first],
                ddo_l[first],
                sd_l[first],
                dd_l[first],
            )
        )
        nxt = b + 1
    while nxt < n:
        single(nxt)
        nxt += 1
    return out


def split_items(items: list[CopyItem], item_bytes: int) -> list[CopyItem]:
    """Cut big progressions into work items of about ``item_bytes`` source bytes (element aligned)."""
    out = []
    for it in items:
        if it.n == 1 and it.length > item_bytes:
            sisz, disz = itemsize(DTYPE_NAMES[it.sdt]), itemsize(DTYPE_NAMES[it.ddt])
            step = max(sisz, item_bytes // sisz * sisz)
            for p in range(0, it.length, step):
                ln = min(step, it.length - p)
                out.append(
                    CopyItem(
                        it.file, it.dst, it.so + p, it.do + p // sisz * disz, 1, ln, 0, 0, it.sdt, it.ddt
                    )
                )
        elif it.n > 1 and it.n * max(it.sdelta, 1) > item_bytes:
            k = max(1, item_bytes // max(it.sdelta, 1))
            for j in range(0, it.n, k):
                m = min(k, it.n - j)
                out.append(
                    CopyItem(
                        it.file,
                        it.dst,
                        it.so + j * it.sdelta,
                        it.do + j * it.ddelta,
                        m,
                        it.length,
                        it.sdelta,
                        it.ddelta,
                        it.sdt,
                        it.ddt,
                    )
                )
        else:
            out.append(it)
    return out


def _touched(f: DataFile, it: CopyItem, block: int) -> list[tuple[int, int, int]]:
    """(shard, first block, end block) of every block an item reads."""
    hi_all = it.so + (it.n - 1) * it.sdelta + it.length
    if it.n == 1 or it.sdelta - it.length < block:
        spans = [(it.so, hi_all)]
    else:
        spans = [(it.so + j * it.sdelta, it.so + j * it.sdelta + it.length) for j in range(it.n)]
    out = []
    for lo, hi in spans:
        s = int(np.searchsorted(f.starts, lo, side="right")) - 1
        while s < len(f.starts) and f.starts[s] < hi:
            s0 = int(f.starts[s])
            s1 = s0 + int(f.lengths[s])
            a, b = max(lo, s0), min(hi, s1)
            if b > a:
                out.append((s, (a - s0) // block, (b - 1 - s0) // block + 1))
            s += 1
    return out


def _verify_blocks(
    ctx: ReadContext, f: DataFile, shard: int, blocks: Iterable[int], mv: memoryview, base: int
) -> None:
    """Check blocks of a shard; ``mv`` holds the file's bytes from offset ``base``."""
    s0 = int(f.starts[shard])
    n = int(f.lengths[shard])
    for k in blocks:
        a = s0 + k * ctx.block
        b = min(a + ctx.block, s0 + n)
        got = ctx.algo.digest(mv[a - base : b - base])
        want = int(ctx.sums[int(f.sum_base[shard]) + k])
        if got != want:
            raise CheckpointCorrupted(
                f"step {ctx.step}: tensor {f.labels[shard]} in file {f.path}: block {k} (bytes [{a}, {b})) "
                f"fails its checksum (stored {want:#x}, read {got:#x})"
            )


def _source_bytes(ctx: ReadContext, f: DataFile, it: CopyItem, hi: int) -> tuple[torch.Tensor, int]:
    """The bytes an item copies from, verified, and the file offset they start at.

    A local file is mapped whole; each block is verified once per restore, by whichever item claims it
    first. A remote item reads whole blocks around its range so it can verify them itself."""
    if f.loc.local:
        assert f.tensor is not None and f.mv is not None
        if hi > f.size:
            raise CheckpointCorrupted(
                f"step {ctx.step}: data file {f.path} is short ({f.size} bytes, need {hi})"
            )
        if ctx.verify:
            for shard, b0, b1 in _touched(f, it, ctx.block):
                todo = f.claim(shard, b0, b1)
                if todo:
                    _verify_blocks(ctx, f, shard, todo, f.mv, 0)
        return f.tensor, 0
    if ctx.verify:
        touched = _touched(f, it, ctx.block)
        lo = min(int(f.starts[s]) + b0 * ctx.block for s, b0, _ in touched) if touched else it.so
        rd_hi = (
            max(
                min(int(f.starts[s]) + b1 * ctx.block, int(f.starts[s] + f.lengths[s]))
                for s, _, b1 in touched
            )
            if touched
            else hi
        )
        lo, rd_hi = min(lo, it.so), max(rd_hi, hi)
    else:
        touched, lo, rd_hi = [], it.so, hi
    src_all, mv = f.read(lo, rd_hi)
    for shard, b0, b1 in touched:
        _verify_blocks(ctx, f, shard, range(b0, b1), mv, lo)
    return src_all, lo


def run_item(ctx: ReadContext, it: CopyItem) -> None:
    """Verify and copy one item (converting the dtype on the fly)."""
    f = ctx.files[it.file]
    assert f is not None
    hi = it.so + (it.n - 1) * it.sdelta + it.length
    src_all, base = _source_bytes(ctx, f, it, hi)
    sdt = torch_dtype(DTYPE_NAMES[it.sdt])
    sisz, disz = itemsize(DTYPE_NAMES[it.sdt]), itemsize(DTYPE_NAMES[it.ddt])
    elems = it.length // sisz
    src = src_all[it.so - base : hi - base].view(sdt)
    dst_t = ctx.dests[it.dst]
    doff = dst_t.storage_offset() + it.do // disz
    if it.n == 1:
        s_view = src
        d_view = dst_t.as_strided((elems,), (1,), doff)
    else:
        s_view = src.as_strided((it.n, elems), (it.sdelta // sisz, 1))
        d_view = dst_t.as_strided((it.n, elems), (it.ddelta // disz, 1), doff)
    with torch.no_grad():
        d_view.copy_(s_view)
    if ctx.done is not None:
        ctx.done(it.n * it.length)


def run_items(ctx: ReadContext, items: list[CopyItem], threads: int) -> None:
    """Run every item, on ``threads`` workers; the first error is raised and stops the items not
    yet started."""
    if threads == 1 or len(items) == 1:
        for it in items:
            run_item(ctx, it)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="astate-restore") as pool:
        futs = [pool.submit(run_item, ctx, it) for it in items]
        err: BaseException | None = None
        for fut in futs:
            try:
                fut.result()
            except BaseException as exc:  # first error wins; stop the rest
                if err is None:
                    err = exc
                    for other in futs:
                        other.cancel()
        if err is not None:
            raise err
