"""Which NUMA node, CPUs and NICs suit a buffer: the affinity choice, and applying it to UCX.

:func:`choose` decides from a :class:`~.discovery.Topology` and the user's
:class:`AffinityConfig` (with an off switch); it never overrides a user-set
``UCX_NET_DEVICES``, and logs the choice at info level on ``astate_store.transport.topology``.
:func:`apply_env` then sets ``UCX_NET_DEVICES`` before UCX is initialised.

CUDA ordinals. sysfs knows PCI addresses, not CUDA ordinals. When CUDA is already
initialised in this process and torch reports the device's PCI address, the GPU is found
by address (exact, whatever ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` say).
Otherwise the ordinal is taken to count GPUs in PCI bus id order, which is what CUDA does
with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and, on a host with identical GPUs, usually does by
default), after mapping it through an all-integer ``CUDA_VISIBLE_DEVICES``. A
``CUDA_VISIBLE_DEVICES`` of UUIDs cannot be mapped from sysfs; the node is then unknown
and nothing is pinned. ROCm builds of torch expose AMD GPUs as ``cuda``: when the host has
no NVIDIA GPU, ordinals count the AMD ones.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Union

import torch

from astate_store.transport.topology.discovery import (
    GpuInfo,
    PathLike,
    Topology,
    format_cpulist,
    logger,
    read_topology,
)

__all__ = ["AffinityConfig", "AffinityChoice", "DeviceLike", "choose", "affinity_for", "apply_env"]

DeviceLike = Union[torch.device, str, None]

_OFF_VALUES = frozenset({"off", "0", "false", "no", "disable", "disabled"})


@dataclass(frozen=True)
class AffinityConfig:
    """What the user asked for.

    ``enabled``: the off switch (nothing pinned, placed or set when False).
    ``numa_node``: force this node instead of deriving it from the buffer's device.
    ``net_devices``: a ``UCX_NET_DEVICES`` value to use instead of choosing one.
    """

    enabled: bool = True
    numa_node: int | None = None
    net_devices: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AffinityConfig:
        """``ASTATE_AFFINITY`` (``off``/``0``/``false``/``no`` disable), ``ASTATE_NUMA_NODE``
        (an integer; empty or ``auto`` means derive), and a user-set ``UCX_NET_DEVICES``
        (non-empty), which is then kept as is. Bad values are logged and ignored."""
        env = os.environ if env is None else env
        enabled = env.get("ASTATE_AFFINITY", "").strip().lower() not in _OFF_VALUES
        numa_node: int | None = None
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
    numa_node: int | None  # None: unknown / no preference
    cpus: tuple[int, ...]  # CPUs to pin to (node's CPUs within the allowed set); () = don't pin
    net_devices: str | None  # UCX_NET_DEVICES value; None = let UCX pick
    reason: str


def _cuda_pci_address(index: int) -> str | None:
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


def _visible_to_physical(index: int, env: Mapping[str, str]) -> int | None:
    """Map a process-visible CUDA ordinal through CUDA_VISIBLE_DEVICES; None if unmappable."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not all(re.fullmatch(r"\d+", e) for e in entries):
        return None  # UUIDs / MIG ids: not resolvable from sysfs
    return int(entries[index]) if 0 <= index < len(entries) else None


def _gpu_for_device(topology: Topology, index: int, env: Mapping[str, str]) -> tuple[GpuInfo | None, str]:
    address = _cuda_pci_address(index)
    if address is not None:
        g = topology.gpu_by_pci(address)
        if g is not None:
            return g, f"cuda:{index} at {g.pci_address} (from torch)"
    physical = _visible_to_physical(index, env)
    if physical is None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        return None, f"cuda:{index} not mappable through CUDA_VISIBLE_DEVICES={visible!r}"
    g = topology.gpu(physical)
    if g is None:
        return None, f"cuda:{index} (physical {physical}) not found in sysfs"
    return g, f"cuda:{index} -> physical {physical} at {g.pci_address} (PCI bus id order)"


