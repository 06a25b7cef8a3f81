"""NUMA and NIC affinity: keep copies, progress threads and the NIC next to the buffers.

On a two-socket host a GPU, its staging memory, the thread that drives it and the NIC
that carries its bytes should all sit on the same socket; crossing the inter-socket link
costs bandwidth and latency on every transfer. This module:

* reads the machine from sysfs (:func:`read_topology`): NUMA nodes and their CPUs,
  GPUs with their PCI address and NUMA node, RDMA ports and ethernet interfaces with
  theirs. A file that is missing or unreadable never raises: a bare tree reads as one
  node, no GPUs and no NICs;
* decides (:func:`choose`) which node, CPUs and UCX network devices suit a buffer on a
  given device, honouring the user's configuration (:class:`AffinityConfig`, with an
  off switch) and never overriding a user-set ``UCX_NET_DEVICES``; the choice is logged
  at info level on ``astate_store.transport.topology``;
* applies it: :func:`apply_env` (``UCX_NET_DEVICES``, before UCX is initialised),
  :func:`pin_current_thread` / :func:`pinned` (progress and copy threads) and
  :func:`alloc_on_node` (host staging memory placed on the node).

Every reader takes ``sysfs_root`` so tests can point it at a synthetic tree.

CUDA ordinals. sysfs knows PCI addresses, not CUDA ordinals. When CUDA is already
initialised in this process and torch reports the device's PCI address, the GPU is found
by address (exact, whatever ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` say).
Otherwise the ordinal is taken to count GPUs in PCI bus id order, which is what CUDA does
with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and, on a host with identical GPUs, usually does by
default), after mapping it through an all-integer ``CUDA_VISIBLE_DEVICES``. A
``CUDA_VISIBLE_DEVICES`` of UUIDs cannot be mapped from sysfs; the node is then unknown
and nothing is pinned. ROCm builds of torch expose AMD GPUs as ``cuda``: when the host has
no NVIDIA GPU, ordinals count the AMD ones.

On a host with a single NUMA node, a device whose ``numa_node`` reads -1 (unknown) is
taken to be on that node; on a multi-node host it stays unknown and is never chosen.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
import platform
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, MutableMapping, Optional, Union

import torch

from astate_store.transport.memfd import shared_mapping

__all__ = [
    "NumaNode",
    "GpuInfo",
    "RdmaPort",
    "NetInterface",
    "Topology",
    "AffinityConfig",
    "AffinityChoice",
    "parse_cpulist",
    "read_topology",
    "choose",
    "affinity_for",
    "apply_env",
    "pin_current_thread",
    "pinned",
    "alloc_on_node",
    "node_of_address",
]

logger = logging.getLogger("astate_store.transport.topology")

PathLike = Union[str, Path]
DeviceLike = Union[torch.device, str, None]

NVIDIA_VENDOR = 0x10DE
AMD_VENDOR = 0x1002
# PCI class >> 8: 0x0300 VGA, 0x0302 3D controller; AMD Instinct parts also show up as
# 0x0380 (display, other) and 0x1200 (processing accelerator).
_GPU_CLASSES = {
    NVIDIA_VENDOR: frozenset({0x0300, 0x0302}),
    AMD_VENDOR: frozenset({0x0300, 0x0302, 0x0380, 0x1200}),
}
_VENDOR_NAMES = {NVIDIA_VENDOR: "nvidia", AMD_VENDOR: "amd"}

_OFF_VALUES = frozenset({"off", "0", "false", "no", "disable", "disabled"})


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # sorted; empty for a memory-only node


@dataclass(frozen=True)
class GpuInfo:
    pci_address: str  # "0000:3b:00.0", lower case
    vendor: str  # "nvidia" or "amd"
    numa_node: Optional[int]  # None when sysfs says -1 or nothing
    ordinal: int  # index among GPUs of the same vendor, in PCI bus id order


@dataclass(frozen=True)
class RdmaPort:
    device: str  # "mlx5_0"
    port: int  # 1
    numa_node: Optional[int]
    active: bool  # ports/N/state contains ACTIVE
    link_layer: Optional[str] = None  # "InfiniBand" / "Ethernet" when sysfs says

    @property
    def ucx_name(self) -> str:
        """The name UCX_NET_DEVICES uses: ``mlx5_0:1``."""
        return f"{self.device}:{self.port}"


@dataclass(frozen=True)
class NetInterface:
    name: str  # "eth0"; UCX's TCP transport names the interface
    numa_node: Optional[int]
    operstate: Optional[str] = None  # "up", "down", "unknown"; None when unreadable

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

    def _resolve(self, node: Optional[int]) -> Optional[int]:
        """A device's node; unknown means 'the only node' on a one-node host."""
        if node is None and len(self.nodes) == 1:
            return self.nodes[0].id
        return node

    def node_of_cpu(self, cpu: int) -> Optional[int]:
        return self._cpu_to_node.get(cpu)

    def cpus_of(self, node: Optional[int]) -> tuple[int, ...]:
        for n in self.nodes:
            if n.id == node:
                return n.cpus
        return ()

    def cuda_gpus(self) -> tuple[GpuInfo, ...]:
        """The GPUs torch.cuda numbers: NVIDIA ones, or AMD ones on a host without NVIDIA."""
        nvidia = tuple(g for g in self.gpus if g.vendor == "nvidia")
        return nvidia if nvidia else tuple(g for g in self.gpus if g.vendor == "amd")

    def gpu(self, ordinal: int) -> Optional[GpuInfo]:
        """The GPU with this physical ordinal (PCI bus id order), or None."""
        gpus = self.cuda_gpus()
        return gpus[ordinal] if 0 <= ordinal < len(gpus) else None

    def gpu_by_pci(self, address: str) -> Optional[GpuInfo]:
        """The GPU at a PCI address; the function number is ignored (GPUs are function 0)."""
        key = _pci_key(address)
        if key is None:
            return None
        for g in self.gpus:
            gk = _pci_key(g.pci_address)
            if gk is not None and gk[:3] == key[:3]:
                return g
        return None

    def node_of_gpu(self, ordinal: int) -> Optional[int]:
        """NUMA node of the GPU with this physical ordinal; None when unknown or absent."""
        g = self.gpu(ordinal)
        return None if g is None else self._resolve(g.numa_node)

    def nics_near(self, node: Optional[int]) -> tuple[str, ...]:
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


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_int(path: Path, base: int = 10) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _read_numa(path: Path) -> Optional[int]:
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


