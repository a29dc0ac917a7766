"""Local peer processes: start a peer, wait for its address, read its status, stop it by PID.

The one manager of `murmur run` processes in the lab: `murmur demo`, the benchmarks, the
chaos run (`lab.chaos`: SIGKILL churn and restarts), the NAT swarm (`lab.natswarm`: peers
in network namespaces) and the swarm tests build on it. Every peer has its own data dir;
its key is made before it starts, so its ID is known at once, and its address is the
first line of its `--addr-file`. `murmur_command` names the peer command; a `ForkedPeer`
runs that same command in a process forked from a server that has imported it once.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lab import cpu_quota
from murmur.node.ops.node import METRICS_FILE
from murmur.node.ops.node_status import NodeStatus
from murmur.node.ops.status import StatusUnavailable, load_status

if TYPE_CHECKING:
    from lab.netns import Netns

ADDR_FILE = "addrs.txt"
LOG_FILE = "log.txt"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
CHECKOUT = Path(__file__).resolve().parents[1]


class SwarmError(RuntimeError):
    """A peer failed to start or to publish its address in time."""


def murmur_command() -> list[str]:
    """The command a local peer runs: `murmur run` with the lab's hooks (`lab.peer`), so its flags are `murmur run`'s plus the lab's."""
    return [sys.executable, "-m", "lab.peer"]


def peer_environment() -> dict[str, str]:
    """This process's environment minus `MURMUR_*`, with the checkout on `PYTHONPATH`.

    Local peers are configured by their flags alone: an exported `MURMUR_METRICS_PORT`, say,
    would otherwise make every peer after the first fail to bind it. The checkout lets a peer
    run a lab module (`python -m lab.adversary`) wherever it is started.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    return env


FORK_PRELOAD = ["lab.preload"]  # what the fork server imports once (see lab/preload.py)
# Local peers share this machine's cores: one torch thread each. The node leaves the count
# to its operator (`--threads`), so whatever starts several peers on one machine passes this.
ONE_THREAD = ["--threads", "1"]


class ForkedProcess:
    """`target(*args)` in a process forked from a server that has imported everything once.

    The process runs in its own session (so it is stopped by PID, never by a Ctrl-C meant
    for its starter), with its output in `log_path` (appended to with `append`), no
    `MURMUR_*` settings and, given `netns`, inside that network namespace
    (`lab.netns.enter_namespace`). It is ready in about a second instead of the several a
    fresh interpreter spends importing torch. Popen-like (`pid`, `poll`, `wait`, `kill`,
    `returncode`), so `stop_processes` and a namespace's teardown stop it by PID.
    """

    def __init__(self, target: Callable[..., object], args: tuple, log_path: Path, netns: str | None = None,
                 name: str = "forked", *, append: bool = False) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORK_PRELOAD)
        # daemon: should this process die, multiprocessing's exit handler still ends the child
        self._process = context.Process(
            target=_in_own_session, args=(target, args, str(log_path), netns, append), name=name, daemon=True,
        )
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]  # set by start()
        cpu_quota.adopt(self.pid)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises `subprocess.TimeoutExpired` if the process still runs after `timeout`."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def send_signal(self, sig: int) -> None:
        """Signal the process by PID, as `Popen.send_signal`: nothing once it exited. The fork server
        reaps it, so its PID can be gone before `poll` knows it exited."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class ForkedPeer(ForkedProcess):
    """`murmur run ARGV` as a `ForkedProcess`: the module `command` names (default `murmur_command`,
    else e.g. an adversary's), run as `__main__`."""

    def __init__(
        self, argv: list[str], log_path: Path, netns: str | None = None, *, append: bool = False,
        command: list[str] | None = None,
    ) -> None:
        if argv[:1] != ["run"]:
            raise ValueError(f"a forked peer runs `murmur run`, not {argv[:1]}")
        command = command or murmur_command()
        if command[1:2] != ["-m"]:
            raise ValueError(f"a forked peer runs a module (`python -m ...`), not {command}")
        super().__init__(_run_module, (command[2], [*command[3:], *argv]), log_path, netns, name="murmur-run", append=append)


def _in_own_session(target: Callable[..., object], args: tuple, log_path: str, netns: str | None, append: bool) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.setsid()  # as start_new_session: Ctrl-C reaches only the controller, which stops children by PID
    for key in [k for k in os.environ if k.startswith("MURMUR_")]:
        del os.environ[key]
    if netns is not None:
        from lab.netns import enter_namespace

        enter_namespace(netns)
    target(*args)


def _run_module(module: str, argv: list[str]) -> None:
    """`python -m module ARGV`, in this process (the fork server has imported its dependencies)."""
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a peer whose address must be known before it starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_id(data_dir: Path) -> str:
    """The peer ID `murmur run --data-dir data_dir` has (its key is made now if it has none)."""
    from murmur.node.net.identity import load_or_create_identity, peer_id_of

    data_dir.mkdir(parents=True, exist_ok=True)
    return peer_id_of(load_or_create_identity(data_dir))


