"""Checkpoints: format, resharded restore, checksums, typed errors, crash safety, async writes."""

from __future__ import annotations

import json
import os
import signal
import zlib
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from astate_store import Shard
from astate_store import checkpoint as ck
from astate_store.errors import CheckpointCorrupted, CheckpointError, CheckpointNotFound, LayoutError
from astate_store.model.layout import Box, ShardRecord, contiguous_strides, group_layouts
from tests import _checkpoint_workers as W
from tests._procs import CTX

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "schemas" / "checkpoint_manifest.json").read_text()
)


def save(root: Any, step: int, world: int, attempt: str | None = None, **kw: Any) -> list[ck.PartInfo]:
    infos = []
    for r in range(world):
        infos.append(
            ck.write_part(
                root, step, r, world, W.rank_shards(step, r, world, **kw), fsync=False, attempt=attempt or ""
            )
        )
        assert ck.try_commit(root, step, world, fsync=False, attempt=attempt) == (r == world - 1)
    return infos


def consumer_buffers(index: int, consumers: int, *, names: Any = None, dtypes: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (shape, dtype, _, cons) in W.SPEC.items():
        if names is not None and name not in names:
            continue
        offs, sizes = cons(index, consumers)
        dt = (dtypes or {}).get(name, dtype)
        t = torch.full(sizes, 7, dtype=dt) if dt != torch.bool else torch.ones(sizes, dtype=torch.bool)
        out[name] = t if offs == (0,) * len(shape) and sizes == shape else Shard(t, offs, shape)
    return out


def check(buffers: dict[str, Any], step: int) -> None:
    for name, b in buffers.items():
        t = b.tensor if isinstance(b, Shard) else b
        box = (b.offsets, tuple(t.shape)) if isinstance(b, Shard) else ((0,) * t.dim(), tuple(t.shape))
        want = W.expected(name, step)[W.box_slice(box)]
        if want.dtype != t.dtype:
            want = want.to(t.dtype)
        assert t.dtype == want.dtype and torch.equal(t, want), name


def untouched(buffers: dict[str, Any]) -> bool:
    for b in buffers.values():
        t = b.tensor if isinstance(b, Shard) else b
        if t.numel() and not bool((t == (True if t.dtype == torch.bool else 7)).all()):
            return False
    return True


# ---- format and resharded restore ------------------------------------------------------------


@pytest.mark.parametrize("world,consumers", [(2, 3), (4, 2), (3, 1)])
def test_restore_into_other_layouts_byte_exact(tmp_path: Path, world: int, consumers: int) -> None:
    save(tmp_path, 5, world, strided=world == 4)
    assert ck.list_checkpoints(tmp_path) == [5]
    for c in range(consumers):
        bufs = consumer_buffers(c, consumers)
        ptrs = {n: (b.tensor if isinstance(b, Shard) else b).data_ptr() for n, b in bufs.items()}
        assert ck.restore(tmp_path, bufs) == 5
        check(bufs, 5)
        assert ptrs == {n: (b.tensor if isinstance(b, Shard) else b).data_ptr() for n, b in bufs.items()}


def test_strided_destinations_subset_and_0d(tmp_path: Path) -> None:
    save(tmp_path, 1, 2)
    base = torch.zeros(64, 52)
    emb = base[:, 2:50]  # a strided slice
    qkv_t = torch.zeros(48, 96, dtype=torch.bfloat16).t()  # column-major view
    exp = torch.zeros(16, 24, 8, dtype=torch.float16).permute(2, 1, 0)
    sc = torch.zeros((), dtype=torch.int64)
    bufs = {"emb": emb, "qkv": qkv_t, "experts": Shard(exp[2:6], (2, 0, 0), (8, 24, 16)), "step_count": sc}
    ptr = emb.data_ptr()
    assert ck.restore(tmp_path, bufs, threads=1) == 1
    assert emb.data_ptr() == ptr
    check(bufs, 1)
    assert (base[:, :2] == 0).all() and (base[:, 50:] == 0).all()  # nothing outside the view written


def test_file_uri_relative_path_and_filesystem_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(f"file://{tmp_path}/a", 2, 2)
    monkeypatch.chdir(tmp_path)
    save("b", 3, 2)
    for uri, step in ((str(tmp_path / "a"), 2), (f"file://{tmp_path}/b", 3), ("a", 2)):
        bufs = consumer_buffers(0, 2)
        assert ck.restore(uri, bufs) == step
        check(bufs, step)
    # a (FileSystem, path) pair on a non-local filesystem: ranged reads instead of mmap
    mock = pafs._MockFileSystem()
    save((mock, "bucket/ckpt"), 4, 3)
    save((mock, "bucket/ckpt"), 6, 2)
    assert ck.list_checkpoints((mock, "bucket/ckpt")) == [4, 6]
    for c in range(2):
        bufs = consumer_buffers(c, 2)
        assert ck.restore((mock, "bucket/ckpt"), bufs, step=4) == 4
        check(bufs, 4)
    sub = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    bufs = consumer_buffers(1, 3)
    assert ck.restore((sub, "a"), bufs) == 2
    check(bufs, 2)


def test_manifest_readable_without_the_library(tmp_path: Path) -> None:
    save(tmp_path, 9, 2)
    sdir = tmp_path / f"step-{9:020d}"
    marker = json.loads((sdir / "COMMIT").read_text())
    root = {"$defs": SCHEMA["$defs"]}
    jsonschema.validate(marker, {**root, "$ref": "#/$defs/commit"})
    table = pq.read_table(sdir / marker["manifest"])
    meta = json.loads(table.schema.metadata[b"astate.checkpoint"])
    jsonschema.validate(meta, {**root, "$ref": "#/$defs/manifest_metadata"})
    assert set(table.column_names) == set(SCHEMA["properties"]) == set(SCHEMA["required"])
    part = pq.read_table(sdir / "rank-00001.part.parquet")
    jsonschema.validate(
        json.loads(part.schema.metadata[b"astate.checkpoint"]), {**root, "$ref": "#/$defs/part_metadata"}
    )
    rows = table.to_pylist()
    for row in rows:
        jsonschema.validate(row, SCHEMA)
    # rebuild "odd" with numpy only, as docs/checkpoint.md describes
    if marker["checksum"] == "crc32":
        digest = zlib.crc32
    else:
        import xxhash

        digest = xxhash.xxh3_64_intdigest
    full = np.zeros((37, 29), np.float32)
    for row in rows:
        if row["name"] != "odd":
            continue
        data = (sdir / row["file"]).read_bytes()[row["byte_offset"] : row["byte_offset"] + row["length"]]
        for k, c in enumerate(row["checksums"]):
            assert digest(data[k * row["block_size"] : (k + 1) * row["block_size"]]) == c
        sl = tuple(slice(o, o + s) for o, s in zip(row["offsets"], row["sizes"]))
        full[sl] = np.frombuffer(data, np.dtype(row["dtype"])).reshape(row["sizes"])
    assert np.array_equal(full, W.expected("odd", 9).numpy())
    assert marker["bytes"] == sum(W.expected(n, 9).numel() * W.expected(n, 9).element_size() for n in W.SPEC)
    assert all(r["byte_offset"] % ck.ALIGN == 0 for r in rows)


def test_replicas_written_once_with_layouts(tmp_path: Path) -> None:
    world = 3
    shards = [W.rank_shards(1, r, world) for r in range(world)]
    layouts = group_layouts(
        ShardRecord(rec.name, rec.dtype, rec.global_shape, rec.box, rec.strides, r, 0, 0)
        for r in range(world)
        for rec, _ in shards[r]
    )
    for r in range(world):
        ck.write_part(tmp_path, 1, r, world, shards[r], layouts=layouts, fsync=False)
    assert ck.try_commit(tmp_path, 1, world)
    rows = ck.read_manifest(tmp_path).to_pylist()
    for name in ("norm", "step_count", "empty"):
        assert [r["rank"] for r in rows if r["name"] == name] == [0]
    bufs = consumer_buffers(0, 1)
    ck.restore(tmp_path, bufs)
    check(bufs, 1)


def test_float_conversion_on_restore(tmp_path: Path) -> None:
    save(tmp_path, 3, 2)
    bufs = consumer_buffers(
        1,
        2,
        names=("emb", "qkv", "experts", "odd"),
        dtypes={
            "emb": torch.bfloat16,
            "qkv": torch.float32,
            "experts": torch.float64,
            "odd": torch.float8_e4m3fn,
        },
    )
    assert ck.restore(tmp_path, bufs) == 3
    check(bufs, 3)
    bad = {"emb": torch.full((64, 48), 7, dtype=torch.int32)}
    with pytest.raises(LayoutError, match=r"'emb'.*float32 -> int32 is not a float conversion"):
        ck.restore(tmp_path, bad)
    assert untouched(bad)


def test_checksum_options(tmp_path: Path) -> None:
    for r in range(2):
        ck.write_part(
            tmp_path, 1, r, 2, W.rank_shards(1, r, 2), block_size=4096, checksum="crc32", fsync=False
        )
    assert ck.try_commit(tmp_path, 1, 2)
    info = ck.checkpoint_info(tmp_path)
    assert (info.block_size, info.checksum) == (4096, "crc32")
    bufs = consumer_buffers(0, 2)
    ck.restore(tmp_path, bufs)
    check(bufs, 1)
    with pytest.raises(CheckpointError, match="unknown checksum"):
        ck.write_part(tmp_path, 2, 0, 2, [], checksum="md5")
    pytest.importorskip("xxhash")
    assert ck.DEFAULT_CHECKSUM == "xxh3_64"
    for r in range(2):
        ck.write_part(tmp_path, 2, r, 2, W.rank_shards(2, r, 2), checksum="xxh3_64", fsync=False)
    assert ck.try_commit(tmp_path, 2, 2)
    assert ck.checkpoint_info(tmp_path).checksum == "xxh3_64"
    bufs = consumer_buffers(1, 2)
    ck.restore(tmp_path, bufs)
    check(bufs, 2)


# ---- commit protocol ---------------------------------------------------------------------------


def test_commit_waits_for_every_part_and_is_idempotent(tmp_path: Path) -> None:
    assert not ck.try_commit(tmp_path, 1, 2)
    ck.write_part(tmp_path, 1, 1, 2, W.rank_shards(1, 1, 2), fsync=False)
    assert not ck.try_commit(tmp_path, 1, 2)
    assert ck.list_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointNotFound, match="uncommitted partial"):
        ck.restore(tmp_path, consumer_buffers(0, 1), step=1)
    ck.write_part(tmp_path, 1, 0, 2, W.rank_shards(1, 0, 2), fsync=False)
    assert ck.try_commit(tmp_path, 1, 2) and ck.try_commit(tmp_path, 1, 2)
    assert ck.list_checkpoints(tmp_path) == [1]
    with pytest.raises(CheckpointError, match="already committed"):
        ck.write_part(tmp_path, 1, 0, 2, W.rank_shards(1, 0, 2))