def _read_cpulist(path: Path) -> Optional[tuple[int, ...]]:
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


def _pci_key(address: str) -> Optional[tuple[int, int, int, int]]:
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", address.strip())
    if m is None:
        return None
    domain = int(m.group(1), 16) if m.group(1) else 0
    return domain, int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16)


def _read_gpus(root: Path) -> tuple[GpuInfo, ...]:
    found: list[tuple[tuple[int, int, int, int], str, str, Optional[int]]] = []
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


def _device_numa(dev_dir: Path) -> Optional[int]:
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
            ports.append(RdmaPort(d.name, int(p.name), node, "ACTIVE" in state.upper(), _read(p / "link_layer")))
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


# --------------------------------------------------------------------------- choice


@dataclass(frozen=True)
class AffinityConfig:
    """What the user asked for.

    ``enabled``: the off switch (nothing pinned, placed or set when False).
    ``numa_node``: force this node instead of deriving it from the buffer's device.
    ``net_devices``: a ``UCX_NET_DEVICES`` value to use instead of choosing one.
    """

    enabled: bool = True
    numa_node: Optional[int] = None
    net_devices: Optional[str] = None

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "AffinityConfig":
        """``ASTATE_AFFINITY`` (``off``/``0``/``false``/``no`` disable), ``ASTATE_NUMA_NODE``
        (an integer; empty or ``auto`` means derive), and a user-set ``UCX_NET_DEVICES``
        (non-empty), which is then kept as is. Bad values are logged and ignored."""
        env = os.environ if env is None else env
        enabled = env.get("ASTATE_AFFINITY", "").strip().lower() not in _OFF_VALUES
        numa_node: Optional[int] = None
        raw = env.get("ASTATE_NUMA_NODE", "").strip()
        if raw and raw.lower() != "auto":
            try:
                numa_node = int(raw)
                if numa_node < 0:
                    raise ValueError(raw)
            except ValueError:
                logger.warning("ignoring ASTATE_NUMA_NODE=%r: not a node number", raw)
                numa_node = None
        net = env.get("UCX_NET_DEVICES", "").strip() or None
        return cls(enabled=enabled, numa_node=numa_node, net_devices=net)


