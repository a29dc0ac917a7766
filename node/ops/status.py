"""`murmur status`: show a running node's state from the status.json it writes, or check its health.

Reads only the file the node writes every `status_interval` seconds (no network, no
torch), so it is cheap enough for a container's HEALTHCHECK:
`murmur status --data-dir /data --health` exits 0 if the node is alive, else prints why and exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from murmur.node.ops.node_status import NodeStatus, NotAStatus
from murmur.node.ops.parsing import Parser

STATUS_FILE = "status.json"  # written by murmur.node.ops.node (which imports it from here: this module stays torch-free)
MAX_STALENESS_S = 30.0


class StatusUnavailable(Exception):
    """No readable status: the message says which file and why, in one line."""


def default_data_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """`MURMUR_DATA_DIR` if set (as `murmur run` reads it), else ~/.murmur."""
    return Path(environ.get("MURMUR_DATA_DIR", "~/.murmur")).expanduser()


def load_status(data_dir: Path) -> NodeStatus:
    """The node's last status; raises `StatusUnavailable` if the file is missing, unreadable or not a status."""
    path = data_dir / STATUS_FILE
    try:
        return NodeStatus.from_json(path.read_text())
    except FileNotFoundError:
        raise StatusUnavailable(f"no status file at {path}: is a node running with --data-dir {data_dir}?") from None
    except OSError as exc:
        raise StatusUnavailable(f"cannot read {path}: {exc.strerror or exc}") from None
    except NotAStatus as exc:
        raise StatusUnavailable(f"{path} is {exc}") from None


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to another user
        return True
    return True


def unhealthy_reason(status: NodeStatus, now: float, alive: bool | None = None) -> str | None:
    """Why the node that wrote `status` is not healthy at Unix time `now`, or None if it is.

    Healthy: the status was written within 3 write intervals (at most 30 s) and its
    process is alive (`alive`, or checked by PID when None).
    """
    limit = min(3 * status.status_interval, MAX_STALENESS_S)
    age = now - status.t
    pid = status.pid
    if alive is None:
        alive = pid_alive(pid)
    if not alive:
        return f"node process {pid} is not running (status last written {age:.0f}s ago)"
    if age > limit:
        return f"status is stale: last written {age:.1f}s ago (limit {limit:g}s)"
    return None


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: the node writes NaN before its first step, which strict JSON lacks."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _num(value: Any, spec: str = ".4g") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "—"
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def render(status: NodeStatus, now: float, console: Console) -> None:
    """Print `status` as a summary, the exchange counts and the recent exchanges.

    Addresses go on lines of their own, whole, whatever the terminal's width: they are there to be
    copied. No line ends in spaces.
    """
    reason = unhealthy_reason(status, now)
    network = status.network
    kinds = list(network.connections.values())
    evaluation = ", ".join(f"{k} {_num(v)}" for k, v in status.eval.items())
    rows: list[tuple[str, str | list[str]]] = [
        ("peer ID", status.peer_id),
        ("state", f"[red]{escape(reason)}[/red]" if reason
         else f"[green]running[/green] (pid {status.pid}, updated {now - status.t:.1f}s ago)"),
        ("addresses", list(status.addrs) or "—"),
        ("task", escape(f"{status.task} on {status.device}")),
        ("samples/s", f"{_num(status.samples_per_s, '.0f')} ({status.samples} samples)"),
        ("loss", f"{_num(status.loss)}" + (f" · held-out {escape(evaluation)}" if evaluation else "")),
        ("work weight", _num(status.work, ".0f")),
        ("known peers", str(status.known_peers) if status.joined else f"0 · alone: {escape(status.alone_reason or '')}"),
        ("reachability", (f"{escape(network.reachability)} · connections: {kinds.count('direct')} direct, "
                          f"{kinds.count('relayed')} relayed")),
        ("exchanges", ", ".join(f"{k} {v}" for k, v in sorted(status.exchanges.items())) or "none yet"),
        ("partner distance", _num(status.partner_distance)),
        ("traffic", f"in {_bytes(status.bytes_in)} · out {_bytes(status.bytes_out)}"),
        ("per merge", "—" if status.bytes_per_merge is None else
         f"{_bytes(status.bytes_per_merge)} sent, of a {_bytes(status.model_bytes)} model"),
    ]  # fmt: skip
    if status.metrics_url:
        rows.append(("metrics", [status.metrics_url]))
    if status.dashboard_url:
        rows.append(("dashboard", [status.dashboard_url]))
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        if isinstance(value, list):  # copyable: each on its own line, never wrapped or cut by Rich
            console.print(f"[bold]{label}[/bold]", highlight=False)
            for line in value:
                console.print("  " + escape(line), soft_wrap=True, highlight=False)
        else:
            console.print(f"[bold]{label}[/bold]{' ' * (width - len(label))}{value}", highlight=False)
    if status.recent_exchanges:
        console.print("recent exchanges (newest first)", highlight=False)  # not a table title: Rich pads those
        table = Table()
        for column in ("partner", "outcome", "reason", "duration"):
            table.add_column(column, overflow="fold")
        for ex in reversed(status.recent_exchanges):
            partner = ex.partner or "—"
            table.add_row(f"…{partner[-8:]}" if len(partner) > 8 else partner, ex.result, ex.reason, f"{ex.duration_s:.3f}s")
        console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="murmur status", description="Show a running node's state (from its data dir)."
    )
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="the node's data dir (default $MURMUR_DATA_DIR or ~/.murmur)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print the node's status as JSON")
    mode.add_argument(
        "--health",
        action="store_true",
        help="exit 0 if the node is alive and its status fresh, else print why and exit 1",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `murmur status` with `argv`; return the exit status (1: no status, or unhealthy with --health)."""
    args = build_parser().parse_args(argv)
    data_dir = args.data_dir.expanduser() if args.data_dir else default_data_dir()
    try:
        status = load_status(data_dir)
    except StatusUnavailable as exc:
        print(f"murmur status: {exc}", file=sys.stderr if not args.health else sys.stdout)
        return 1
    now = time.time()
    if args.health:
        reason = unhealthy_reason(status, now)
        print(f"unhealthy: {reason}" if reason else "healthy")
        return 1 if reason else 0
    if args.json:
        print(json.dumps(_finite(status.to_dict()), indent=1, allow_nan=False))
        return 0
    render(status, now, Console())
    return 0
