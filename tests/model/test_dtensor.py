"""State dicts in and out: DTensors (FSDP2, TP, 2-D meshes, ``_StridedShard``), nested dicts,
non-tensor entries, tied weights, and several boxes of one name.

Trainers and consumers run as separate processes on real gloo process groups (one world per
group), over the session's real etcd; the test process rebuilds every full tensor
independently (``_dtensor_workers.expected_*``) and checks what arrived byte for byte. One
multi-process run covers several cases, so process groups are started twice in all.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from astate_store import Shard
from astate_store.errors import LayoutError
from astate_store.store import Store
from tests._dtensor_workers import (
    Net,
    TPNet,
    expected_net,
    expected_tp,
    fsdp_consumer,
    fsdp_trainer,
    full_w,
    mesh2d_worker,
)
from tests._procs import CTX


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(out: Any, n: int, kind: str) -> dict[int, Any]:
    got: dict[int, Any] = {}
    while len(got) < n:
        msg = out.get(timeout=180)
        assert msg[0] != "error", f"rank {msg[1]} failed:\n{msg[2]}"
        if msg[0] == kind:
            got[msg[1]] = msg[2]
    return got


def _exact(got: Any, want: torch.Tensor, what: str) -> None:
    got = torch.from_numpy(got) if not isinstance(got, torch.Tensor) else got
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    # bit patterns, not float equality (-0.0 / NaN would slip through ==)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), what


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes a test starts; at teardown each command queue in ``started[0]`` gets "done"
    (workers that wait for it exit even when the test failed early)."""
    started: list[Any] = [[]]
    yield started
    for q in started.pop(0):
        q.put("done")
    for p in started:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)


def test_fsdp2_two_ranks_feed_three_ranks_and_a_tied_plain_model(etcd: Any, procs: list[Any]) -> None:
    """A 2-rank FSDP2 trainer of a tied model puts ``{"model": state_dict(), "meta": ...}``
    (non-tensors skipped); a 3-rank FSDP2 consumer of the untied model (other uneven
    boundaries, an empty box on its last rank) and a whole tied model in this process pull it."""
    ns, session = "dt-" + uuid.uuid4().hex[:10], uuid.uuid4().hex[:8]
    out, cmds = CTX.Queue(), [CTX.Queue() for _ in range(2)]
    procs[0] = cmds
    tport, cport = _port(), _port()
    for r in range(2):
        procs.append(
            CTX.Process(
                target=fsdp_trainer, args=(etcd.endpoint, ns, r, tport, session, out, cmds[r]), daemon=True
            )
        )
    for r in range(3):
        procs.append(CTX.Process(target=fsdp_consumer, args=(etcd.endpoint, ns, r, cport, out), daemon=True))
    for p in procs[1:]:
        p.start()

    refused = _collect(out, 2, "refused")
    for r, errs in refused.items():
        assert errs["partial"] is not None and "'grad'" in errs["partial"] and "Partial" in errs["partial"], (
            errs
        )
        assert errs["non_tensor"] is not None and "'meta.lr'" in errs["non_tensor"], errs
        assert errs["wrapped"] is not None and "'w'" in errs["wrapped"] and "DTensor" in errs["wrapped"], errs

    _collect(out, 3, "pulled")  # step 1 on every consumer rank: now step 2
    for q in cmds:
        q.put("next")
    consumed = _collect(out, 3, "consumed")
    for r, res in consumed.items():
        assert res["refused"] is not None and "'junk'" in res["refused"], res["refused"]
        assert res["in_place"], f"rank {r}: a local tensor moved"
        for step, full in res["full"].items():
            assert res["steps"][step] >= step
            want = expected_net(True, 0, res["steps"][step])
            assert set(full) == set(want)
            for k, t in full.items():
                _exact(t, want[k], f"consumer rank {r} step {step} {k}")

    # a whole, tied model: the shared weight is one buffer, filled once, under either name
    plain = Net(tied=True)
    sd = plain.state_dict()
    ptr = plain.embed.weight.data_ptr()
    with Store(ns, endpoint=etcd.endpoint) as store:
        step = store.get_into({"model": sd}, step=2, timeout=60)
        assert plain.embed.weight.data_ptr() == ptr and plain.head.weight.data_ptr() == ptr
        want = expected_net(True, 0, step)
        for k, t in plain.state_dict().items():
            _exact(t, want[k], f"tied plain {k}")
        alone = torch.zeros(11, 6)  # an untied consumer asking only for the alias name
        store.get_into({"model.head.weight": alone}, step=step, timeout=60)
        _exact(alone, want["head.weight"], "alias alone")
    for q in cmds:
        q.put("done")
    procs[0] = []
    _collect(out, 2, "done")


def test_2d_mesh_fsdp_over_tp_and_tp_shard1_to_shard0(etcd: Any, procs: list[Any]) -> None:
    """A (dp=2, tp=2) mesh of 4 gloo ranks: FSDP2 over tensor parallelism (``_StridedShard``) and
    a ``(Shard(0), _StridedShard(0))`` weight feed a plain model here; the ranks themselves pull a
    ``(Replicate, Shard(1))`` weight into ``(Replicate, Shard(0))`` DTensors."""
    ns, ns_tp, session = "dt-" + uuid.uuid4().hex[:10], "dt-" + uuid.uuid4().hex[:10], uuid.uuid4().hex[:8]
    out, cmds = CTX.Queue(), [CTX.Queue() for _ in range(4)]
    procs[0] = cmds
    port = _port()
    for r in range(4):
        procs.append(
            CTX.Process(
                target=mesh2d_worker,
                args=(etcd.endpoint, ns, ns_tp, r, port, session, out, cmds[r]),
                daemon=True,
            )
        )
    for p in procs[1:]:
        p.start()
    res = _collect(out, 4, "mesh2d")
    assert "_StridedShard" in res[0]["placements"]["up.weight"], res[0]["placements"]
    for r, x in res.items():
        assert x["step"] == 3 and x["in_place"], (r, x["step"], x["in_place"])
        _exact(x["full"], full_w(3), f"rank {r} Shard(1) -> Shard(0)")

    plain = TPNet()
    strided = torch.zeros(8, 6)
    with Store(ns, endpoint=etcd.endpoint) as store:
        assert store.get_into({"model": plain.state_dict(), "strided": strided}, step=3, timeout=60) == 3
    want = expected_tp(3, 3)
    for k, t in plain.state_dict().items():
        _exact(t, want[k], f"plain {k}")
    _exact(strided, full_w(30), "strided rows")
    for q in cmds:
        q.put("done")
    procs[0] = []
    _collect(out, 4, "done")


