"""Network profiles on one machine: ranks in network namespaces joined by a Linux bridge.

Each rank gets its own namespace ``ccbn-<pid>-<run>-r<rank>`` holding one end of a veth pair (named
``eth0`` inside, with address ``10.213.0.<rank+1>/24``); the other end is enslaved to a per-run bridge.
A shaped profile puts a token-bucket filter (``tc qdisc ... tbf``) on *both* ends of every veth, so
each rank has a full-duplex link of the profile's rate into the bridge (a switch with 1 or 10 Gbit/s
ports). netem is not available on these machines, so the link adds no delay beyond the kernel's own.

Everything is torn down on ``close()``, when the ``with`` block exits (also by an exception), at
interpreter exit, and on SIGINT/SIGTERM/SIGHUP. Names carry the creating process's pid, so
:func:`cleanup_stale` removes leftovers of dead runs without touching a live run's namespaces.
Creating namespaces needs root (CAP_NET_ADMIN); :func:`check_privileges` says so clearly.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Dict, List, Optional, Sequence

__all__ = [
    "Profile",
    "PROFILES",
    "NetnsError",
    "Network",
    "check_privileges",
    "cleanup_stale",
    "list_ours",
]

NS_PREFIX = "ccbn-"
LINK_PREFIX = "cb"
SUBNET = "10.213.0"  # a private /24, configured inside our namespaces (and on the bridge on demand)
HOST_ADDRESS = f"{SUBNET}.254"  # the launcher's address on the bridge: Network.host_address()
_NS_RE = re.compile(r"^ccbn-(\d+)-(\d+)-r(\d+)$")
_LINK_RE = re.compile(r"^cb([0-9a-f]+)x(\d+)(h\d+|br)$")
_counter = itertools.count()
#: the most ranks a network holds (addresses .1 to .250 of the subnet)
MAX_WORLD = 250


class NetnsError(RuntimeError):
    """The namespace harness cannot run here (not root, no ``ip netns``) or a command failed."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """A network profile.

    Attributes
    ----------
    name : str
        ``eth1g``, ``eth10g``, ``eth25g``, ``unshaped`` or ``loopback``.
    netns : bool
        Whether ranks run in their own namespaces (False: all on 127.0.0.1, the fast fabric here).
    rate : str or None
        tbf rate per direction per rank link (``"1gbit"``), None for no shaping.
    burst, latency : str
        tbf bucket size and queueing limit.
    gbit : float or None
        ``rate`` in Gbit/s, for reports.
    """

    name: str
    netns: bool
    rate: Optional[str] = None
    burst: str = ""
    latency: str = ""
    gbit: Optional[float] = None
    description: str = ""


PROFILES: Dict[str, Profile] = {
    "eth1g": Profile(
        "eth1g", True, "1gbit", "256kb", "50ms", 1.0, "namespaces + bridge, tbf 1 Gbit/s each way"
    ),
    "eth10g": Profile(
        "eth10g", True, "10gbit", "2mb", "20ms", 10.0, "namespaces + bridge, tbf 10 Gbit/s each way"
    ),
    "eth25g": Profile(
        "eth25g", True, "25gbit", "4mb", "20ms", 25.0, "namespaces + bridge, tbf 25 Gbit/s each way"
    ),
    "unshaped": Profile("unshaped", True, description="namespaces + bridge, no shaping"),
    "loopback": Profile(
        "loopback", False, description="no namespaces: 127.0.0.1 (shared memory fast path)"
    ),
}


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60
    )
    if check and p.returncode != 0:
        raise NetnsError(f"command failed ({p.returncode}): {' '.join(cmd)}: {p.stderr.strip()}")
    return p


def check_privileges() -> None:
    """Raise :class:`NetnsError` unless namespaces, bridges and tc can be used here.

    Raises
    ------
    NetnsError
        Not root, ``ip``/``tc`` missing, or ``ip netns`` does not work; the message says which.
    """
    if os.geteuid() != 0:
        raise NetnsError(
            "the network-namespace profiles (eth1g, eth10g, unshaped) need root (CAP_NET_ADMIN) to "
            "create namespaces, a bridge and tc qdiscs; run as root or use --profile loopback"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsError(
                f"'{tool}' (iproute2) is not installed; it is needed for network profiles"
            )
    p = _run(["ip", "netns", "list"], check=False)
    if p.returncode != 0:
        raise NetnsError(f"'ip netns' does not work here: {p.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside namespace ``name`` (ranks of a launcher that could not end
    them: mpirun's, when the launching process was killed), then delete it."""
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name], check=False)