def test_attempt_tags_keep_stale_parts_out(tmp_path: Path) -> None:
    # a crashed run left rank 1's part of step 4 (other values); the new run must not mix it in
    ck.write_part(tmp_path, 4, 1, 2, W.rank_shards(99, 1, 2), attempt="old", fsync=False)
    ck.write_part(tmp_path, 4, 0, 2, W.rank_shards(4, 0, 2), attempt="new", fsync=False)
    assert not ck.try_commit(tmp_path, 4, 2, attempt="new")
    ck.write_part(tmp_path, 4, 1, 2, W.rank_shards(4, 1, 2), attempt="new", fsync=False)
    assert ck.try_commit(tmp_path, 4, 2, attempt="new")
    bufs = consumer_buffers(0, 1)
    ck.restore(tmp_path, bufs)
    check(bufs, 4)
    files = sorted(p.name for p in (tmp_path / f"step-{4:020d}").glob("*.bin"))
    assert files == sorted(ck.checkpoint_info(tmp_path).files)  # the stale data file was cleaned up


def test_parts_that_do_not_tile_are_refused(tmp_path: Path) -> None:
    ck.write_part(tmp_path, 1, 0, 2, W.rank_shards(1, 0, 2, names=("emb",)), fsync=False)
    ck.write_part(tmp_path, 1, 1, 2, W.rank_shards(1, 0, 2, names=("emb",)), fsync=False)  # same rows again
    with pytest.raises(CheckpointError, match=r"'emb'.*gap"):
        ck.try_commit(tmp_path, 1, 2)
    assert ck.list_checkpoints(tmp_path) == []


