"""What this host is made of, read from sysfs: NUMA nodes, GPUs, RDMA ports, ethernet NICs.

:func:`read_topology` is the entry point. A file that is missing or unreadable never raises:
a bare tree reads as one node, no GPUs and no NICs. Every reader takes ``sysfs_root`` so
tests can point it at a synthetic tree.

On a host with a single NUMA node, a device whose ``numa_node`` reads -1 (unknown) is
taken to be on that node; on a multi-node host it stays unknown and is never chosen.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

__all__ = [
    "NumaNode",
    "GpuInfo",
    "RdmaPort",
    "NetInterface",
    "Topology",
    "PathLike",
    "parse_cpulist",
    "format_cpulist",
    "read_topology",
]

# One logger for the whole topology package (its users filter on this name).
logger = logging.getLogger("astate_store.transport.topology")

PathLike = Union[str, Path]

NVIDIA_VENDOR = 0x10DE
AMD_VENDOR = 0x1002
# PCI class >> 8: 0x0300 VGA, 0x0302 3D controller; AMD Instinct parts also show up as
# 0x0380 (display, other) and 0x1200 (processing accelerator).
_GPU_CLASSES = {
    NVIDIA_VENDOR: frozenset({0x0300, 0x0302}),
    AMD_VENDOR: frozenset({0x0300, 0x0302, 0x0380, 0x1200}),
}
_VENDOR_NAMES = {NVIDIA_VENDOR: "nvidia", AMD_VENDOR: "amd"}


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # sorted; empty for a memory-only node


@dataclass(frozen=True)
class GpuInfo:
    pci_address: str  # "0000:3b:00.0", lower case
    vendor: str  # "nvidia" or "amd"
    numa_node: int | None  # None when sysfs says -1 or nothing
    ordinal: int  # index among GPUs of the same vendor, in PCI bus id order


@dataclass(frozen=True)
class RdmaPort:
    device: str  # "mlx5_0"
    port: int  # 1
    numa_node: int | None
    active: bool  # ports/N/state contains ACTIVE
    link_layer: str | None = None  # "InfiniBand" / "Ethernet" when sysfs says

    @property
    def ucx_name(self) -> str:
        """The name UCX_NET_DEVICES uses: ``mlx5_0:1``."""
        return f"{self.device}:{self.port}"


@dataclass(frozen=True)
class NetInterface:
    name: str  # "eth0"; UCX's TCP transport names the interface
    numa_node: int | None
    operstate: str | None = None  # "up", "down", "unknown"; None when unreadable

    @property
    def up(self) -> bool:
        """Usable unless sysfs says it is down (``unknown`` and unreadable count as up)."""
        return self.operstate not in ("down", "lowerlayerdown", "notpresent", "dormant")


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    gpus: tuple[GpuInfo, ...] = ()  # sorted by PCI address
    rdma_ports: tuple[RdmaPort, ...] = ()
    net_interfaces: tuple[NetInterface, ...] = ()
    _cpu_to_node: Mapping[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = {cpu: n.id for n in self.nodes for cpu in n.cpus}
        object.__setattr__(self, "_cpu_to_node", table)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes)

    def _resolve(self, node: int | None) -> int | None:
        """A device's node; unknown means 'the only node' on a one-node host."""
        if node is None and len(self.nodes) == 1:
            return self.nodes[0].id
        return node

    def node_of_cpu(self, cpu: int) -> int | None:
        return self._cpu_to_node.get(cpu)

    def cpus_of(self, node: int | None) -> tuple[int, ...]:
        for n in self.nodes:
            if n.id == node:
                return n.cpus
        return ()

    def cuda_gpus(self) -> tuple[GpuInfo, ...]:
        """The GPUs torch.cuda numbers: NVIDIA ones, or AMD ones on a host without NVIDIA."""
        nvidia = tuple(g for g in self.gpus if g.vendor == "nvidia")
        return nvidia if nvidia else tuple(g for g in self.gpus if g.vendor == "amd")

    def gpu(self, ordinal: int) -> GpuInfo | None:
        """The GPU with this physical ordinal (PCI bus id order), or None."""
        gpus = self.cuda_gpus()
        return gpus[ordinal] if 0 <= ordinal < len(gpus) else None

    def gpu_by_pci(self, address: str) -> GpuInfo | None:
        """The GPU at a PCI address; the function number is ignored (GPUs are function 0)."""
        key = _pci_key(address)
        if key is None:
            return None
        for g in self.gpus:
            gk = _pci_key(g.pci_address)
            if gk is not None and gk[:3] == key[:3]:
                return g
        return None

    def node_of_gpu(self, ordinal: int) -> int | None:
        """NUMA node of the GPU with this physical ordinal; None when unknown or absent."""
        g = self.gpu(ordinal)
        return None if g is None else self._resolve(g.numa_node)

    def nics_near(self, node: int | None) -> tuple[str, ...]:
        """UCX device names local to ``node``, best first.

        Active RDMA ports on the node if there are any, else the node's ethernet
        interfaces that are up, else nothing (let UCX pick).
        """
        if node is None:
            return ()
        rdma = tuple(p.ucx_name for p in self.rdma_ports if p.active and self._resolve(p.numa_node) == node)
        if rdma:
            return rdma
        return tuple(i.name for i in self.net_interfaces if i.up and self._resolve(i.numa_node) == node)