@dataclass
class Peer:
    """One local peer process: its data dir, its process (Popen-like), its ID and when it started."""

    index: int
    slowdown: float
    data_dir: Path
    process: subprocess.Popen | ForkedProcess
    peer_id: str = ""
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.process.poll() is None

    def address(self) -> str | None:
        """The first address the peer published, or None before it listens."""
        try:
            lines = (self.data_dir / ADDR_FILE).read_text().split()
        except OSError:
            return None
        return lines[0] if lines else None

    def status(self) -> NodeStatus | None:
        """The peer's latest status, or None before it writes one."""
        try:
            return load_status(self.data_dir)
        except StatusUnavailable:
            return None

    def metrics(self) -> list[dict]:
        """Its evaluations so far (each run of a data dir starts the file afresh)."""
        try:
            lines = (self.data_dir / METRICS_FILE).read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def log(self) -> str:
        return (self.data_dir / LOG_FILE).read_text(errors="replace")


def start_peer(
    index: int, root: Path, slowdown: float, extra: Sequence[str], bootstrap: str | None, command: list[str] | None = None,
    *, fork: bool = False, data_dir: Path | None = None, listen: str = LOOPBACK, netns: Netns | None = None,
    append_log: bool = False,
) -> Peer:
    """Start `murmur run` (or `command`, e.g. an adversary) as peer `index`, in `data_dir` (default: `root/peer-INDEX`).

    The peer runs one torch thread (`ONE_THREAD`) unless `extra` says otherwise and listens on
    `listen`. With `fork`, the peer is a `ForkedPeer`, ready in about a second; its
    command line is then the fork server's, so look for it by PID, not by arguments. With
    `netns` it is forked into that namespace, whose teardown then stops it too.
    `append_log` keeps the log of an earlier run of the same data dir (a restart).
    """
    data_dir = data_dir if data_dir is not None else root / f"peer-{index}"
    data_dir.mkdir(parents=True, exist_ok=True)
    identity = peer_id(data_dir) if command is None else ""
    (data_dir / ADDR_FILE).unlink(missing_ok=True)
    argv = [
        "run", "--data-dir", str(data_dir), "--listen", listen, "--addr-file", str(data_dir / ADDR_FILE),
        "--slowdown", str(slowdown), *ONE_THREAD, *extra,
    ]  # fmt: skip
    if bootstrap:
        argv += ["--bootstrap", bootstrap]
    log_path = data_dir / LOG_FILE
    process: subprocess.Popen | ForkedProcess
    if fork or netns is not None:
        process = ForkedPeer(argv, log_path, netns=netns.name if netns is not None else None, append=append_log,
                             command=command)
        if netns is not None:
            netns.adopt(process)
    else:
        with log_path.open("a" if append_log else "w") as log:
            # A new session: Ctrl-C reaches only the controller, which stops peers by PID.
            process = subprocess.Popen(
                (command or murmur_command()) + argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=peer_environment(),
            )  # fmt: skip
        cpu_quota.adopt(process.pid)
    return Peer(index, slowdown, data_dir, process, identity)


def restart_peer(peer: Peer, extra: Sequence[str], bootstrap: str | None, *, fork: bool = False) -> Peer:
    """Start a stopped peer again from its data dir (same identity, its checkpoints), its log appended to."""
    if peer.alive():
        raise ValueError(f"peer {peer.index} still runs (pid {peer.process.pid})")
    return start_peer(peer.index, peer.data_dir.parent, peer.slowdown, extra, bootstrap, fork=fork,
                      data_dir=peer.data_dir, append_log=True)  # fmt: skip


def wait_for_address(peer: Peer, timeout: float = 60.0) -> str:
    """Return the peer's first listening address once its addr file appears; raises `SwarmError`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not peer.alive():
            raise SwarmError(f"peer {peer.index} exited with {peer.process.returncode}; see {peer.data_dir / LOG_FILE}")
        if (address := peer.address()) is not None:
            return address
        time.sleep(0.1)
    raise SwarmError(f"peer {peer.index} published no address within {timeout:g}s")


def start_swarm(root: Path, slowdowns: list[float], extra: list[str], *, fork: bool = False) -> list[Peer]:
    """Start one peer per slowdown (`fork`: see `start_peer`); all bootstrap from the first. Stops all on failure."""
    first = start_peer(0, root, slowdowns[0], extra, None, fork=fork)
    peers = [first]
    try:
        bootstrap = wait_for_address(first)
        peers += [start_peer(i, root, s, extra, bootstrap, fork=fork) for i, s in enumerate(slowdowns[1:], start=1)]
    except BaseException:
        stop_swarm(peers)
        raise
    return peers


def kill_peer(peer: Peer, timeout: float = 10.0) -> int | None:
    """SIGKILL the peer by PID (a crash, not a goodbye) and reap it; return its exit code."""
    peer.process.send_signal(signal.SIGKILL)
    return peer.process.wait(timeout=timeout)


def stop_processes(processes: Sequence[subprocess.Popen | ForkedProcess], timeout: float = 15.0) -> list[int | None]:
    """SIGTERM every process by PID, wait up to `timeout` in all, SIGKILL stragglers; return exit codes."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return [process.returncode for process in processes]


def stop_swarm(peers: Sequence[Peer], timeout: float = 15.0) -> list[int | None]:
    """Stop every peer (see `stop_processes`); return their exit codes."""
    return stop_processes([peer.process for peer in peers], timeout)