def list_ours() -> Dict[str, List[str]]:
    """Namespaces and links (veth host ends, bridges) whose names carry our prefix.

    Returns
    -------
    dict
        ``{"netns": [...], "links": [...]}``.
    """
    ns = []
    p = _run(["ip", "netns", "list"], check=False)
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _NS_RE.match(name):
            ns.append(name)
    links = []
    p = _run(["ip", "-o", "link", "show"], check=False)
    for line in p.stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if _LINK_RE.match(name):
                links.append(name)
    return {"netns": ns, "links": links}


def cleanup_stale(all_runs: bool = False) -> List[str]:
    """Delete our namespaces and links left behind by runs whose process is gone.

    Parameters
    ----------
    all_runs : bool
        Also delete those of live processes (use only when no benchmark is running).

    Returns
    -------
    list of str
        What was deleted.
    """
    gone = []
    found = list_ours()
    for name in found["netns"]:
        pid = int(_NS_RE.match(name).group(1))  # type: ignore[union-attr]
        if all_runs or not _pid_alive(pid):
            _delete_namespace(name)
            gone.append(name)
    for name in found["links"]:
        pid = int(_LINK_RE.match(name).group(1), 16)  # type: ignore[union-attr]
        if all_runs or not _pid_alive(pid):
            _run(["ip", "link", "del", name], check=False)
            gone.append(name)
    return gone


_live: "set[Network]" = set()
_handlers_installed = False
_lock = threading.Lock()


def _teardown_all() -> None:
    for net in list(_live):
        net.close()


def _on_signal(signum: int, frame: object) -> None:
    _teardown_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    global _handlers_installed
    with _lock:
        if _handlers_installed:
            return
        atexit.register(_teardown_all)
        if threading.current_thread() is threading.main_thread():
            # SIGHUP: the terminal closed (an ssh session ended), which ends the run as SIGTERM
            for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
                if sig is None:
                    continue
                if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                    signal.signal(sig, _on_signal)
        _handlers_installed = True


