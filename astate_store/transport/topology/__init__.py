"""NUMA and NIC affinity: keep copies, progress threads and the NIC next to the buffers.

On a two-socket host a GPU, its staging memory, the thread that drives it and the NIC
that carries its bytes should all sit on the same socket; crossing the inter-socket link
costs bandwidth and latency on every transfer. This package, by role:

* ``discovery`` reads the machine from sysfs (:func:`read_topology`): NUMA nodes and their
  CPUs, GPUs with their PCI address and NUMA node, RDMA ports and ethernet interfaces with
  theirs. A file that is missing or unreadable never raises;
* ``policy`` decides (:func:`choose`) which node, CPUs and UCX network devices suit a buffer
  on a given device, honouring the user's configuration (:class:`AffinityConfig`, with an
  off switch) and never overriding a user-set ``UCX_NET_DEVICES``; :func:`apply_env` sets
  that variable before UCX is initialised;
* ``numa`` applies the choice: :func:`pin_current_thread` / :func:`pinned` (progress and
  copy threads) and :func:`alloc_on_node` (host staging memory placed on the node).

Data flows one way: discovery -> policy -> numa. Everything logs on
``astate_store.transport.topology``.

Typical use (what ``StoreContext`` does)::

    choice = affinity_for(device)        # 1. read sysfs, 2. choose
    apply_env(choice)                    # 3. UCX_NET_DEVICES, before UCX starts
    buf = alloc_on_node(n, choice.numa_node)   # 4. staging memory on the node
    with pinned(choice.cpus): ...        # 5. threads on the node's CPUs
"""

from astate_store.transport.topology.discovery import (
    GpuInfo,
    NetInterface,
    NumaNode,
    RdmaPort,
    Topology,
    parse_cpulist,
    read_topology,
)
from astate_store.transport.topology.numa import alloc_on_node, node_of_address, pin_current_thread, pinned
from astate_store.transport.topology.policy import (
    AffinityChoice,
    AffinityConfig,
    affinity_for,
    apply_env,
    choose,
)

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