def test_bad_write_inputs(tmp_path: Path) -> None:
    rec = ShardRecord("w", "float32", (4, 4), Box((0, 0), (2, 4)), contiguous_strides((2, 4)), 0, 0, 0)
    with pytest.raises(LayoutError, match="'w'.*shape"):
        ck.write_part(tmp_path, 1, 0, 1, [(rec, torch.zeros(3, 4))])
    with pytest.raises(LayoutError, match="'w'.*float64"):
        ck.write_part(tmp_path, 1, 0, 1, [(rec, torch.zeros(2, 4, dtype=torch.float64))])
    with pytest.raises(LayoutError, match="given twice"):
        ck.write_part(tmp_path, 1, 0, 1, [(rec, torch.zeros(2, 4)), (rec, torch.zeros(2, 4))])
    with pytest.raises(CheckpointError, match="rank"):
        ck.write_part(tmp_path, 1, 2, 2, [])
    with pytest.raises(CheckpointError, match="step"):
        ck.write_part(tmp_path, -1, 0, 1, [])
    assert not list(tmp_path.iterdir())


# ---- typed errors ------------------------------------------------------------------------------


def test_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="no complete checkpoint"):
        ck.restore(tmp_path / "nothing", consumer_buffers(0, 1))
    assert ck.list_checkpoints(tmp_path / "nothing") == []
    save(tmp_path, 2, 1)
    with pytest.raises(CheckpointNotFound, match=r"step 3.*complete: \[2\]"):
        ck.restore(tmp_path, consumer_buffers(0, 1), step=3)