@dataclass(frozen=True)
class AffinityChoice:
    numa_node: Optional[int]  # None: unknown / no preference
    cpus: tuple[int, ...]  # CPUs to pin to (node's CPUs within the allowed set); () = don't pin
    net_devices: Optional[str]  # UCX_NET_DEVICES value; None = let UCX pick
    reason: str


def _cuda_pci_address(index: int) -> Optional[str]:
    """The PCI address torch reports for CUDA device ``index``, only if CUDA is already up."""
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        props = torch.cuda.get_device_properties(index)
        domain = getattr(props, "pci_domain_id", None)
        bus = getattr(props, "pci_bus_id", None)
        dev = getattr(props, "pci_device_id", None)
        if not all(isinstance(v, int) for v in (domain, bus, dev)):
            return None
        return f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    except Exception:  # noqa: BLE001 - affinity is a hint; never fail the caller
        return None


def _visible_to_physical(index: int, env: Mapping[str, str]) -> Optional[int]:
    """Map a process-visible CUDA ordinal through CUDA_VISIBLE_DEVICES; None if unmappable."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not all(re.fullmatch(r"\d+", e) for e in entries):
        return None  # UUIDs / MIG ids: not resolvable from sysfs
    return int(entries[index]) if 0 <= index < len(entries) else None


def _gpu_for_device(topology: Topology, index: int, env: Mapping[str, str]) -> tuple[Optional[GpuInfo], str]:
    address = _cuda_pci_address(index)
    if address is not None:
        g = topology.gpu_by_pci(address)
        if g is not None:
            return g, f"cuda:{index} at {g.pci_address} (from torch)"
    physical = _visible_to_physical(index, env)
    if physical is None:
        return None, f"cuda:{index} not mappable through CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}"
    g = topology.gpu(physical)
    if g is None:
        return None, f"cuda:{index} (physical {physical}) not found in sysfs"
    return g, f"cuda:{index} -> physical {physical} at {g.pci_address} (PCI bus id order)"


def choose(
    topology: Topology,
    device: DeviceLike,
    config: Optional[AffinityConfig] = None,
    *,
    allowed_cpus: Optional[Iterable[int]] = None,
    env: Optional[Mapping[str, str]] = None,
) -> AffinityChoice:
    """Pick the NUMA node, CPUs and UCX network devices for buffers on ``device``.

    ``config`` defaults to :meth:`AffinityConfig.from_env`. ``allowed_cpus`` defaults to
    this thread's affinity (``os.sched_getaffinity(0)``); the chosen CPUs are the node's
    CPUs within it. ``env`` (default ``os.environ``) is read for ``CUDA_VISIBLE_DEVICES``.

    CUDA device: the GPU's node. CPU (or None, or any other device type): the node of the
    allowed CPUs if they all lie on one node, else no node. Network devices: the user's
    ``config.net_devices`` if set; else, on a multi-node host, :meth:`Topology.nics_near`
    of the node joined with commas; else None (UCX picks; on a one-node host every NIC
    is local, so nothing is restricted).
    """
    config = AffinityConfig.from_env() if config is None else config
    env = os.environ if env is None else env
    if not config.enabled:
        choice = AffinityChoice(None, (), None, "affinity disabled")
        logger.info("affinity for %s: %s", device, choice.reason)
        return choice
    if allowed_cpus is None:
        try:
            allowed = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            allowed = frozenset(c for n in topology.nodes for c in n.cpus)
    else:
        allowed = frozenset(allowed_cpus)

    dev = _as_device(device)
    node: Optional[int] = None
    why: str
    if config.numa_node is not None and config.numa_node in topology.node_ids:
        node, why = config.numa_node, f"numa node {config.numa_node} forced by config"
    else:
        prefix = ""
        if config.numa_node is not None:
            logger.warning("configured numa node %d is not on this host %s; deriving it", config.numa_node, topology.node_ids)
            prefix = f"configured node {config.numa_node} absent; "
        if dev is not None and dev.type == "cuda":
            index = dev.index if dev.index is not None else _current_cuda_index()
            gpu, why = _gpu_for_device(topology, index, env)
            if gpu is not None:
                node = topology._resolve(gpu.numa_node)
                why += f", numa node {node}" if node is not None else ", numa node unknown"
        else:
            nodes = {topology.node_of_cpu(c) for c in allowed}
            if len(nodes) == 1 and None not in nodes:
                node = next(iter(nodes))
                why = f"host buffers; allowed cpus all on numa node {node}"
            else:
                why = "host buffers; allowed cpus span several numa nodes"
        why = prefix + why

    cpus = tuple(c for c in topology.cpus_of(node) if c in allowed) if node is not None else ()
    if node is not None and not cpus:
        why += "; none of its cpus are allowed, not pinning"

    if config.net_devices:
        net: Optional[str] = config.net_devices
        why += f"; UCX_NET_DEVICES={net} (user-set)"
    elif len(topology.nodes) == 1:
        net = None  # every NIC is local; restricting UCX could only lose devices
        why += "; single numa node, UCX picks the NICs"
    else:
        near = topology.nics_near(node)
        net = ",".join(near) if near else None
        why += f"; UCX_NET_DEVICES={net}" if net else "; no local NIC known, UCX picks"
    choice = AffinityChoice(node, cpus, net, why)
    logger.info("affinity for %s: node=%s cpus=%s net=%s (%s)", device, node, _fmt_cpus(cpus), net, why)
    return choice


def affinity_for(
    device: DeviceLike,
    config: Optional[AffinityConfig] = None,
    sysfs_root: PathLike = "/sys",
) -> AffinityChoice:
    """``choose(read_topology(sysfs_root), device, config)``."""
    return choose(read_topology(sysfs_root), device, config)


def _as_device(device: DeviceLike) -> Optional[torch.device]:
    if device is None:
        return None
    try:
        return device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        logger.debug("unrecognised device %r; treating as host memory", device)
        return None


def _current_cuda_index() -> int:
    try:
        if torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    return 0


def _fmt_cpus(cpus: Iterable[int]) -> str:
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) or "-"


# --------------------------------------------------------------------------- apply


def apply_env(choice: AffinityChoice, env: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set ``UCX_NET_DEVICES`` from the choice unless the user already set it (non-empty).

    Call before UCX reads its configuration (context creation). Returns True if it set it.
    """
    env = os.environ if env is None else env
    if not choice.net_devices:
        return False
    current = env.get("UCX_NET_DEVICES", "").strip()
    if current:
        if current != choice.net_devices:
            logger.info("UCX_NET_DEVICES=%s set by the user; not replacing it with %s", current, choice.net_devices)
        return False
    env["UCX_NET_DEVICES"] = choice.net_devices
    logger.info("set UCX_NET_DEVICES=%s", choice.net_devices)
    return True