def test_boxes_of_one_name_ties_nested_and_non_tensors(etcd: Any) -> None:
    """In one process (publisher and consumer stores): several boxes of one name both ways, a
    box list that overlaps, ties on one side only, nested dicts and non-tensor entries."""
    ns = "dt-" + uuid.uuid4().hex[:10]
    fused = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    emb = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 3
    head = emb.clone()  # untied on the publisher, equal values
    rows = [
        Shard(fused[0:3], (0, 0), (10, 6)),
        Shard(fused[3:4], (3, 0), (10, 6)),
        Shard(fused[4:], (4, 0), (10, 6)),
    ]
    with Store(ns, endpoint=etcd.endpoint) as pub, Store(ns, endpoint=etcd.endpoint) as con:
        with pytest.raises(LayoutError, match="'bad'.*overlap"):
            pub.put(1, {"bad": [Shard(fused[0:4], (0, 0), (10, 6)), Shard(fused[3:], (3, 0), (10, 6))]})
        with pytest.raises(LayoutError, match="'opt.step'.*not a tensor"):
            pub.put(1, {"fused": rows, "opt": {"step": 4}})
        for step in (1, 2):
            fused.add_(step)
            assert pub.put(
                step,
                {"fused": rows, "m": {"emb": emb, "head": head}, "opt": {"step": step}},
                non_tensors="skip",
            )
        # columns of the fused tensor as two boxes of one name; a tied consumer of emb/head
        dst = torch.zeros(6, 10).t()  # a strided destination
        tied = torch.zeros(4, 6)
        boxes = [Shard(dst[:, :2], (0, 0), (10, 6)), Shard(dst[:, 2:], (0, 2), (10, 6))]
        assert con.get_into({"fused": boxes, "m": {"emb": tied, "head": tied}}, step=2, timeout=30) == 2
        _exact(dst, fused, "fused by columns")
        _exact(tied, emb, "tied consumer")
        with pytest.raises(LayoutError, match="'fused'.*overlap"):
            con.get_into(
                {"fused": [Shard(dst[:5], (0, 0), (10, 6)), Shard(dst[4:], (4, 0), (10, 6))]}, timeout=30
            )
    # a tied consumer whose first name is not published: filled once through the other name
    ns2 = "dt-" + uuid.uuid4().hex[:10]
    with Store(ns2, endpoint=etcd.endpoint) as pub, Store(ns2, endpoint=etcd.endpoint) as con:
        pub.put(5, {"m.head": head})
        tied = torch.zeros(4, 6)
        assert con.get_into({"m": {"emb": tied, "head": tied}}, step=5, timeout=30) == 5
        _exact(tied, head, "tied consumer, alias published")


def test_flattening_matches_dcp_and_box_lists_are_checked() -> None:
    """Names are DCP's (compared with torch's own ``flatten_state_dict``); box lists that
    disagree, repeat a box or hold something else are refused naming the tensor."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

    from astate_store.model.state_dict import flatten_state_dict
    from astate_store.model.validation import validate_tensors

    t = [torch.zeros(2) for _ in range(5)]
    nested = {
        "model": {"a": t[0], "b": {"c": t[1]}},
        "opt": {"state": {0: {"exp_avg": t[2]}}, "groups": [{"lr": 0.1, "params": [0]}]},
        "lst": [t[3], t[4]],
        "step": 7,
    }
    ours = flatten_state_dict(nested)
    theirs, _ = dcp_flatten(nested)
    assert list(ours) == list(theirs) and all(ours[k] is theirs[k] for k in ours), (list(ours), list(theirs))
    with pytest.raises(LayoutError, match="flatten to the name 'a.b'"):
        flatten_state_dict({"a.b": t[0], "a": {"b": t[1]}})

    g = torch.zeros(6, 4)
    with pytest.raises(LayoutError, match="'w'.*disagree"):
        validate_tensors({"w": [Shard(g[:3], (0, 0), (6, 4)), Shard(g[3:], (3, 0), (7, 4))]}, "x")
    with pytest.raises(LayoutError, match="'w'.*listed twice|'w'.*overlap"):
        validate_tensors({"w": [Shard(g[:3], (0, 0), (6, 4)), Shard(g[:3], (0, 0), (6, 4))]}, "x")
    with pytest.raises(LayoutError, match="'w'.*Shard"):
        validate_tensors({"w": [Shard(g[:3], (0, 0), (6, 4)), g[3:]]}, "x")
    es = validate_tensors(
        {"w": [Shard(g[3:], (3, 0), (6, 4)), Shard(g[:3], (0, 0), (6, 4))], "v": g, "u": g}, "x"
    )
    assert [(e.name, e.box.offsets, e.aliases) for e in es] == [
        ("u", (0, 0), ("v",)),
        ("w", (0, 0), ()),
        ("w", (3, 0), ()),
    ]
