"""A Murmur swarm through real NAT: public peers (bootstrap and relays, all `--relay-service`) and two
peers each behind its own NAT router, every one a `murmur run` peer of `lab.swarm` forked into its own network namespace.

Used by `tests/test_nat.py` and `lab/nat_measure.py`. Needs root, iproute2 and iptables
(`lab.netns.netns_unavailable_reason`).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lab.netns import Netns, Network
from lab.swarm import Peer, kill_peer, start_peer
from murmur.node.averaging.outcome import Result
from murmur.node.ops.node_status import NetworkStatus, NodeStatus

PORT = 4001
PUNCH_LINE = re.compile(r"direct connection to (\w+) \(hole punched\)")
EXCHANGE_LINE = re.compile(r"exchange with (\w+): (\w+)")


class NatSwarmError(RuntimeError):
    """A peer exited or a condition was not reached in time; the message says which and where the logs are."""


class NatSwarm:
    """Builds the topology and starts the peers on entry; removes everything on exit (even on failure).

    `unpunchable` gives b a port-randomising NAT (`MASQUERADE --random-fully`) that hole punching cannot pass;
    `spare_relay` adds a third public relay, "relay2".
    """

    def __init__(
        self, root: Path, *, unpunchable: bool = False, spare_relay: bool = False, duration: float = 120.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        self.unpunchable = unpunchable
        self.public = ("boot", "relay", "relay2") if spare_relay else ("boot", "relay")
        self.duration = duration
        self.extra = list(extra)
        self.net = Network(prefix="nsw")
        self.hosts: dict[str, Netns] = {}
        self.peers: dict[str, Peer] = {}
        self.started = 0.0
        self.killed: set[str] = set()

    def __enter__(self) -> "NatSwarm":
        self.net.__enter__()
        try:
            net = self.net
            for name in self.public:
                self.hosts[name] = net.host(name)
            self.nat_a, self.nat_b = net.nat("homea"), net.nat("homeb", random_fully=self.unpunchable)
            self.hosts["a"], self.hosts["b"] = net.host("a", behind=self.nat_a), net.host("b", behind=self.nat_b)
            self.started = time.monotonic()
            self._start("boot", "--relay-service")
            self.bootstrap = f"/ip4/{self.hosts['boot'].address}/tcp/{PORT}/p2p/{self.peer_id('boot')}"
            for name in self.public[1:]:
                self._start(name, "--relay-service", "--bootstrap", self.bootstrap)
            for name in ("a", "b"):
                self._start(name, "--bootstrap", self.bootstrap)
        except BaseException:
            self.net.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.net.close()

    def _start(self, name: str, *args: str) -> None:
        # `exchanges()` reads each exchange's line, which a node logs at DEBUG.
        extra = ["--duration", str(self.duration), "--log-level", "DEBUG", *self.extra, *args]
        self.peers[name] = start_peer(
            len(self.peers), self.root, 1.0, extra, None, data_dir=self.root / name, listen=f"/ip4/0.0.0.0/tcp/{PORT}",
            netns=self.hosts[name],
        )  # fmt: skip

    def peer_id(self, name: str, timeout: float = 90.0) -> str:
        """The peer's ID, once it listens."""
        self.wait_until(lambda: self.peers[name].address() is not None, f"{name} listening", timeout)
        return self.peers[name].peer_id

    def status(self, name: str) -> NodeStatus | None:
        """The peer's latest status, or None before it writes one."""
        return self.peers[name].status()

    def network(self, name: str) -> NetworkStatus:
        """The peer's network as its status says, or `NetworkStatus()`'s defaults before it writes one."""
        status = self.status(name)
        return status.network if status is not None else NetworkStatus()

    def log(self, name: str) -> str:
        return self.peers[name].log()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float) -> float:
        """Poll `condition` every 0.25 s; return the seconds since start when it holds. Raises NatSwarmError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return time.monotonic() - self.started
            for name, peer in self.peers.items():
                if not peer.alive() and name not in self.killed:
                    raise NatSwarmError(f"{name} exited with {peer.process.returncode} waiting for {what}; see {peer.data_dir}")
            time.sleep(0.25)
        raise NatSwarmError(f"no {what} within {timeout:g} s; logs under {self.root}\n{self._log_tails()}")

    def _log_tails(self, lines: int = 6) -> str:
        """The NATed peers' last log lines, so that a failure on a machine whose files are gone says what happened."""
        tails = []
        for name in ("a", "b"):
            try:
                tails += [f"{name}: {line}" for line in self.log(name).splitlines()[-lines:]]
            except OSError:
                tails.append(f"{name}: no log")
        return "\n".join(tails)

    def kill(self, name: str) -> None:
        """SIGKILL one peer (a crash, not a goodbye)."""
        self.killed.add(name)
        kill_peer(self.peers[name])

    def can_dial(self, src: str, ip: str, port: int = PORT) -> bool:
        """Whether a plain TCP connect from `src`'s namespace to ip:port succeeds within 2 s."""
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"
        return self.hosts[src].run(sys.executable, "-c", probe, ip, str(port), check=False).returncode == 0

    def interface_bytes(self, name: str) -> int:
        """Bytes sent plus received on the peer's uplink so far."""
        read = lambda stat: int(self.hosts[name].run("cat", f"/sys/class/net/eth0/statistics/{stat}").stdout)  # noqa: E731
        return read("tx_bytes") + read("rx_bytes")

    def exchanges(self, name: str, partner: str) -> list[tuple[Result, str]]:
        """(result, path) of each exchange `name` started with `partner`, in order, from its log; path is
        "direct" after the log says the hole was punched, else "relayed"."""
        short = self.peer_id(partner)[-8:]
        path, out = "relayed", []
        for line in self.log(name).splitlines():
            if (m := PUNCH_LINE.search(line)) and m.group(1) == short:
                path = "direct"
            elif (m := EXCHANGE_LINE.search(line)) and m.group(1) == short:
                out.append((Result(m.group(2)), path))
        return out
