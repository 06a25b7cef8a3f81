"""NUMA / NIC affinity against synthetic sysfs trees, plus pinning and placement on this host."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from astate_store.transport import topology as T
from astate_store.transport.topology import (
    AffinityChoice,
    AffinityConfig,
    alloc_on_node,
    apply_env,
    choose,
    node_of_address,
    numa,
    parse_cpulist,
    pin_current_thread,
    pinned,
    policy,
    read_topology,
)

ALL16 = range(16)
NO_ENV: dict[str, str] = {}


# --------------------------------------------------------------------------- tree builders


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def add_node(root: Path, node: int, cpulist: str) -> None:
    _w(root / f"devices/system/node/node{node}/cpulist", cpulist)


def add_pci(root: Path, address: str, vendor: int, cls: int, numa: int) -> None:
    d = root / "bus/pci/devices" / address
    _w(d / "vendor", f"0x{vendor:04x}")
    _w(d / "class", f"0x{cls:06x}")
    _w(d / "numa_node", str(numa))


def add_ib(root: Path, name: str, numa: int, ports: dict[int, str]) -> None:
    d = root / "class/infiniband" / name
    _w(d / "device/numa_node", str(numa))
    for port, state in ports.items():
        _w(d / f"ports/{port}/state", state)
        _w(d / f"ports/{port}/link_layer", "InfiniBand")


def add_net(root: Path, name: str, numa: int | None, operstate: str = "up") -> None:
    d = root / "class/net" / name
    if numa is None:
        d.mkdir(parents=True, exist_ok=True)  # virtual: no device/
    else:
        _w(d / "device/numa_node", str(numa))
    _w(d / "operstate", operstate)


def two_socket(root: Path) -> Path:
    """node0: cpus 0-7, node1: 8-15; 2 NVIDIA GPUs per node; an mlx5 + an ethernet NIC per node.

    PCI addresses are listed out of order on purpose: ordinals follow bus id order.
    """
    add_node(root, 0, "0-7")
    add_node(root, 1, "8-15")
    add_pci(root, "0000:b1:00.0", 0x10DE, 0x030200, 1)  # ordinal 3
    add_pci(root, "0000:1a:00.0", 0x10DE, 0x030200, 0)  # ordinal 0
    add_pci(root, "0000:86:00.0", 0x10DE, 0x030200, 1)  # ordinal 2
    add_pci(root, "0000:3b:00.0", 0x10DE, 0x030200, 0)  # ordinal 1
    add_pci(root, "0000:00:1f.0", 0x8086, 0x060100, 0)  # an ISA bridge
    add_pci(root, "0000:1a:00.1", 0x10DE, 0x040300, 0)  # the GPU's audio function
    add_pci(root, "0000:03:00.0", 0x1A03, 0x030000, 0)  # BMC VGA, not a GPU we use
    add_ib(root, "mlx5_0", 0, {1: "4: ACTIVE"})
    add_ib(root, "mlx5_1", 1, {1: "4: ACTIVE"})
    add_net(root, "eth0", 0)
    add_net(root, "eth1", 1)
    add_net(root, "lo", None)
    add_net(root, "docker0", None)
    return root


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return two_socket(tmp_path / "sys")


# --------------------------------------------------------------------------- parsing


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8-11") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert parse_cpulist("5") == (5,)
    assert parse_cpulist("") == ()
    assert parse_cpulist("0-3,2-5\n") == (0, 1, 2, 3, 4, 5)
    assert parse_cpulist("0-15:2/4") == (0, 1, 4, 5, 8, 9, 12, 13)
    for bad in ("a", "3-1", "1-", "0-3:0/4"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_read_two_socket(sysfs: Path) -> None:
    topo = read_topology(sysfs)
    assert topo.node_ids == (0, 1)
    assert topo.cpus_of(0) == tuple(range(8))
    assert topo.cpus_of(1) == tuple(range(8, 16))
    assert topo.cpus_of(7) == ()
    assert topo.node_of_cpu(3) == 0 and topo.node_of_cpu(12) == 1 and topo.node_of_cpu(99) is None

    assert [g.pci_address for g in topo.gpus] == [
        "0000:1a:00.0",
        "0000:3b:00.0",
        "0000:86:00.0",
        "0000:b1:00.0",
    ]
    assert [g.ordinal for g in topo.gpus] == [0, 1, 2, 3]
    assert all(g.vendor == "nvidia" for g in topo.gpus)
    assert [topo.node_of_gpu(i) for i in range(4)] == [0, 0, 1, 1]
    assert topo.node_of_gpu(4) is None and topo.node_of_gpu(-1) is None
    assert topo.gpu_by_pci("0000:86:00.0").ordinal == 2  # type: ignore[union-attr]
    assert topo.gpu_by_pci("86:00.0").ordinal == 2  # type: ignore[union-attr]
    assert topo.gpu_by_pci("0000:99:00.0") is None

    assert {(p.ucx_name, p.numa_node, p.active) for p in topo.rdma_ports} == {
        ("mlx5_0:1", 0, True),
        ("mlx5_1:1", 1, True),
    }
    assert {(i.name, i.numa_node) for i in topo.net_interfaces} == {
        ("eth0", 0),
        ("eth1", 1),
    }  # lo, docker0 skipped
    assert topo.nics_near(0) == ("mlx5_0:1",)
    assert topo.nics_near(1) == ("mlx5_1:1",)
    assert topo.nics_near(None) == ()


def test_amd_gpus_counted_when_no_nvidia(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    add_node(root, 0, "0-3")
    add_node(root, 1, "4-7")
    add_pci(root, "0000:c1:00.0", 0x1002, 0x038000, 1)
    add_pci(root, "0000:41:00.0", 0x1002, 0x120000, 0)
    topo = read_topology(root)
    assert [g.vendor for g in topo.gpus] == ["amd", "amd"]
    assert [topo.node_of_gpu(i) for i in range(2)] == [0, 1]


def test_inactive_port_falls_back_to_ethernet(sysfs: Path) -> None:
    add_ib(sysfs, "mlx5_1", 1, {1: "1: DOWN", 2: "2: INIT"})
    topo = read_topology(sysfs)
    assert {p.ucx_name: p.active for p in topo.rdma_ports if p.device == "mlx5_1"} == {
        "mlx5_1:1": False,
        "mlx5_1:2": False,
    }
    assert topo.nics_near(1) == ("eth1",)
    c = choose(topo, "cuda:3", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    assert c.numa_node == 1 and c.net_devices == "eth1"
    # And with the ethernet down too, nothing near: UCX picks.
    add_net(sysfs, "eth1", 1, operstate="down")
    c = choose(read_topology(sysfs), "cuda:3", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    assert c.numa_node == 1 and c.net_devices is None


def test_several_active_ports_listed(sysfs: Path) -> None:
    add_ib(sysfs, "mlx5_2", 0, {1: "4: ACTIVE"})
    c = choose(read_topology(sysfs), "cuda:0", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    assert c.net_devices == "mlx5_0:1,mlx5_2:1"


def test_bare_tree_is_one_node_without_devices(tmp_path: Path) -> None:
    topo = read_topology(tmp_path / "does-not-exist")
    assert len(topo.nodes) == 1 and topo.nodes[0].id == 0 and topo.cpus_of(0)
    assert topo.gpus == () and topo.rdma_ports == () and topo.net_interfaces == ()
    c = choose(topo, "cuda:0", AffinityConfig(), env=NO_ENV)
    assert c.numa_node is None and c.cpus == () and c.net_devices is None


def test_no_node_dir_uses_cpu_online(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    _w(root / "devices/system/cpu/online", "0-3")
    add_pci(root, "0000:01:00.0", 0x10DE, 0x030200, -1)
    add_net(root, "eth0", -1)
    topo = read_topology(root)
    assert topo.nodes == (T.NumaNode(0, (0, 1, 2, 3)),)
    assert topo.gpus[0].numa_node is None
    # One node: unknown means that node.
    assert topo.node_of_gpu(0) == 0
    assert topo.nics_near(0) == ("eth0",)
    c = choose(topo, "cuda:0", AffinityConfig(), allowed_cpus=range(4), env=NO_ENV)
    assert c.numa_node == 0 and c.cpus == (0, 1, 2, 3)
    assert c.net_devices is None  # single node: no reason to restrict UCX


def test_numa_minus_one_on_two_nodes_is_unknown(sysfs: Path) -> None:
    add_pci(sysfs, "0000:e1:00.0", 0x10DE, 0x030200, -1)  # ordinal 4
    add_ib(sysfs, "mlx5_9", -1, {1: "4: ACTIVE"})
    topo = read_topology(sysfs)
    assert topo.gpus[4].numa_node is None and topo.node_of_gpu(4) is None
    assert "mlx5_9:1" not in topo.nics_near(0) + topo.nics_near(1)
    c = choose(topo, "cuda:4", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    assert c == AffinityChoice(None, (), None, c.reason)


def test_garbage_files_do_not_crash(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    add_node(root, 0, "zzz")
    _w(root / "devices/system/node/nodeX/cpulist", "0-3")
    _w(root / "bus/pci/devices/0000:01:00.0/vendor", "nonsense")
    _w(root / "bus/pci/devices/junk/vendor", "0x10de")
    (root / "class/infiniband/mlx5_0/ports/1").mkdir(parents=True)  # no state file
    topo = read_topology(root)
    assert topo.nodes == (T.NumaNode(0, ()),) and topo.gpus == ()
    assert topo.rdma_ports[0].active is False and topo.rdma_ports[0].numa_node is None


# --------------------------------------------------------------------------- choose


@pytest.mark.parametrize(
    "device,node,nic",
    [
        ("cuda:0", 0, "mlx5_0:1"),
        (torch.device("cuda", 1), 0, "mlx5_0:1"),
        ("cuda:2", 1, "mlx5_1:1"),
        (torch.device("cuda:3"), 1, "mlx5_1:1"),
    ],
)
def test_choose_gpu(
    sysfs: Path, device: object, node: int, nic: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="astate_store.transport.topology")
    c = choose(read_topology(sysfs), device, AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)  # type: ignore[arg-type]
    assert c.numa_node == node
    assert c.cpus == tuple(range(8 * node, 8 * node + 8))
    assert c.net_devices == nic
    assert any("affinity for" in r.getMessage() and nic in r.getMessage() for r in caplog.records)


def test_choose_respects_allowed_cpus(sysfs: Path) -> None:
    topo = read_topology(sysfs)
    c = choose(topo, "cuda:2", AffinityConfig(), allowed_cpus={1, 9, 10}, env=NO_ENV)
    assert c.numa_node == 1 and c.cpus == (9, 10)
    c = choose(topo, "cuda:2", AffinityConfig(), allowed_cpus={1, 2}, env=NO_ENV)
    assert c.numa_node == 1 and c.cpus == () and "not pinning" in c.reason
    assert c.net_devices == "mlx5_1:1"  # the NIC choice does not depend on pinning


def test_choose_cuda_visible_devices(sysfs: Path) -> None:
    topo = read_topology(sysfs)
    c = choose(topo, "cuda:0", AffinityConfig(), allowed_cpus=ALL16, env={"CUDA_VISIBLE_DEVICES": "3,0"})
    assert c.numa_node == 1 and c.net_devices == "mlx5_1:1"
    c = choose(topo, "cuda:1", AffinityConfig(), allowed_cpus=ALL16, env={"CUDA_VISIBLE_DEVICES": "3,0"})
    assert c.numa_node == 0
    c = choose(
        topo, "cuda:0", AffinityConfig(), allowed_cpus=ALL16, env={"CUDA_VISIBLE_DEVICES": "GPU-1234abcd"}
    )
    assert c.numa_node is None and c.cpus == () and c.net_devices is None


def test_choose_prefers_torch_pci_address(sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        policy, "_cuda_pci_address", lambda index: "0000:86:00.0"
    )  # torch says cuda:0 is ordinal 2
    c = choose(read_topology(sysfs), "cuda:0", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    assert c.numa_node == 1 and "from torch" in c.reason


def test_choose_host_buffers(sysfs: Path) -> None:
    topo = read_topology(sysfs)
    for dev in ("cpu", None, torch.device("cpu")):
        c = choose(topo, dev, AffinityConfig(), allowed_cpus={8, 9}, env=NO_ENV)
        assert c.numa_node == 1 and c.cpus == (8, 9) and c.net_devices == "mlx5_1:1"
    c = choose(topo, "cpu", AffinityConfig(), allowed_cpus={0, 8}, env=NO_ENV)
    assert c.numa_node is None and c.cpus == () and c.net_devices is None


def test_forced_node_and_user_net_devices(sysfs: Path) -> None:
    topo = read_topology(sysfs)
    c = choose(topo, "cuda:0", AffinityConfig(numa_node=1), allowed_cpus=ALL16, env=NO_ENV)
    assert c.numa_node == 1 and c.cpus == tuple(range(8, 16)) and c.net_devices == "mlx5_1:1"
    c = choose(
        topo, "cuda:0", AffinityConfig(numa_node=5), allowed_cpus=ALL16, env=NO_ENV
    )  # absent node: derive
    assert c.numa_node == 0
    for dev in ("cuda:0", "cuda:3", "cpu"):
        c = choose(topo, dev, AffinityConfig(net_devices="mlx5_7:1"), allowed_cpus=ALL16, env=NO_ENV)
        assert c.net_devices == "mlx5_7:1" and "user-set" in c.reason


def test_user_ucx_net_devices_never_overridden(sysfs: Path) -> None:
    env = {"UCX_NET_DEVICES": "mlx5_1:1"}
    cfg = AffinityConfig.from_env(env)
    assert cfg.net_devices == "mlx5_1:1"
    c = choose(read_topology(sysfs), "cuda:0", cfg, allowed_cpus=ALL16, env=env)
    assert c.numa_node == 0 and c.net_devices == "mlx5_1:1"
    assert apply_env(c, env) is False and env == {"UCX_NET_DEVICES": "mlx5_1:1"}
    # Even a choice made without the config leaves the user's value alone.
    c = choose(read_topology(sysfs), "cuda:0", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    assert c.net_devices == "mlx5_0:1"
    assert apply_env(c, env) is False and env["UCX_NET_DEVICES"] == "mlx5_1:1"


def test_apply_env(sysfs: Path) -> None:
    c = choose(read_topology(sysfs), "cuda:2", AffinityConfig(), allowed_cpus=ALL16, env=NO_ENV)
    env: dict[str, str] = {}
    assert apply_env(c, env) is True and env == {"UCX_NET_DEVICES": "mlx5_1:1"}
    env = {"UCX_NET_DEVICES": ""}  # empty counts as unset
    assert apply_env(c, env) is True and env["UCX_NET_DEVICES"] == "mlx5_1:1"
    env = {}
    assert apply_env(AffinityChoice(0, (0,), None, "x"), env) is False and env == {}


def test_off_switch(sysfs: Path) -> None:
    for value in ("off", "0", "OFF", "false"):
        cfg = AffinityConfig.from_env({"ASTATE_AFFINITY": value})
        assert cfg.enabled is False
        c = choose(read_topology(sysfs), "cuda:3", cfg, allowed_cpus=ALL16, env=NO_ENV)
        assert c.numa_node is None and c.cpus == () and c.net_devices is None and "disabled" in c.reason
        env: dict[str, str] = {}
        assert apply_env(c, env) is False and env == {}
    assert AffinityConfig.from_env({"ASTATE_AFFINITY": "on"}).enabled is True
    assert AffinityConfig.from_env({}).enabled is True


def test_from_env_numa_node(caplog: pytest.LogCaptureFixture) -> None:
    assert AffinityConfig.from_env({"ASTATE_NUMA_NODE": "1"}) == AffinityConfig(True, 1, None)
    assert AffinityConfig.from_env({"ASTATE_NUMA_NODE": "auto"}).numa_node is None
    assert AffinityConfig.from_env({"ASTATE_NUMA_NODE": ""}).numa_node is None
    with caplog.at_level(logging.WARNING, logger="astate_store.transport.topology"):
        assert AffinityConfig.from_env({"ASTATE_NUMA_NODE": "one"}).numa_node is None
        assert AffinityConfig.from_env({"ASTATE_NUMA_NODE": "-2"}).numa_node is None
    assert sum("ASTATE_NUMA_NODE" in r.getMessage() for r in caplog.records) == 2
    assert AffinityConfig.from_env({"UCX_NET_DEVICES": "  "}).net_devices is None


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASTATE_AFFINITY", "off")
    monkeypatch.setenv("ASTATE_NUMA_NODE", "3")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    assert AffinityConfig.from_env() == AffinityConfig(False, 3, "eth9")


# --------------------------------------------------------------------------- this host


def test_real_host_reads_and_chooses() -> None:
    topo = read_topology()
    assert topo.nodes
    allowed = os.sched_getaffinity(0)
    assert all(topo.node_of_cpu(c) is not None for c in allowed)
    c = T.affinity_for("cpu", AffinityConfig())
    assert set(c.cpus) <= allowed


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out: list[object] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001
            err.append(exc)

    th = threading.Thread(target=run)
    th.start()
    th.join(5)
    if err:
        raise err[0]
    return out[0]


def test_pin_current_thread() -> None:
    before_main = os.sched_getaffinity(0)
    one = min(before_main)

    def body() -> tuple[set[int], set[int], set[int]]:
        start = os.sched_getaffinity(0)
        prev = pin_current_thread([one])
        inside = os.sched_getaffinity(0)
        assert prev == frozenset(start)
        pin_current_thread(prev)  # type: ignore[arg-type]
        return start, inside, os.sched_getaffinity(0)

    start, inside, after = _in_thread(body)
    assert inside == {one}
    assert after == start
    assert os.sched_getaffinity(0) == before_main  # other threads untouched

    assert pin_current_thread([]) is None
    assert pin_current_thread([10_000]) is None  # refused by the kernel: no-op
    assert os.sched_getaffinity(0) == before_main


def test_pinned_context_manager() -> None:
    allowed = os.sched_getaffinity(0)
    one = max(allowed)

    def body() -> tuple[set[int], set[int]]:
        with pinned([one]) as prev:
            assert prev == frozenset(allowed)
            inside = os.sched_getaffinity(0)
        return inside, os.sched_getaffinity(0)

    inside, after = _in_thread(body)
    assert inside == {one} and after == allowed
    with pinned([]) as prev:
        assert prev is None
    assert os.sched_getaffinity(0) == allowed


@pytest.mark.parametrize("nbytes", [1, 4096, 10_000, 3 << 20])
def test_alloc_on_node(nbytes: int) -> None:
    node = read_topology().nodes[0].id
    t = alloc_on_node(nbytes, node)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.shape == (nbytes,)
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t.sum()) == 7 * nbytes
    where = node_of_address(t.data_ptr())
    assert where in (None, node)
    u = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    t.copy_(u)
    assert torch.equal(t, u)


def test_alloc_on_node_edge_cases() -> None:
    assert alloc_on_node(0, 0).shape == (0,)
    assert alloc_on_node(100, None).shape == (100,)
    assert alloc_on_node(100, 0, strict=True).shape == (100,)
    with pytest.raises(ValueError):
        alloc_on_node(-1, 0)


def test_alloc_on_absent_node_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="astate_store.transport.topology")
    t = alloc_on_node(8192, 63)  # no such node: mbind refuses, no cpus for first touch
    assert t.shape == (8192,)
    t.fill_(1)
    assert int(t.sum()) == 8192
    assert any("plain allocation" in r.getMessage() for r in caplog.records)


def test_alloc_first_touch_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="astate_store.transport.topology")
    monkeypatch.setattr(numa, "_mbind", lambda *a: "mbind unavailable (test)")
    node = read_topology().nodes[0].id
    main_affinity = os.sched_getaffinity(0)
    t = alloc_on_node(1 << 20, node)
    assert t.shape == (1 << 20,)
    assert any("first touch" in r.getMessage() for r in caplog.records)
    assert os.sched_getaffinity(0) == main_affinity


def test_alloc_lifetime_keeps_mapping() -> None:
    t = alloc_on_node(1 << 16, 0)
    view = t[100:200]
    del t
    view.fill_(5)
    assert int(view.sum()) == 500