def pin_current_thread(cpus: Iterable[int]) -> Optional[frozenset[int]]:
    """Pin the calling thread to ``cpus``; return its previous CPU set, or None if nothing changed.

    On Linux ``sched_setaffinity(0, ...)`` acts on the calling thread only. Empty ``cpus``,
    a platform without affinity support, or a set the kernel refuses (no allowed CPU in it)
    is a no-op with a debug log.
    """
    wanted = frozenset(cpus)
    if not wanted:
        logger.debug("no cpus to pin to; leaving thread affinity alone")
        return None
    if not hasattr(os, "sched_setaffinity"):
        logger.debug("thread pinning unsupported on this platform")
        return None
    try:
        previous = frozenset(os.sched_getaffinity(0))
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        logger.debug("could not pin thread to cpus %s: %s", _fmt_cpus(wanted), exc)
        return None
    logger.debug("pinned thread %d to cpus %s", threading.get_native_id(), _fmt_cpus(wanted))
    return previous


@contextlib.contextmanager
def pinned(cpus: Iterable[int]) -> Iterator[Optional[frozenset[int]]]:
    """Pin the calling thread to ``cpus`` for the block, then restore; yields the previous set."""
    previous = pin_current_thread(cpus)
    try:
        yield previous
    finally:
        if previous is not None:
            try:
                os.sched_setaffinity(0, previous)
            except OSError as exc:
                logger.debug("could not restore thread affinity: %s", exc)