def test_bad_buffers_fail_before_any_byte_is_written(tmp_path: Path) -> None:
    save(tmp_path, 1, 2)
    cases = [
        ({"nope": torch.zeros(3)}, r"'nope' is not in checkpoint step 1"),
        ({"emb": torch.full((64, 47), 7.0)}, r"'emb'.*global shape \(64, 47\).*\(64, 48\)"),
        ({"emb": Shard(torch.full((8, 48), 7.0), (60, 0), (64, 48))}, r"'emb'.*out of\s+bounds"),
        (
            {"emb": torch.full((64, 48), 7.0).expand(2, 64, 48)[0].as_strided((64, 48), (0, 1))},
            r"'emb'.*overlaps",
        ),
    ]
    for bufs, msg in cases:
        full = {**consumer_buffers(0, 1, names=("qkv", "odd")), **bufs}
        with pytest.raises(LayoutError, match=msg):
            ck.restore(tmp_path, full)
        assert untouched({k: v for k, v in full.items() if k in ("qkv", "odd")})


def _data_files(root: Path, step: int) -> list[Path]:
    return sorted((root / f"step-{step:020d}").glob("rank-*.bin"))


def test_corrupted_byte_names_tensor_and_file(tmp_path: Path) -> None:
    save(tmp_path, 1, 1)
    rows = ck.read_manifest(tmp_path).to_pylist()
    odd = next(r for r in rows if r["name"] == "odd")
    path = tmp_path / f"step-{1:020d}" / odd["file"]
    raw = bytearray(path.read_bytes())
    raw[odd["byte_offset"] + 17] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupted, match=rf"'odd'.*{path.name}.*checksum"):
        ck.restore(tmp_path, consumer_buffers(0, 2, names=("odd",)))
    ok = consumer_buffers(0, 1, names=("emb", "qkv"))  # other tensors' blocks are still fine
    ck.restore(tmp_path, ok)
    check(ok, 1)
    bufs = consumer_buffers(0, 1, names=("odd",))
    ck.restore(tmp_path, bufs, verify=False)  # verification can be skipped
    assert not torch.equal(bufs["odd"], W.expected("odd", 1))