def choose(
    topology: Topology,
    device: DeviceLike,
    config: AffinityConfig | None = None,
    *,
    allowed_cpus: Iterable[int] | None = None,
    env: Mapping[str, str] | None = None,
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

    Call sequence:

    1. :func:`_allowed` -- the CPUs this thread may run on;
    2. :func:`_choose_node` -- forced by config, else derived from the device;
    3. the node's CPUs within the allowed set (none allowed: nothing is pinned);
    4. :func:`_choose_net` -- the ``UCX_NET_DEVICES`` value, if any.
    """
    config = AffinityConfig.from_env() if config is None else config
    env = os.environ if env is None else env
    if not config.enabled:
        choice = AffinityChoice(None, (), None, "affinity disabled")
        logger.info("affinity for %s: %s", device, choice.reason)
        return choice
    allowed = _allowed(topology, allowed_cpus)
    node, why = _choose_node(topology, device, config, allowed, env)

    cpus = tuple(c for c in topology.cpus_of(node) if c in allowed) if node is not None else ()
    if node is not None and not cpus:
        why += "; none of its cpus are allowed, not pinning"

    net, net_why = _choose_net(topology, node, config)
    why += net_why
    choice = AffinityChoice(node, cpus, net, why)
    logger.info("affinity for %s: node=%s cpus=%s net=%s (%s)", device, node, format_cpulist(cpus), net, why)
    return choice


def _allowed(topology: Topology, allowed_cpus: Iterable[int] | None) -> frozenset[int]:
    """The caller's CPUs, else this thread's affinity, else every CPU the topology knows."""
    if allowed_cpus is not None:
        return frozenset(allowed_cpus)
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(c for n in topology.nodes for c in n.cpus)


def _choose_node(
    topology: Topology,
    device: DeviceLike,
    config: AffinityConfig,
    allowed: frozenset[int],
    env: Mapping[str, str],
) -> tuple[int | None, str]:
    """The node for ``device`` and why: the configured one if this host has it, else derived."""
    if config.numa_node is not None and config.numa_node in topology.node_ids:
        return config.numa_node, f"numa node {config.numa_node} forced by config"
    prefix = ""
    if config.numa_node is not None:
        logger.warning(
            "configured numa node %d is not on this host %s; deriving it", config.numa_node, topology.node_ids
        )
        prefix = f"configured node {config.numa_node} absent; "
    dev = _as_device(device)
    if dev is not None and dev.type == "cuda":
        node, why = _node_of_cuda(topology, dev, env)
    else:
        node, why = _node_of_cpus(topology, allowed)
    return node, prefix + why


def _node_of_cuda(topology: Topology, dev: torch.device, env: Mapping[str, str]) -> tuple[int | None, str]:
    """The NUMA node of the GPU behind a CUDA device (None when not found or unknown)."""
    index = dev.index if dev.index is not None else _current_cuda_index()
    gpu, why = _gpu_for_device(topology, index, env)
    if gpu is None:
        return None, why
    node = topology._resolve(gpu.numa_node)
    return node, why + (f", numa node {node}" if node is not None else ", numa node unknown")


def _node_of_cpus(topology: Topology, allowed: frozenset[int]) -> tuple[int | None, str]:
    """Host buffers: the node of the allowed CPUs when they all lie on one node."""
    nodes = {topology.node_of_cpu(c) for c in allowed}
    if len(nodes) == 1 and None not in nodes:
        node = next(iter(nodes))
        return node, f"host buffers; allowed cpus all on numa node {node}"
    return None, "host buffers; allowed cpus span several numa nodes"


def _choose_net(topology: Topology, node: int | None, config: AffinityConfig) -> tuple[str | None, str]:
    """The ``UCX_NET_DEVICES`` value (None: UCX picks) and the reason's suffix."""
    if config.net_devices:
        return config.net_devices, f"; UCX_NET_DEVICES={config.net_devices} (user-set)"
    if len(topology.nodes) == 1:
        # Every NIC is local; restricting UCX could only lose devices.
        return None, "; single numa node, UCX picks the NICs"
    near = topology.nics_near(node)
    net = ",".join(near) if near else None
    return net, f"; UCX_NET_DEVICES={net}" if net else "; no local NIC known, UCX picks"


def affinity_for(
    device: DeviceLike, config: AffinityConfig | None = None, sysfs_root: PathLike = "/sys"
) -> AffinityChoice:
    """``choose(read_topology(sysfs_root), device, config)``; this machine's own ``/sys`` is read
    at most once per ``_TOPOLOGY_SECONDS`` (a process opening 1,000 sessions reads ~20 sysfs
    files once, not per session)."""
    if str(sysfs_root) != "/sys":
        return choose(read_topology(sysfs_root), device, config)
    global _machine
    now = time.monotonic()
    if _machine is None or now - _machine[0] > _TOPOLOGY_SECONDS:
        _machine = (now, read_topology(sysfs_root))  # a race reads it twice: harmless
    return choose(_machine[1], device, config)


# The machine's topology read last, and when (``affinity_for``): NUMA nodes, GPUs and NICs do not
# change under a process; a NIC's link state may, so it is read again after a while.
_TOPOLOGY_SECONDS = 30.0
_machine: tuple[float, Topology] | None = None


def _as_device(device: DeviceLike) -> torch.device | None:
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


def apply_env(choice: AffinityChoice, env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``UCX_NET_DEVICES`` from the choice unless the user already set it (non-empty).

    Call before UCX reads its configuration (context creation). Returns True if it set it.
    """
    env = os.environ if env is None else env
    if not choice.net_devices:
        return False
    current = env.get("UCX_NET_DEVICES", "").strip()
    if current:
        if current != choice.net_devices:
            logger.info(
                "UCX_NET_DEVICES=%s set by the user; not replacing it with %s", current, choice.net_devices
            )
        return False
    env["UCX_NET_DEVICES"] = choice.net_devices
    logger.info("set UCX_NET_DEVICES=%s", choice.net_devices)
    return True