# --------------------------------------------------------------------------- memory placement

_MPOL_PREFERRED = 1
_MPOL_BIND = 2
_MPOL_F_NODE = 1
_MPOL_F_ADDR = 2

# (mbind, get_mempolicy) syscall numbers, used when libnuma is not installed.
_SYSCALLS = {
    "x86_64": (237, 239),
    "amd64": (237, 239),
    "aarch64": (235, 236),
    "arm64": (235, 236),
    "riscv64": (235, 236),
    "ppc64le": (259, 260),
    "ppc64": (259, 260),
}


class _NumaCalls:
    """mbind / get_mempolicy through libnuma's wrappers, else the raw syscalls via libc."""

    def __init__(self) -> None:
        self.mbind = None
        self.get_mempolicy = None
        if not sys.platform.startswith("linux"):
            return
        for name in ("libnuma.so.1", ctypes.util.find_library("numa")):
            if not name:
                continue
            try:
                lib = ctypes.CDLL(name, use_errno=True)
                mb, gm = lib.mbind, lib.get_mempolicy
            except (OSError, AttributeError):
                continue
            mb.restype = ctypes.c_long
            mb.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_uint]
            gm.restype = ctypes.c_long
            gm.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong]
            self.mbind, self.get_mempolicy = mb, gm
            return
        numbers = _SYSCALLS.get(platform.machine().lower())
        if numbers is None:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            syscall = libc.syscall
        except (OSError, AttributeError):
            return
        syscall.restype = ctypes.c_long
        nr_mbind, nr_getmp = numbers

        def mbind(addr, length, mode, mask, maxnode, flags):  # type: ignore[no-untyped-def]
            return syscall(
                ctypes.c_long(nr_mbind), ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(mode),
                mask, ctypes.c_ulong(maxnode), ctypes.c_uint(flags),
            )

        def get_mempolicy(mode_ptr, mask, maxnode, addr, flags):  # type: ignore[no-untyped-def]
            return syscall(
                ctypes.c_long(nr_getmp), mode_ptr, mask, ctypes.c_ulong(maxnode), ctypes.c_void_p(addr),
                ctypes.c_ulong(flags),
            )

        self.mbind, self.get_mempolicy = mbind, get_mempolicy


_numa_calls: Optional[_NumaCalls] = None
_numa_lock = threading.Lock()


def _calls() -> _NumaCalls:
    global _numa_calls
    with _numa_lock:
        if _numa_calls is None:
            _numa_calls = _NumaCalls()
        return _numa_calls


def _mbind(addr: int, length: int, node: int, strict: bool) -> Optional[str]:
    """Bind [addr, addr+length) to ``node``; None on success, else why not."""
    calls = _calls()
    if calls.mbind is None:
        return "mbind unavailable"
    bits = 64
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    # The kernel reads maxnode-1 bits (a historical off-by-one libnuma also compensates for).
    rc = calls.mbind(addr, length, _MPOL_BIND if strict else _MPOL_PREFERRED, mask, words * bits + 1, 0)
    if rc != 0:
        return f"mbind failed: {os.strerror(ctypes.get_errno())}"
    return None