def test_block_checksums_cover_only_what_is_read(tmp_path: Path) -> None:
    name, n = "big", 8192
    full = torch.arange(n, dtype=torch.float32)
    rec = ShardRecord(name, "float32", (n,), Box((0,), (n,)), (1,), 0, 0, 0)
    ck.write_part(tmp_path, 1, 0, 1, [(rec, full)], block_size=4096, fsync=False)
    assert ck.try_commit(tmp_path, 1, 1)
    row = ck.read_manifest(tmp_path).to_pylist()[0]
    assert len(row["checksums"]) == n * 4 // 4096
    path = tmp_path / f"step-{1:020d}" / row["file"]
    raw = bytearray(path.read_bytes())
    raw[row["byte_offset"] + 5 * 4096 + 3] ^= 1  # block 5: elements 5120..6143
    path.write_bytes(bytes(raw))
    head = Shard(torch.zeros(4096), (0,), (n,))
    ck.restore(tmp_path, {name: head})
    assert torch.equal(head.tensor, full[:4096])
    with pytest.raises(CheckpointCorrupted, match="block 5"):
        ck.restore(tmp_path, {name: Shard(torch.zeros(10), (6000,), (n,))})


def test_missing_short_and_garbled_files(tmp_path: Path) -> None:
    save(tmp_path, 1, 2)
    save(tmp_path, 2, 2)
    files = _data_files(tmp_path, 2)
    files[0].write_bytes(files[0].read_bytes()[:-100])
    bufs = consumer_buffers(0, 1)
    with pytest.raises(CheckpointCorrupted, match=rf"{files[0].name} has \d+ bytes"):
        ck.restore(tmp_path, bufs)
    assert untouched(bufs)
    files[0].unlink()
    with pytest.raises(CheckpointCorrupted, match=rf"{files[0].name} is missing"):
        ck.restore(tmp_path, bufs)
    assert untouched(bufs)
    assert ck.restore(tmp_path, bufs, step=1) == 1  # older steps are unaffected
    sdir = tmp_path / f"step-{2:020d}"
    man = sdir / json.loads((sdir / "COMMIT").read_text())["manifest"]
    man.write_bytes(man.read_bytes()[:-1] + b"x")
    with pytest.raises(CheckpointCorrupted, match="manifest.*crc32"):
        ck.restore(tmp_path, bufs)
    man.unlink()
    with pytest.raises(CheckpointCorrupted, match="manifest.*missing"):
        ck.restore(tmp_path, bufs)
    (sdir / "COMMIT").write_text("{not json")
    with pytest.raises(CheckpointCorrupted, match="commit marker"):
        ck.restore(tmp_path, bufs)


# ---- processes: concurrent commit, crash safety -------------------------------------------------


