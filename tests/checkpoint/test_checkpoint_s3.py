"""Checkpoints over an S3 API: pyarrow's ``S3FileSystem`` against moto's server mode on 127.0.0.1
(a real HTTP S3 endpoint started here): multipart writes, the commit marker, ranged reads while
resharding, reader leases and retention."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

moto_server = pytest.importorskip("moto.server")

import pyarrow.fs as pafs  # noqa: E402

from astate_store import Shard  # noqa: E402
from astate_store import checkpoint as ckpt  # noqa: E402
from astate_store.errors import CheckpointNotFound  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ROWS, COLS = 2048, 3072  # float32: 24 MiB, 12 MiB per rank (two 10 MiB multipart parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[str, dict[str, str]]]:
    """(endpoint, environment for credentials) of a moto S3 server with bucket ``ckpt``."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        server.stop()


def _w(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 1e-3 + step


def _write(uri: Any, step: int, rank: int) -> None:
    rows = ROWS // 2
    part = _w(step)[rank * rows : (rank + 1) * rows]
    shards = ckpt.local_shards(
        {"w": Shard(part, (rank * rows, 0), (ROWS, COLS)), "norm": torch.full((64,), float(step))}, rank=rank
    )
    ckpt.write_part(uri, step, rank, 2, shards)  # both ranks write norm: replicas, a restore reads one


def test_write_commit_restore_and_retention_over_s3(
    s3: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, env = s3
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fs = pafs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
        allow_bucket_deletion=True,
    )
    fs.create_dir("ckpt")
    # The URI form a user passes to Store.checkpoint (credentials from the environment).
    uri = f"s3://ckpt/run?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    for step in (1, 2, 3):
        _write(uri, step, 0)
        # One part is there: no marker yet, so no reader sees the step.
        assert not ckpt.try_commit(uri, step, 2)
        assert step not in ckpt.list_checkpoints(uri)
        with pytest.raises(CheckpointNotFound):
            ckpt.restore(uri, {"norm": torch.zeros(64)}, step=step)
        _write(uri, step, 1)
        assert ckpt.try_commit(uri, step, 2)
    assert ckpt.list_checkpoints(uri) == [1, 2, 3]
    info = ckpt.checkpoint_info(uri, 3)
    assert info.world_size == 2 and info.bytes == ROWS * COLS * 4 + 64 * 4
    assert all(size >= 12 << 20 for size in info.files.values())
    # The data files went up as multipart uploads (the ETag says how many parts): an object, COMMIT
    # included, becomes visible only whole, when its upload completes.
    import boto3

    s3c = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
    sdir = f"run/step-{3:020d}"
    for f in info.files:
        assert "-" in s3c.head_object(Bucket="ckpt", Key=f"{sdir}/{f}")["ETag"], f
    assert json.loads(s3c.get_object(Bucket="ckpt", Key=f"{sdir}/COMMIT")["Body"].read())["step"] == 3

    # Ranged reads: column halves of a row-split tensor (each buffer reads strided ranges of both files).
    halves = [Shard(torch.zeros(ROWS, COLS // 2), (0, c * COLS // 2), (ROWS, COLS)) for c in range(2)]
    for c, h in enumerate(halves):
        norm = torch.zeros(64)
        assert ckpt.restore(uri, {"w": h, "norm": norm}) == 3
        assert torch.equal(h.tensor, _w(3)[:, c * COLS // 2 : (c + 1) * COLS // 2])
        assert torch.equal(norm, torch.full((64,), 3.0))
    assert ckpt.verify(uri, 2).ok

    # Retention: a restore holding its lease on step 1 keeps it; step 2 goes, objects and all.
    loc = ckpt.storage.resolve(uri)
    with ckpt.ReaderLease(loc, 1) as lease:
        assert lease.held
        res = ckpt.apply_retention(uri, ckpt.RetentionPolicy(1), upto=3)
        assert res.removed == [2] and list(res.busy) == [1], res
    assert ckpt.apply_retention(uri, ckpt.RetentionPolicy(1), upto=3).removed == [1]
    assert ckpt.list_checkpoints(uri) == [3]
    left = fs.get_file_info(pafs.FileSelector("ckpt/run", recursive=True))
    assert {i.path.split("/")[2] for i in left} == {f"step-{3:020d}"}, [i.path for i in left]
    w = torch.zeros(ROWS, COLS)
    assert ckpt.restore(uri, {"w": w}) == 3 and torch.equal(w, _w(3))