# --------------------------------------------------------------------------- sysfs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _read_numa(path: Path) -> int | None:
    value = _read_int(path)
    return None if value is None or value < 0 else value


def _listdir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse the kernel's list format (``0-3,8-11``, ``0-15:2``, ``5``, empty) to sorted CPUs.

    Raises ValueError on malformed text.
    """
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+)(?:/(\d+))?)?)?", part)
        if m is None:
            raise ValueError(f"bad cpulist element {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"bad cpulist range {part!r}")
        if m.group(3) is None:
            cpus.update(range(lo, hi + 1))
            continue
        # Group syntax "lo-hi:used/group": take the first `used` CPUs of every `group`.
        used = int(m.group(3))
        group = int(m.group(4)) if m.group(4) is not None else used
        if used <= 0 or group <= 0:
            raise ValueError(f"bad cpulist group {part!r}")
        for start in range(lo, hi + 1, group):
            cpus.update(c for c in range(start, min(start + used, hi + 1)))
    return tuple(sorted(cpus))


def _read_cpulist(path: Path) -> tuple[int, ...] | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        logger.debug("unparsable cpulist in %s: %r", path, text)
        return None


def _read_nodes(root: Path) -> tuple[NumaNode, ...]:
    nodes: list[NumaNode] = []
    for d in _listdir(root / "devices/system/node"):
        m = re.fullmatch(r"node(\d+)", d.name)
        if m is None:
            continue
        cpus = _read_cpulist(d / "cpulist")
        nodes.append(NumaNode(int(m.group(1)), cpus or ()))
    if nodes:
        return tuple(sorted(nodes, key=lambda n: n.id))
    # No NUMA information (kernel without CONFIG_NUMA, or a bare tree): one node.
    cpus = _read_cpulist(root / "devices/system/cpu/online")
    if cpus is None:
        cpus = _read_cpulist(root / "devices/system/cpu/possible")
    if cpus is None:
        cpus = tuple(range(os.cpu_count() or 1))
    return (NumaNode(0, cpus),)


def _pci_key(address: str) -> tuple[int, int, int, int] | None:
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", address.strip())
    if m is None:
        return None
    domain = int(m.group(1), 16) if m.group(1) else 0
    return domain, int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16)


def _read_gpus(root: Path) -> tuple[GpuInfo, ...]:
    found: list[tuple[tuple[int, int, int, int], str, str, int | None]] = []
    for d in _listdir(root / "bus/pci/devices"):
        key = _pci_key(d.name)
        vendor = _read_int(d / "vendor", 16)
        cls = _read_int(d / "class", 16)
        if key is None or vendor not in _GPU_CLASSES or cls is None:
            continue
        if (cls >> 8) not in _GPU_CLASSES[vendor]:
            continue
        found.append((key, d.name.lower(), _VENDOR_NAMES[vendor], _read_numa(d / "numa_node")))
    found.sort()
    counts: dict[str, int] = {}
    gpus = []
    for _key, address, vendor, node in found:
        ordinal = counts.get(vendor, 0)
        counts[vendor] = ordinal + 1
        gpus.append(GpuInfo(address, vendor, node, ordinal))
    return tuple(gpus)


def _device_numa(dev_dir: Path) -> int | None:
    """``<dev>/device/numa_node``, or its parent's (a virtio device sits under its PCI function)."""
    node = _read_numa(dev_dir / "device" / "numa_node")
    if node is not None:
        return node
    try:
        parent = (dev_dir / "device").resolve().parent
    except OSError:
        return None
    if parent == dev_dir.resolve():  # synthetic tree: plain directories, no symlink
        return None
    return _read_numa(parent / "numa_node")


def _read_rdma(root: Path) -> tuple[RdmaPort, ...]:
    ports: list[RdmaPort] = []
    for d in _listdir(root / "class/infiniband"):
        node = _device_numa(d)
        for p in _listdir(d / "ports"):
            if not p.name.isdigit():
                continue
            state = _read(p / "state") or ""
            active = "ACTIVE" in state.upper()
            ports.append(RdmaPort(d.name, int(p.name), node, active, _read(p / "link_layer")))
    return tuple(ports)


def _read_net(root: Path) -> tuple[NetInterface, ...]:
    out: list[NetInterface] = []
    for d in _listdir(root / "class/net"):
        if d.name == "lo" or not (d / "device").exists():
            continue  # loopback and virtual interfaces (bridges, veth, bonds, ifb) have no device
        out.append(NetInterface(d.name, _device_numa(d), _read(d / "operstate")))
    return tuple(out)


def read_topology(sysfs_root: PathLike = "/sys") -> Topology:
    """Read NUMA nodes, GPUs, RDMA ports and ethernet NICs from sysfs; never raises on missing files."""
    root = Path(sysfs_root)
    return Topology(
        nodes=_read_nodes(root),
        gpus=_read_gpus(root),
        rdma_ports=_read_rdma(root),
        net_interfaces=_read_net(root),
    )


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist` for logs: ``0-3,8`` (``-`` for no CPU)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) or "-"