class Network:
    """``world_size`` ranks, each in a namespace, joined by a bridge; shaped per ``profile``.

    Use as a context manager; the namespaces exist inside the block and are gone after it, also
    when it raises. For ``profile.netns == False`` nothing is created and every rank uses 127.0.0.1.

    Parameters
    ----------
    profile : Profile or str
        One of :data:`PROFILES` (or its name).
    world_size : int
        Number of ranks (1..250).
    """

    def __init__(self, profile, world_size: int) -> None:
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        if not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"Network: argument 'world_size' must be in 1..{MAX_WORLD}, "
                             f"got {world_size}")
        self.world_size = world_size
        self.run_id = next(_counter)
        self.pid = os.getpid()
        self.namespaces: List[str] = []
        self.bridge = ""
        self._host_links: List[str] = []
        self._up = False
        self._host_address = False

    # names -------------------------------------------------------------------------------------
    def ns_name(self, rank: int) -> str:
        return f"{NS_PREFIX}{self.pid}-{self.run_id}-r{rank}"

    def _link(self, suffix: str) -> str:
        name = f"{LINK_PREFIX}{self.pid:x}x{self.run_id}{suffix}"
        if len(name) > 15:
            raise NetnsError(f"interface name {name!r} is longer than 15 characters")
        return name

    def address(self, rank: int) -> str:
        """IPv4 address rank ``rank`` listens on."""
        return f"{SUBNET}.{rank + 1}" if self.profile.netns else "127.0.0.1"

    def ifname(self, rank: int) -> str:
        """Interface rank ``rank`` should use (GLOO_SOCKET_IFNAME)."""
        return "eth0" if self.profile.netns else "lo"

    def command_prefix(self, rank: int) -> List[str]:
        """Argv prefix that runs a command inside rank ``rank``'s namespace (empty for loopback)."""
        return ["ip", "netns", "exec", self.ns_name(rank)] if self.profile.netns else []

    def host_address(self) -> str:
        """Give the launching namespace the address :data:`HOST_ADDRESS` on the bridge; return it.

        Ranks can then reach servers of the launcher through their links (mpirun's PMIx server,
        which the ranks of an MPI job must reach before MPI starts). Only one network at a time
        can hold it (each would add a route to the subnet): a second one raises
        :class:`NetnsError`. Loopback profiles: ``127.0.0.1``.
        """
        if not self.profile.netns:
            return "127.0.0.1"
        if not self._up:
            raise NetnsError("Network.host_address: the network is not open")
        if not self._host_address:
            held = _run(["ip", "-o", "-4", "addr", "show", "to", f"{HOST_ADDRESS}/32"]).stdout
            if held.strip():
                raise NetnsError(f"{HOST_ADDRESS} is already held by another run's bridge "
                                 f"({held.split()[1]}): run one MPI benchmark at a time")
            _run(["ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", self.bridge])
            self._host_address = True
        return HOST_ADDRESS

    # lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "Network":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create the namespaces, bridge, veths, addresses and qdiscs (tearing down on failure)."""
        if not self.profile.netns or self._up:
            return
        check_privileges()
        cleanup_stale()
        _install_handlers()
        _live.add(self)
        self._up = True
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        p = self.profile
        self.bridge = self._link("br")
        _run(
            [
                "ip",
                "link",
                "add",
                self.bridge,
                "type",
                "bridge",
                "stp_state",
                "0",
                "forward_delay",
                "0",
            ]
        )
        _run(["ip", "link", "set", self.bridge, "up"])
        for r in range(self.world_size):
            ns, host = self.ns_name(r), self._link(f"h{r}")
            peer = self._link(f"p{r}")
            _run(["ip", "netns", "add", ns])
            self.namespaces.append(ns)
            _run(["ip", "link", "add", host, "type", "veth", "peer", "name", peer])
            self._host_links.append(host)
            _run(["ip", "link", "set", peer, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", peer, "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", host, "master", self.bridge])
            _run(["ip", "link", "set", host, "up"])
            if p.rate:
                tbf = ["tbf", "rate", p.rate, "burst", p.burst, "latency", p.latency]
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf])
                _run(["tc", "qdisc", "add", "dev", host, "root", *tbf])

    def close(self) -> None:
        """Delete everything this network created; safe to call more than once."""
        if not self._up:
            return
        for ns in self.namespaces:
            _delete_namespace(ns)  # takes the veth pair with it
        for host in self._host_links:
            if _run(["ip", "link", "show", host], check=False).returncode == 0:
                _run(["ip", "link", "del", host], check=False)
        if self.bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
        self.namespaces, self._host_links, self.bridge = [], [], ""
        self._up = self._host_address = False
        _live.discard(self)

    def env(self, rank: int, master_port: int) -> Dict[str, str]:
        """Environment for rank ``rank``: torch.distributed rendezvous and gloo interface selection."""
        return {
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "GLOO_SOCKET_IFNAME": self.ifname(rank),
        }

    def nccl_env(self, rank: int, gpus: int = 1) -> Dict[str, str]:
        """Environment that makes rank ``rank`` an emulated host for NCCL.

        A distinct ``NCCL_HOSTID`` per rank makes NCCL treat the ranks as separate hosts (so several
        ranks may share one GPU) and use its socket transport over the rank's interface
        (``NCCL_SOCKET_IFNAME``), i.e. over the shaped veth of a namespace profile; InfiniBand, P2P,
        shared memory and NVLink SHARP are off. ``LOCAL_RANK`` = ``rank % gpus`` picks the GPU.
        """
        return {
            "NCCL_HOSTID": f"compcomm-bench-{self.pid}-{self.run_id}-host{rank}",
            "NCCL_SOCKET_IFNAME": self.ifname(rank),
            "NCCL_IB_DISABLE": "1",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_NVLS_ENABLE": "0",
            "LOCAL_RANK": str(rank % max(1, gpus)),
        }
