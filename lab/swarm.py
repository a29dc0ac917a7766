"""Local swarms of `murmur run` OS processes: start, watch, stop by PID.

Used by `murmur demo`, the benchmarks and the swarm tests. Every peer gets its own
data dir under `root`; the first peer's address (from its `--addr-file`) is every
other peer's bootstrap. `ForkedPeer` starts `murmur run` faster, for benchmarks that
start many short-lived swarms.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from murmur.node.ops.node import METRICS_FILE, STATUS_FILE


class SwarmError(RuntimeError):
    """A peer failed to start or to publish its address in time."""


@dataclass
class Peer:
    index: int
    slowdown: float
    data_dir: Path
    process: subprocess.Popen | ForkedPeer

    def status(self) -> dict | None:
        try:
            return json.loads((self.data_dir / STATUS_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def metrics(self) -> list[dict]:
        try:
            lines = (self.data_dir / METRICS_FILE).read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]


def murmur_command() -> list[str]:
    """The command a local peer runs: `murmur run` with the lab's hooks (`lab.peer`), so its flags are `murmur run`'s plus the lab's."""
    return [sys.executable, "-m", "lab.peer"]


CHECKOUT = Path(__file__).resolve().parents[1]


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
    for its starter), with its output in `log_path`, no `MURMUR_*` settings and, given
    `netns`, inside that network namespace (`lab.netns.enter_namespace`). It is
    ready in about a second instead of the several a fresh interpreter spends importing
    torch. Popen-like (`pid`, `poll`, `wait`, `kill`, `returncode`), so
    `stop_processes` and a namespace's teardown stop it by PID.
    """

    def __init__(self, target: Callable[..., object], args: tuple, log_path: Path, netns: str | None = None,
                 name: str = "forked") -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORK_PRELOAD)
        # daemon: should this process die, multiprocessing's exit handler still ends the child
        self._process = context.Process(target=_in_own_session, args=(target, args, str(log_path), netns), name=name, daemon=True)
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]  # set by start()

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


class ForkedPeer(ForkedProcess):
    """`python -m lab.peer ARGV` (`murmur run` with the lab's flags) as a `ForkedProcess`, like `start_peer`'s peers."""

    def __init__(self, argv: list[str], log_path: Path, netns: str | None = None) -> None:
        if "run" not in argv:
            raise ValueError(f"a forked peer runs `murmur run`, not {argv[:1]}")
        super().__init__(_murmur_run, (argv,), log_path, netns, name="murmur-run")


def _in_own_session(target: Callable[..., object], args: tuple, log_path: str, netns: str | None) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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


def _murmur_run(args: list[str]) -> None:
    from lab import peer
    from murmur.node.ops import run

    with run.quiet_stop_signals():
        code = peer.main(args)
    run.exit_now(code)


def start_peer(
    index: int, root: Path, slowdown: float, extra: list[str], bootstrap: str | None, command: list[str] | None = None,
    *, fork: bool = False,
) -> Peer:
    """Start `murmur run` (or `command`, e.g. an adversary) as peer `index` under `root`.

    The peer runs one torch thread (`ONE_THREAD`) unless `extra` says otherwise. With
    `fork`, a `murmur run` peer is a `ForkedPeer`, ready in about a second; its command
    line is then the fork server's, so look for it by PID, not by arguments.
    """
    data_dir = root / f"peer-{index}"
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "addrs.txt").unlink(missing_ok=True)
    if fork and command is not None:
        raise ValueError("only `murmur run` peers can be forked")
    args = (command or murmur_command()) + [
        "run", "--data-dir", str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0",
        "--addr-file", str(data_dir / "addrs.txt"), "--slowdown", str(slowdown), *ONE_THREAD, *extra,
    ]
    if bootstrap:
        args += ["--bootstrap", bootstrap]
    if fork:
        return Peer(index, slowdown, data_dir, ForkedPeer(args[len(murmur_command()):], data_dir / "log.txt"))
    log = (data_dir / "log.txt").open("w")
    # A new session: Ctrl-C reaches only the controller, which stops peers by PID.
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=peer_environment())
    return Peer(index, slowdown, data_dir, process)


def wait_for_address(peer: Peer, timeout: float = 60.0) -> str:
    """Return the peer's first listening address once its addr file appears."""
    deadline = time.monotonic() + timeout
    path = peer.data_dir / "addrs.txt"
    while time.monotonic() < deadline:
        if peer.process.poll() is not None:
            raise SwarmError(f"peer {peer.index} exited with {peer.process.returncode}; see {peer.data_dir / 'log.txt'}")
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
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


def stop_processes(processes: list[subprocess.Popen] | list[ForkedProcess], timeout: float = 15.0) -> list[int | None]:
    """SIGTERM every process by PID, wait up to `timeout` in all, SIGKILL stragglers; return exit codes."""
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return [process.returncode for process in processes]


def stop_swarm(peers: list[Peer], timeout: float = 15.0) -> list[int | None]:
    """Stop every peer (see `stop_processes`); return their exit codes."""
    return stop_processes([peer.process for peer in peers], timeout)
