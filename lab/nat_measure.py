"""Measure NAT traversal through real NAT routers (needs root): time to the first direct connection between
two NATed peers, the share of their exchanges that went direct, and the bytes the relays forwarded.

    sudo .venv/bin/python -m lab.nat_measure --seconds 60

Runs the `lab.natswarm` topology twice: with NATs that hole punching passes, and with one
port-randomising NAT (relay only, with a spare relay; at the end the relay carrying the pair is
killed). Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from lab.natswarm import NatSwarm
from lab.netns import netns_unavailable_reason
from murmur.node.averaging.outcome import Result


def kill_the_relay(swarm: NatSwarm) -> dict:
    """Kill the relay carrying a-b; time the next merged a-b exchange and the return to two reservations."""
    b_id = swarm.peer_id("b")
    victim_id = swarm.network("a").relayed_via.get(b_id)
    if not victim_id:
        return {"relay_kill": "a and b are not relayed"}
    victim = next(name for name in swarm.public if swarm.peer_id(name) == victim_id)
    before = len(swarm.exchanges("a", "b"))
    killed_at = time.monotonic() - swarm.started
    swarm.kill(victim)
    merged = swarm.wait_until(lambda: any(r == Result.MERGED for r, _ in swarm.exchanges("a", "b")[before:]), "an exchange", 90)
    lost = [r for r, _ in swarm.exchanges("a", "b")[before:]].index(Result.MERGED)

    def re_reserved(name: str) -> bool:
        relays = swarm.network(name).relays
        return len(relays) == 2 and not any(victim_id in r for r in relays)

    again = swarm.wait_until(lambda: re_reserved("a") and re_reserved("b"), "two reservations", 90)
    return {"relay_killed": victim, "next_merged_exchange_after_s": round(merged - killed_at, 1),
            "exchanges_lost": lost, "two_reservations_again_after_s": round(again - killed_at, 1)}


def measure(root: Path, unpunchable: bool, seconds: float) -> dict:
    with NatSwarm(root, unpunchable=unpunchable, spare_relay=unpunchable, duration=seconds + 120) as swarm:
        b_id = swarm.peer_id("b")
        samples = []  # (t, bytes forwarded by both relays, a-b connection kind)
        t_private = t_direct = None
        while time.monotonic() - swarm.started < seconds:
            a = swarm.network("a")
            relayed = sum(swarm.network(n).relayed_bytes for n in swarm.public)
            kind = a.connections.get(b_id)
            t = time.monotonic() - swarm.started
            samples.append((t, relayed, kind))
            if t_private is None and a.reachability == "private" == swarm.network("b").reachability:
                t_private = t
            if t_direct is None and kind == "direct":
                t_direct = t
            time.sleep(0.5)
        exchanges = [r for r in swarm.exchanges("a", "b") + swarm.exchanges("b", "a") if r[0] == Result.MERGED]
        killed = kill_the_relay(swarm) if unpunchable else {}
    first_circuit = next((t for t, _, kind in samples if kind is not None), None)
    end_t, end_bytes = samples[-1][0], samples[-1][1]
    at_punch = next((b for t, b, _ in samples if t_direct is not None and t >= t_direct), None)
    out = {
        "nat": "port-randomising (unpunchable)" if unpunchable else "port-preserving",
        "window_s": round(end_t, 1),
        "both_private_at_s": t_private and round(t_private, 1),
        "first_a_b_connection_at_s": first_circuit and round(first_circuit, 1),
        "first_direct_at_s": t_direct and round(t_direct, 1),
        "a_b_merged_exchanges": len(exchanges),
        "share_direct": round(sum(p == "direct" for _, p in exchanges) / len(exchanges), 3) if exchanges else None,
        "relayed_bytes_total": end_bytes,
        **killed,
    }
    if t_direct is not None and first_circuit is not None:
        out["relay_bytes_per_s_before_punch"] = round(at_punch / max(0.5, t_direct - first_circuit))
        out["relay_bytes_per_s_after_punch"] = round((end_bytes - at_punch) / max(0.5, end_t - t_direct))
    elif first_circuit is not None:
        out["relay_bytes_per_s"] = round(end_bytes / max(0.5, end_t - first_circuit))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each run, from the first process start")
    args = parser.parse_args()
    if reason := netns_unavailable_reason(need_iptables=True):
        print(f"nat_measure: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="murmur-nat-") as tmp:
        for unpunchable in (False, True):
            print(json.dumps(measure(Path(tmp) / str(unpunchable), unpunchable, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
