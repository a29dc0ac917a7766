"""A small lab of Linux network namespaces: hosts on a shared "public" segment, NAT routers, capped links.

Needs root and iproute2 (`ip`, `tc`); `nat()` also needs `iptables`. Everything lives in namespaces this
module creates, under private 10.x addresses, so no packet leaves the machine:

    with Network(prefix="mm") as net:
        pub = net.host("pub")                      # on the public bridge, 10.P.0.N
        home = net.nat("home1")                    # a NAT router: MASQUERADE, drops unsolicited inbound
        b = net.host("b", behind=home, link_mbit=20)
        proc = b.popen(["python", "-m", "..."])    # killed by PID on teardown
        b.adopt(forked)                            # a process that entered `b` itself (`enter_namespace`)

Teardown (the `with` exit, also on an exception or KeyboardInterrupt) kills every process started through
`popen` or adopted, deletes every namespace (which takes their veth ends with it) and the bridge namespace.
Names carry the prefix and this process's id, so parallel runs don't collide; leftovers of a dead process
with the same prefix are removed on entry.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NetnsError", "Network", "Netns", "Nat", "enter_namespace", "netns_unavailable_reason"]
_CLONE_NEWNET = 0x40000000  # <sched.h>; Python 3.11's os has no setns


class NetnsError(RuntimeError):
    """A namespace command failed; the message names the command and its stderr."""


def netns_unavailable_reason(need_iptables: bool = False) -> str | None:
    """None when this machine can build namespaces, else one line saying why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc") + (("iptables",) if need_iptables else ()):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables)"
    return None


