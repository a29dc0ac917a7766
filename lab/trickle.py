"""A victim's memory and exchange slot while trickling partners attack it.

    python -m lab.trickle --tricklers 4 --calm 20 --attack 60 --out results/trickle

A victim and an honest peer (`murmur run`, separate processes on loopback) train `--task`. After
`--calm` seconds, `--tricklers` hostile partners (libp2p hosts in this process, each its own peer ID)
attack the victim for `--attack` seconds, then stop, and the run watches `--calm` seconds more.
Each trickler opens an averaging exchange as an honest initiator would (a valid Offer); once
accepted it announces its model and then sends 4 bytes every 0.25 s until the victim hangs up; a
Busy answer makes it ask again 0.2 s later. Every 0.5 s the run samples the victim's RSS (/proc),
both peers' exchange counts (status.json), how the victim ended the tricklers' exchanges (its
recent outcomes) and how many tricklers hold an accepted exchange as they see it (the victim has
one slot; a trickler notices the victim hung up only at its next write, so two may briefly
overlap). The samples, each hold (accepted, cut off, as the trickler saw it) and a summary go to
`--out`/trickle.json; the summary is printed too. Results: docs/bench/trickle/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import trio

from lab.swarm import start_peer, stop_swarm, wait_for_address
from murmur.node.averaging.averager import AVERAGE_PROTOCOL, LINK_OVERHEAD
from murmur.node.net.transport import TransportError
from murmur.protocol.codec import CHUNK_BYTES, WIRE_DTYPES
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Accept, Busy, Chunk, Offer, Params, Refuse, encode_frame

TRICKLE_BYTES, TRICKLE_EVERY = 4, 0.25  # 16 bytes/s
RETRY_BUSY, RETRY_ERROR = 0.2, 1.0  # seconds before a trickler asks again
SAMPLE_EVERY = 0.5


@dataclass
class Attack:
    """What the tricklers share: the victim, what they send, and what they saw."""

    victim_id: str
    victim_addrs: list[str]
    offer: Offer
    params: Params
    t0: float
    until: float
    holding: int = 0
    holds: list[dict] = field(default_factory=list)
    trickler_ids: set[str] = field(default_factory=set)
    victim_outcomes: set[tuple] = field(default_factory=set)  # (result, reason, duration) the victim recorded
    answers: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.answers[what] = self.answers.get(what, 0) + 1


async def _trickler(index: int, transport, attack: Attack) -> None:
    """Attack until `attack.until`: offer, and once accepted trickle until cut off."""
    frame = encode_frame(Chunk(b"\0" * CHUNK_BYTES))  # never sent whole: far more than any timeout allows
    while trio.current_time() < attack.until:
        try:
            stream = await transport.open_stream(attack.victim_id, attack.victim_addrs, AVERAGE_PROTOCOL)
            ex = Exchange(Role.INITIATOR, AVERAGE, max_params_bytes=attack.params.size)
            await stream.send_all(ex.send(attack.offer))
            with trio.fail_after(30):
                while not isinstance(answer := ex.next_event(), (Accept, Busy, Refuse)):
                    ex.receive_data(await stream.receive_some())
        except Exception as exc:  # noqa: BLE001 - whatever failed (a refused stream, a timeout): count it, ask again
            attack.count(f"error: {type(exc).__name__}")
            await trio.sleep(RETRY_ERROR)
            continue
        if not isinstance(answer, Accept):
            attack.count(type(answer).__name__.lower())
            await stream.reset()
            await trio.sleep(RETRY_BUSY)
            continue
        attack.count("accept")
        accepted, cut = trio.current_time(), None
        attack.holding += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain, stream)  # take the victim's model, so only the victim ends the stream
                try:
                    with trio.move_on_at(attack.until):
                        await stream.send_all(ex.send(attack.params))
                        for start in range(0, len(frame), TRICKLE_BYTES):
                            await stream.send_all(frame[start : start + TRICKLE_BYTES])
                            await trio.sleep(TRICKLE_EVERY)
                except TransportError:
                    cut = trio.current_time()  # the victim hung up
                nursery.cancel_scope.cancel()
        finally:
            attack.holding -= 1
        if cut is None:
            await stream.reset()
        attack.holds.append({"trickler": index, "accepted_s": accepted - attack.t0,
                             "held_s": (cut if cut is not None else trio.current_time()) - accepted,
                             "cut_by_victim": cut is not None})  # fmt: skip


async def _drain(stream) -> None:
    try:
        while await stream.receive_some():
            pass
    except TransportError:
        pass


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _sample(victim, honest, attack: Attack, end: float, samples: list[dict]) -> None:
    while trio.current_time() < end:
        v, h = victim.status(), honest.status()
        for outcome in v.recent_exchanges if v else ():
            if outcome.partner in attack.trickler_ids:  # how the victim ended a trickler's exchange
                attack.victim_outcomes.add((outcome.result, outcome.reason, round(outcome.duration_s, 3)))
        samples.append({
            "t": trio.current_time() - attack.t0, "victim_rss_mb": _rss_mb(victim.process.pid),
            "slots_held_by_tricklers": attack.holding,
            "victim_exchanges": dict(v.exchanges) if v else {}, "honest_exchanges": dict(h.exchanges) if h else {},
        })  # fmt: skip
        await trio.sleep(SAMPLE_EVERY)


async def _attack(args: argparse.Namespace, victim, honest, opening: tuple[Offer, Params]) -> dict:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from murmur.node.net.libp2p_transport import Libp2pTransport

    samples: list[dict] = []
    t0 = trio.current_time()
    attack = Attack(victim.peer_id, [wait_for_address(victim)], *opening, t0=t0, until=t0 + args.calm + args.attack)
    end = t0 + 2 * args.calm + args.attack
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_sample, victim, honest, attack, end, samples)
        await trio.sleep(args.calm)
        async with trio.open_nursery() as attackers:
            for i in range(args.tricklers):
                transport = Libp2pTransport(create_new_key_pair())
                attack.trickler_ids.add(transport.peer_id)
                await attackers.start(_hosted, transport, i, attack)
        await trio.sleep_until(end)
    victim_outcomes = [{"result": r, "reason": why, "duration_s": d} for r, why, d in sorted(attack.victim_outcomes)]
    return {"samples": samples, "holds": attack.holds, "answers": attack.answers, "victim_outcomes": victim_outcomes}


async def _hosted(transport, index: int, attack: Attack, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with transport.run(["/ip4/127.0.0.1/tcp/0"]):
        task_status.started()
        await _trickler(index, transport, attack)


def _opening(task: str) -> tuple[Offer, Params, float]:
    """The Offer and Params an honest initiator of `task` sends, and the bytes of its largest wire form."""
    from murmur.node.learn.loop import TrainingLoop
    from murmur.node.learn.tasks import load_task

    replica = TrainingLoop(load_task(task), shard=0).replica
    size = replica.spec.wire_size("float32")
    largest = max(replica.spec.wire_size(dtype) for dtype in WIRE_DTYPES)
    return Offer(task, replica.fingerprint, 1.0, "float32"), Params("float32", replica.spec.layout, size), largest


def summarize(result: dict, calm: float, attack_s: float, bound_s: float) -> dict:
    """The figures a reader wants from `result`: hold times against the bound, slot share, RSS and merges by phase."""
    samples = result["samples"]
    phases = {
        "before": (0, calm),
        "attack": (calm, calm + attack_s),
        "after": (calm + attack_s + bound_s, 2 * calm + attack_s),
    }

    def within(name: str) -> list[dict]:
        lo, hi = phases[name]
        return [s for s in samples if lo <= s["t"] < hi and s["victim_rss_mb"] is not None]

    def merges(name: str, who: str) -> int:
        rows = within(name)
        return rows[-1][who].get("merged", 0) - rows[0][who].get("merged", 0) if len(rows) > 1 else 0

    cut = [h["held_s"] for h in result["holds"] if h["cut_by_victim"]]
    attack_rows = within("attack")
    return {
        "bound_s": bound_s, "holds_cut_by_victim": len(cut),
        "held_s_median": statistics.median(cut) if cut else None, "held_s_max": max(cut) if cut else None,
        "slot_held_share_during_attack": sum(s["slots_held_by_tricklers"] > 0 for s in attack_rows) / max(1, len(attack_rows)),
        "max_slots_held_at_once": max((s["slots_held_by_tricklers"] for s in samples), default=0),
        **{f"victim_rss_mb_{p}_median": statistics.median([s["victim_rss_mb"] for s in within(p)]) for p in phases if within(p)},
        "victim_rss_mb_attack_max": max((s["victim_rss_mb"] for s in attack_rows), default=None),
        **{f"victim_merges_{p}": merges(p, "victim_exchanges") for p in phases},
        "victim_ended_trickles": dict(Counter(f"{o['result']}: {o['reason']}" for o in result["victim_outcomes"])),
        "victim_trickle_s_max": max((o["duration_s"] for o in result["victim_outcomes"]), default=None),
        "answers": result["answers"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tricklers", type=int, default=4, help="hostile partners attacking at once")
    parser.add_argument("--calm", type=float, default=20.0, help="seconds watched before and after the attack")
    parser.add_argument("--attack", type=float, default=60.0, help="seconds the tricklers attack")
    parser.add_argument("--task", default="charlm-large", help="what the peers train (as murmur run --task)")
    parser.add_argument("--exchange-timeout", type=float, default=5.0, help="the peers' --exchange-timeout")
    parser.add_argument("--min-link-mbit", type=float, default=20.0, help="the peers' --min-link-mbit")
    parser.add_argument(
        "--out", type=Path, default=Path("results/trickle"), help="folder for trickle.json and peer data"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    offer, params, largest = _opening(args.task)
    bound_s = args.exchange_timeout + LINK_OVERHEAD * largest * 8 / (args.min_link_mbit * 1e6)  # as Averager.timeout_s
    extra = ["--task", args.task, "--exchange-timeout", str(args.exchange_timeout), "--min-link-mbit",
             str(args.min_link_mbit), "--eval-every", "600"]  # fmt: skip
    victim = start_peer(0, args.out, 1.0, extra, None, fork=True)  # forked: ready in a second
    peers = [victim]
    try:
        peers.append(honest := start_peer(1, args.out, 1.0, extra, wait_for_address(victim), fork=True))
        wait_for_address(honest)
        started = time.time()
        result = trio.run(_attack, args, victim, honest, (offer, params))
    finally:
        stop_swarm(peers)
    summary = summarize(result, args.calm, args.attack, bound_s)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "trickle.json").write_text(
        json.dumps({"config": config, "started": started, "summary": summary, **result}, indent=1)
    )
    for key, value in summary.items():
        print(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
