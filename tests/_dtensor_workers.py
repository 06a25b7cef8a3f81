"""Processes of the DTensor tests: FSDP2 / tensor-parallel trainers and consumers on real gloo
process groups, each group its own torch.distributed world.

Every parameter's value at step s is a pure function of the model's seed and s (``Net`` made
with ``torch.manual_seed(seed)``, then ``+ s * 0.25`` per step), so the test process rebuilds the
full tensors independently and checks each received box byte for byte.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch import nn

VOCAB, HIDDEN = 11, 6


class Net(nn.Module):
    """A small LM-shaped model whose FSDP2 splits are uneven on 2 and on 3 ranks (7, 5 and 2
    rows: ``l3`` leaves the third of 3 ranks an empty box), optionally with tied embeddings."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.l1 = nn.Linear(HIDDEN, 7)
        self.l2 = nn.Linear(7, 5)
        self.l3 = nn.Linear(5, 2)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight


class TPNet(nn.Module):
    """Column-parallel ``up`` then row-parallel ``down`` (10 and 7 rows: uneven on dp x tp)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 10)
        self.down = nn.Linear(10, 7)


def expected_net(tied: bool, seed: int, step: int) -> dict[str, torch.Tensor]:
    """The full tensors a trainer holds after ``step`` updates (independent of any sharding)."""
    torch.manual_seed(seed)
    m = Net(tied)
    return {k: v + 0.25 * step for k, v in m.state_dict().items()}


def expected_tp(seed: int, step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = TPNet()
    return {k: v + 0.25 * step for k, v in m.state_dict().items()}


def full_w(step: int) -> torch.Tensor:
    """A free-standing (8, 6) weight, for the placements no model produces."""
    return torch.arange(48, dtype=torch.float32).reshape(8, 6) * 0.5 + step


def _init_pg(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _end_pg() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def _set_step(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    """Write every local shard from the full tensors with torch's own placement arithmetic
    (``distribute_tensor`` on the parameter's mesh and placements), not the store's."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for k, p in model.state_dict().items():
            ref = distribute_tensor(
                want[k], p.device_mesh, p.placements, src_data_rank=None
            )  # local split only
            p._local_tensor.copy_(ref._local_tensor)


def _full(sd: dict[str, Any]) -> dict[str, Any]:
    """Every DTensor gathered by torch (a collective: all ranks call it), as numpy arrays: they
    pickle by value (a torch tensor would travel as a shared-memory handle that dies with us)."""
    return {k: v.full_tensor().numpy().copy() for k, v in sd.items()}


def fsdp_trainer(endpoint: str, ns: str, rank: int, port: int, session: str, out: Any, cmds: Any) -> None:
    """2-rank FSDP2 trainer of a tied ``Net``: checks the refusals, then puts steps 1 and 2 as
    ``{"model": state_dict(), "meta": {...}}`` with non-tensors skipped."""
    try:
        _init_pg(rank, 2, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Partial

        from astate_store import Shard
        from astate_store.errors import LayoutError
        from astate_store.store import Store

        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = Net(tied=True)
        fully_shard(model, mesh=mesh)
        store = Store(ns, endpoint=endpoint, rank=rank, world_size=2, session_id=session)
        errors = {}
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        for case, call in (
            ("partial", lambda: store.put(1, {"grad": partial})),
            ("non_tensor", lambda: store.put(1, {"model": model.state_dict(), "meta": {"lr": 0.1}})),
            ("wrapped", lambda: store.put(1, {"w": Shard(model.l1.weight, (0, 0), (7, HIDDEN))})),
        ):
            try:
                call()
                errors[case] = None
            except LayoutError as exc:
                errors[case] = str(exc)
        out.put(("refused", rank, errors))
        for step in (1, 2):
            _set_step(model, expected_net(True, 0, step))
            store.put(
                step, {"model": model.state_dict(), "meta": {"step": step, "lr": 0.1}}, non_tensors="skip"
            )
            out.put(("put", rank, step))
            # the next step only once every consumer rank pulled this one: "newest >= 1" is then
            # step 1 on all of them, and their gathered full tensors are of one step
            if cmds.get(timeout=120) == "done":  # the test ended early (it failed)
                break
        store.close()
        _end_pg()
        out.put(("done", rank, None))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def fsdp_consumer(endpoint: str, ns: str, rank: int, port: int, out: Any) -> None:
    """3-rank FSDP2 consumer of an untied ``Net`` (other uneven boundaries): pulls steps 1 and
    2 into ``model.state_dict()`` (nested under "model"); reports its boxes and pointers."""
    try:
        _init_pg(rank, 3, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from astate_store.errors import LayoutError
        from astate_store.store import Store

        mesh = init_device_mesh("cpu", (3,))
        torch.manual_seed(7)
        model = Net(tied=False)
        fully_shard(model, mesh=mesh)
        store = Store(ns, endpoint=endpoint, rank=0, world_size=1)
        try:
            store.get_into({"model": model.state_dict(), "junk": "x"}, timeout=60)
            refused = None
        except LayoutError as exc:
            refused = str(exc)
        ptrs = {k: v._local_tensor.data_ptr() for k, v in model.state_dict().items()}
        got, full = {}, {}
        for step in (1, 2):
            got[step] = store.get_into({"model": model.state_dict()}, step=step, timeout=60)
            full[step] = _full(model.state_dict())
            out.put(("pulled", rank, step))
        same = all(v._local_tensor.data_ptr() == ptrs[k] for k, v in model.state_dict().items())
        out.put(("consumed", rank, {"refused": refused, "steps": got, "in_place": same, "full": full}))
        store.close()
        _end_pg()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def mesh2d_worker(
    endpoint: str, ns: str, ns_tp: str, rank: int, port: int, session: str, out: Any, cmds: Any
) -> None:
    """One of 4 ranks of a (dp=2, tp=2) mesh: FSDP2 over TP (``_StridedShard``); plus a weight
    with ``(Replicate, Shard(1))`` and one with ``(Shard(0), _StridedShard(0))`` (rows
    interleaved). Puts step 3; then, as a consumer of its own group, pulls the ``Shard(1)``
    weight into a ``(Replicate, Shard(0))`` DTensor."""
    try:
        _init_pg(rank, 4, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.distributed.tensor.placement_types import _StridedShard

        from astate_store.store import Store

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(3)
        model = TPNet()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        _set_step(model, expected_tp(3, 3))
        tp_w = distribute_tensor(full_w(3), mesh, [Replicate(), Shard(1)], src_data_rank=None)
        strided = distribute_tensor(
            full_w(30), mesh, [Shard(0), _StridedShard(0, split_factor=2)], src_data_rank=None
        )
        sd = model.state_dict()
        placements = {k: str(v.placements) for k, v in sd.items()}
        store = Store(ns, endpoint=endpoint, rank=rank, world_size=4, session_id=session)
        store.put(3, {"model": sd, "strided": strided})
        tp_store = Store(ns_tp, endpoint=endpoint, rank=rank, world_size=4, session_id=session + "-tp")
        tp_store.put(3, {"w": tp_w})
        dst = distribute_tensor(torch.zeros(8, 6), mesh, [Replicate(), Shard(0)], src_data_rank=None)
        ptr = dst._local_tensor.data_ptr()
        reader = Store(ns_tp, endpoint=endpoint, rank=0, world_size=1)
        step = reader.get_into({"w": dst}, step=3, timeout=60)
        full = dst.full_tensor()  # a collective: every rank's box together
        out.put(
            (
                "mesh2d",
                rank,
                {
                    "placements": placements,
                    "step": step,
                    "in_place": dst._local_tensor.data_ptr() == ptr,
                    "full": full.numpy().copy(),
                },
            )
        )
        cmds.get(timeout=120)
        for s in (reader, tp_store, store):
            s.close()
        _end_pg()
        out.put(("done", rank, None))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