def enter_namespace(name: str) -> None:
    """Moves the calling process into network namespace `name` (one `ip netns add` made), as `ip netns exec` would.

    For a freshly forked child, before it opens a socket: a process forked from a preloaded server
    starts in a second instead of the several a fresh interpreter needs to import torch. Raises
    `NetnsError` naming the namespace when there is no such namespace or the kernel refuses (not root).
    """
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(f"namespace {name}: {e.strerror}") from None
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise NetnsError(f"setns into namespace {name}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs one command (bounded by a timeout); raises NetnsError naming it when it fails and `check`."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass
class Netns:
    """One namespace: `name` for `ip netns exec`, `address` its IP on its uplink segment."""

    network: "Network"
    name: str
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Runs a command inside this namespace and waits for it (30 s cap)."""
        return _run("ip", "netns", "exec", self.name, *args, check=check)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` inside this namespace; the network kills it by PID on teardown."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def adopt(self, proc: Any) -> Any:
        """Tracks `proc` (Popen-like, its own process group), which entered this namespace itself
        (`enter_namespace`), so that teardown kills it by PID like the processes of `popen`."""
        self.processes.append(proc)
        return proc


@dataclass
class Nat(Netns):
    """A NAT router: `address` is its public side; `lan_prefix` the home segment behind it (x.y.z)."""

    lan_prefix: str = ""
    hosts_behind: int = 0


class Network:
    """Owns a bridge namespace (the "public" segment), hosts and NAT routers; tears all of them down.

    Use as a context manager. Each instance picks its own 10.P.*.* range from its names, so two
    networks in one machine (or leftovers) never share addresses or names.
    """

    def __init__(self, prefix: str = "mm") -> None:
        if not prefix.isalnum() or len(prefix) > 4:
            raise ValueError(f"prefix must be 1-4 alphanumerics, got {prefix!r}")
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}"
        # Second octet from the tag: distinct runs rarely share a range; it is all private anyway.
        self.octet = 16 + zlib.crc32(self.tag.encode()) % 200
        self.bridge_ns = f"{self.tag}-br"
        self.namespaces: list[Netns] = []
        self._next_host = 1
        self._next_lan = 1
        self._links = 0

    # -- lifecycle --------------------------------------------------------------------------------------

    def __enter__(self) -> "Network":
        self.remove_leftovers()
        try:
            _run("ip", "netns", "add", self.bridge_ns)
            self._in_bridge("ip", "link", "add", "br0", "type", "bridge")
            self._in_bridge("ip", "link", "set", "br0", "up")
            self._in_bridge("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kills every tracked process (SIGTERM, then SIGKILL after 3 s) and deletes every namespace."""
        for ns in self.namespaces:
            for proc in ns.processes:
                _stop(proc)
        for name in [ns.name for ns in reversed(self.namespaces)] + [self.bridge_ns]:
            _kill_namespace_pids(name)
            _run("ip", "netns", "del", name, check=False)
        self.namespaces.clear()

    def remove_leftovers(self) -> None:
        """Deletes namespaces named `<prefix><pid>-*` whose creating process is gone (or is this one)."""
        listing = _run("ip", "netns", "list", check=False).stdout.split()
        for name in listing:
            if not name.startswith(self.prefix) or "-" not in name:
                continue
            pid = name[len(self.prefix):].split("-", 1)[0]
            if not pid.isdigit():
                continue
            if int(pid) == os.getpid() or not _pid_alive(int(pid)):
                _kill_namespace_pids(name)
                _run("ip", "netns", "del", name, check=False)

    # -- building ---------------------------------------------------------------------------------------

    def host(self, label: str, behind: Nat | None = None, link_mbit: float | None = None, side: int = 0) -> Netns:
        """A namespace on the public bridge, or on `behind`'s home segment, with a default route.

        `link_mbit` caps its uplink with a token bucket on both veth ends (so both directions).
        `side=1` puts a public host on a second bridge of the same segment, joined to the first by
        one link that `join_sides(False)` cuts (a partition) and `join_sides(True)` restores.
        """
        if side not in (0, 1) or (side and behind is not None):
            raise ValueError(f"side must be 0 or 1 (1 only for a public host), got {side!r}")
        ns = Netns(self, self._ns_name(label), "")
        self._add(ns)
        if behind is None:
            ns.address = self._attach_public(ns, link_mbit, self._side_bridge(side))
        else:
            behind.hosts_behind += 1
            if behind.hosts_behind > 250:
                raise NetnsError(f"{behind.name}: home segment is full (250 hosts)")
            ns.address = f"{behind.lan_prefix}.{behind.hosts_behind + 1}"
            inner, outer = self._veth(ns.name, behind.name)
            _run("ip", "-n", behind.name, "link", "set", outer, "master", "lan0")
            _run("ip", "-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", inner)
            ns.run("ip", "route", "add", "default", "via", f"{behind.lan_prefix}.1")
            self._cap(ns.name, inner, behind.name, outer, link_mbit)
        return ns

    def nat(self, label: str, random_fully: bool = False) -> Nat:
        """A home router: public side on the bridge, a 10.P.L.0/24 LAN behind MASQUERADE.

        Unsolicited inbound packets are DROPped (not refused), as a home router does; that is what lets
        TCP simultaneous open (hole punching) through. `random_fully` randomises source ports, making a
        NAT that hole punching cannot pass.
        """
        lan = self._next_lan
        self._next_lan += 1
        nat = Nat(self, self._ns_name(label), "", lan_prefix=f"10.{self.octet}.{lan}")
        self._add(nat)
        nat.address = self._attach_public(nat, None)
        # Hosts behind it plug their veth into this LAN bridge (see host()).
        nat.run("ip", "link", "add", "lan0", "type", "bridge")
        nat.run("ip", "addr", "add", f"{nat.lan_prefix}.1/24", "dev", "lan0")
        nat.run("ip", "link", "set", "lan0", "up")
        nat.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["-j", "MASQUERADE"] + (["--random-fully"] if random_fully else [])
        nat.run("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", *masquerade)
        for chain in ("INPUT", "FORWARD"):
            nat.run("iptables", "-A", chain, "-i", "eth0", "-m", "conntrack",
                    "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            nat.run("iptables", "-A", chain, "-i", "eth0", "-j", "DROP")
        return nat

    # -- helpers ----------------------------------------------------------------------------------------

    def _ns_name(self, label: str) -> str:
        if not label.isalnum() or len(label) > 8:
            raise ValueError(f"label must be 1-8 alphanumerics, got {label!r}")
        return f"{self.tag}-{label}"

    def _add(self, ns: Netns) -> None:
        _run("ip", "netns", "add", ns.name)
        self.namespaces.append(ns)
        ns.run("ip", "link", "set", "lo", "up")

    def _in_bridge(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.bridge_ns, *args)

    def _veth(self, ns_a: str, ns_b: str, name_a: str | None = None) -> tuple[str, str]:
        """A veth pair with one end in each namespace; returns (name in a, name in b)."""
        self._links += 1
        a, b = name_a or f"v{self._links}a", f"v{self._links}b"
        # Created in ns_a so names never clash with the root namespace's interfaces.
        _run("ip", "-n", ns_a, "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns_b)
        _run("ip", "-n", ns_a, "link", "set", a, "up")
        _run("ip", "-n", ns_b, "link", "set", b, "up")
        return a, b

    def join_sides(self, joined: bool) -> None:
        """Set the link between the two public bridges up (`joined`) or down: down, no packet crosses
        between side 0 and side 1 (open connections stall as on a cut cable); each side still works."""
        self._side_bridge(1)
        self._in_bridge("ip", "link", "set", "trunk0", "up" if joined else "down")

    def _side_bridge(self, side: int) -> str:
        """The bridge of `side`; side 1's bridge (br1) and its link to br0 are made on first use."""
        if side == 0:
            return "br0"
        listing = _run("ip", "-n", self.bridge_ns, "link", "show", "br1", check=False)
        if listing.returncode != 0:
            self._in_bridge("ip", "link", "add", "br1", "type", "bridge")
            self._in_bridge("ip", "link", "add", "trunk0", "type", "veth", "peer", "name", "trunk1")
            for bridge, end in (("br0", "trunk0"), ("br1", "trunk1")):
                self._in_bridge("ip", "link", "set", end, "master", bridge)
                self._in_bridge("ip", "link", "set", end, "up")
            self._in_bridge("ip", "link", "set", "br1", "up")
        return "br1"

    def _attach_public(self, ns: Netns, link_mbit: float | None, bridge: str = "br0") -> str:
        address = f"10.{self.octet}.0.{self._next_host}"
        self._next_host += 1
        if self._next_host > 250:
            raise NetnsError("public segment is full (250 hosts)")
        inner, outer = self._veth(ns.name, self.bridge_ns, name_a="eth0")
        self._in_bridge("ip", "link", "set", outer, "master", bridge)
        _run("ip", "-n", ns.name, "addr", "add", f"{address}/24", "dev", "eth0")
        self._cap(ns.name, "eth0", self.bridge_ns, outer, link_mbit)
        return address

    def _cap(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str, link_mbit: float | None) -> None:
        if link_mbit is None:
            return
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", f"{link_mbit}mbit", "burst", "32kbit", "latency", "400ms")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL after 3 s; never raises."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_namespace_pids(name: str) -> None:
    """SIGKILLs any process still inside namespace `name` (one we started, by its listed PID)."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        if pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