def node_of_address(address: int) -> Optional[int]:
    """NUMA node of the (already touched) page holding ``address``; None if unknown."""
    calls = _calls()
    if calls.get_mempolicy is None:
        return None
    node = ctypes.c_int(-1)
    rc = calls.get_mempolicy(ctypes.byref(node), None, 0, address, _MPOL_F_NODE | _MPOL_F_ADDR)
    return node.value if rc == 0 and node.value >= 0 else None


def _touch(t: torch.Tensor, page: int) -> None:
    # One write per page, single-threaded (torch would fan large fills out to unpinned
    # intra-op threads, defeating first touch).
    try:
        t.numpy()[::page] = 0
    except (RuntimeError, TypeError):  # torch without numpy
        t.view(-1, page)[:, 0] = 0


def alloc_on_node(
    nbytes: int,
    node: Optional[int],
    *,
    strict: bool = False,
    shared: bool = False,
    sysfs_root: PathLike = "/sys",
) -> torch.Tensor:
    """A CPU uint8 tensor of ``nbytes`` whose pages live on NUMA ``node`` (best effort).

    ``shared``: back it with a sealed memfd (``transport.memfd``) that same-host consumers
    can map and copy from at memcpy speed; anonymous memory where that fails.

    The memory is a fresh mapping (page aligned, untouched), wrapped with
    ``torch.frombuffer`` so the tensor owns it: unmapped when the last view goes, and any
    memory policy goes with it instead of lingering in the allocator's heap. Placement:

    1. ``mbind`` (MPOL_PREFERRED, or MPOL_BIND with ``strict``) on the range before the
       first touch, via libnuma's wrapper or the raw syscall, then touch every page;
    2. else first touch from a helper thread pinned to the node's CPUs;
    3. else (or for ``node`` None, or ``nbytes`` 0) plain allocation, with a debug log.

    Never raises for placement reasons. Contents are unspecified (a placed buffer is
    zero-filled, as a fresh mapping is).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    page = mmap.PAGESIZE
    length = -(-nbytes // page) * page
    mm = shared_mapping(length) if shared else None
    try:
        if mm is None:
            mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError) as exc:
        logger.debug("anonymous mmap of %d bytes failed (%s); plain allocation", length, exc)
        return torch.empty(nbytes, dtype=torch.uint8)
    # Transparent huge pages: remote cma reads of huge-page memory measured ~2x faster here.
    if hasattr(mmap, "MADV_HUGEPAGE") and length >= (2 << 20):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    del mm  # the tensor's storage keeps the mapping alive
    t = whole[:nbytes]
    if node is None:
        return t

    why = _mbind(whole.data_ptr(), length, node, strict)
    if why is None:
        # No touch here: the policy places each page on whichever thread first writes it, so
        # the first copy into the buffer (multi-threaded) pays the faults, not one thread now
        # (page faults cost ~2.5 us per 4 KiB page on a VM: ~0.6 s per GiB).
        logger.debug("allocated %d bytes on numa node %d via mbind", nbytes, node)
        return t

    cpus = read_topology(sysfs_root).cpus_of(node)
    try:
        allowed = frozenset(os.sched_getaffinity(0))
        cpus = tuple(c for c in cpus if c in allowed)
    except (AttributeError, OSError):
        cpus = ()
    if cpus:
        result: list[Optional[BaseException]] = [None]
        ok = [False]

        def toucher() -> None:
            try:
                ok[0] = pin_current_thread(cpus) is not None
                _touch(whole, page)
            except BaseException as exc:  # noqa: BLE001
                result[0] = exc

        th = threading.Thread(target=toucher, name="astate-first-touch", daemon=True)
        th.start()
        th.join()
        if result[0] is None and ok[0]:
            logger.debug("allocated %d bytes on numa node %d by first touch (%s)", nbytes, node, why)
            return t
    # The mapping is still a valid allocation; its pages fault in wherever the kernel likes.
    logger.debug("could not place %d bytes on numa node %d (%s); plain allocation", nbytes, node, why)
    return t