def test_concurrent_ranks_race_try_commit(tmp_path: Path) -> None:
    world = 3
    barrier = CTX.Barrier(world)
    results = CTX.Queue()
    procs = [
        CTX.Process(
            target=W.write_and_commit,
            args=(str(tmp_path), 7, r, world, ck.DEFAULT_CHECKSUM, barrier, results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(ok for _, _, ok in got)
    sdir = tmp_path / f"step-{7:020d}"
    assert len(list(sdir.glob("manifest-*.parquet"))) == 1 and not list(sdir.glob("*.tmp-*"))
    assert ck.list_checkpoints(tmp_path) == [7]
    for c in range(2):
        bufs = consumer_buffers(c, 2)
        assert ck.restore(tmp_path, bufs) == 7
        check(bufs, 7)


POINTS = ["data_started", "data_written", "part_written", "manifest_written"]


def test_sigkill_mid_checkpoint_keeps_previous_step(tmp_path: Path) -> None:
    world = 2
    roots = {p: tmp_path / p for p in POINTS}
    for root in roots.values():
        save(root, 1, world)
    pipes = {p: CTX.Pipe(duplex=False) for p in POINTS}
    procs = {
        p: CTX.Process(
            target=W.pause_at,
            args=(
                str(roots[p]),
                2,
                world,
                p,
                64 if p == "data_started" else 0,
                ck.DEFAULT_CHECKSUM,
                pipes[p][1],
            ),
        )
        for p in POINTS
    }
    for p in procs.values():
        p.start()
    seen = {}
    try:
        for point, (rx, _) in pipes.items():
            assert rx.poll(120), f"child pausing at {point} did not report"
            pid, got = rx.recv()
            assert (pid, got) == (procs[point].pid, point)
            os.kill(pid, signal.SIGKILL)  # mid-write, by PID
            seen[point] = pid
    finally:
        for proc in procs.values():
            if proc.is_alive() and proc.pid not in seen.values():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=30)
    for proc in procs.values():
        assert proc.exitcode == -signal.SIGKILL
    assert set(seen) == set(POINTS)
    for point, root in roots.items():
        sdir = root / f"step-{2:020d}"
        if point == "data_started":
            tmp = list(sdir.glob("rank-00000-*.bin.tmp-*"))
            assert tmp and 0 < tmp[0].stat().st_size < (64 << 20) // world, point  # killed mid-file
        assert ck.list_checkpoints(root) == [1], point
        bufs = consumer_buffers(0, 2)
        assert ck.restore(root, bufs) == 1, point
        check(bufs, 1)
        with pytest.raises(CheckpointNotFound):
            ck.restore(root, consumer_buffers(0, 1), step=2)
    # a later run (its own attempt tag: the killed run's parts are not counted) completes step 2
    root = roots["manifest_written"]
    save(root, 2, world, attempt="rerun")
    assert ck.list_checkpoints(root) == [1, 2]
    bufs = consumer_buffers(1, 3)
    assert ck.restore(root, bufs) == 2
    check(bufs, 2)


# ---- async ---------------------------------------------------------------------------------------


def test_async_checkpointer_snapshots_then_writes(tmp_path: Path) -> None:
    world = 2
    with (
        ck.AsyncCheckpointer(tmp_path, 0, world, commit=True, fsync=False) as a0,
        ck.AsyncCheckpointer(tmp_path, 1, world, commit=True, fsync=False, max_pending=2) as a1,
    ):
        futs = []
        for step in (1, 2, 3):
            live = [W.rank_tensors(step, r, world) for r in range(world)]
            futs.append(a0.save(step, ck.local_shards(live[0], rank=0)))
            futs.append(a1.save(step, ck.local_shards(live[1], rank=1)))
            for tensors in live:  # training goes on: the snapshot must not see this
                for s in tensors.values():
                    if s.tensor.numel():
                        s.tensor.fill_(True if s.tensor.dtype == torch.bool else 3)
        infos = [f.result(timeout=60) for f in futs]
    assert [i.step for i in infos] == [1, 1, 2, 2, 3, 3]
    for step in (1, 2, 3):
        assert sum(bool(i.committed) for i in infos if i.step == step) >= 1
    assert ck.list_checkpoints(tmp_path) == [1, 2, 3]
    for step in (1, 3):
        bufs = consumer_buffers(0, 3)
        assert ck.restore(tmp_path, bufs, step=step) == step
        check(bufs, step)
    # one shared checkpointer, destination per call (what Store.checkpoint(asynchronous=True) does)
    shared = ck.AsyncCheckpointer(fsync=False)
    other = tmp_path / "other"
    futs = [shared.save(other, 5, r, 2, W.rank_shards(5, r, 2), attempt="run") for r in range(2)]
    assert [f.result(timeout=60).committed for f in futs] == [False, True]
    bufs = consumer_buffers(1, 2)
    assert ck.restore(other, bufs) == 5
    check(bufs, 5)
    with pytest.raises(CheckpointError, match="needs AsyncCheckpointer"):
        shared.save(6, [])
    shared.close()
    a = ck.AsyncCheckpointer(tmp_path, 0, 1, fsync=False)
    fut = a.save(3, ck.local_shards(W.rank_tensors(3, 0, 1), rank=0))
    with pytest.raises(CheckpointError, match="already committed"):
        fut.result(timeout=60)
    a.close()
    with pytest.raises(CheckpointError, match="closed"):
        a.save(4, [])
