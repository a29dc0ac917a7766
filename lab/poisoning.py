"""The poisoning benchmark: a charlm swarm of 8 with 0–3 attackers, in one process and in event time.

    python -m lab.poisoning --attacks data,alie,signflip,dissensus,freerider --attackers 1,2,3 \
        --defences screening,scored --seeds 1 --out results/poisoning.json

Every peer is a `lab.attacks.Peer` stepping at the same speed; every `--period` steps each
starts an exchange with a random partner (another, up to 3 in all, while they are refused or
banned, as `Averager.average_once` does), and both sides vet the other's model with the
node's own `Vetting` (claims, distance screening and, with `scored`, the merge's score on
held batches) and strike offences into their own `BanList`, as `Averager` does. Honest
loss is the median honest peer's held-out loss. The attack-free run has 8 honest peers;
an attacked run compares with it at equal time (the same step) and at equal samples (the
attack-free run at the step where its 8 peers had trained as many samples as the
attacked run's honest ones).

Defences: `screening` (today's default: claim caps and clipped distance screening),
`scored` (screening, then merges scored on `--score-windows` held windows, those `Trust` picks).
The CPU the honest peers spent in exchanges (snapshots, vetting, merging), against training, is each
run's `exchange_cpu_share`.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.attacks import ATTACKS, Alie, DataPoisoner, Dissensus, FreeRider, Peer, Replicated, SignFlipper, Swarm
from murmur.node.learn.scoring import HELD_SHARD, MergeScorer, Trust, held_batches
from murmur.node.learn.tasks import Task, load_task
from murmur.node.learn.vetting import Vetting

DEFENCES = ("screening", "scored")
MAX_ATTEMPTS = 3  # `Averager.average_once`'s: a refused exchange is followed by one with another partner
STEP_S = 0.025  # seconds one step stands for (charlm on one core): the clock claims and bans see


def vetting(
    task: Task,
    defence: str,
    shard: int,
    score_windows: int = 8,
    tolerance: float = 0.01,
    trust_ramp: float = Trust.ramp,
    trust_floor: float = Trust.min_rate,
) -> Vetting:
    """The node's vetting for one peer under `defence`, built as `murmur run --score-windows` builds it."""
    if defence not in DEFENCES:
        raise ValueError(f"unknown defence {defence!r}; choose from {DEFENCES}")
    rng = random.Random(shard)
    if defence == "screening":
        return Vetting(rng=rng)
    held = held_batches(task.train_batches(HELD_SHARD + shard), score_windows)
    scorer = MergeScorer(task.build_model(), task.loss, held, tolerance=tolerance)
    return Vetting(scorer=scorer, trust=Trust(ramp=trust_ramp, min_rate=trust_floor), rng=rng)


def build(task: Task, attack: str | None, attackers: int, peers: int, seed: int, make_vetting) -> list[Peer]:
    """`peers` peers, the last `attackers` of them running `attack`; peer i trains on shard 1000·seed + i."""
    out: list[Peer] = []
    for i in range(peers):
        name, shard = f"peer-{i}", 1000 * seed + i
        if attack is None or i < peers - attackers:
            out.append(Replicated(name, task, shard, make_vetting(shard)))
        elif attack == "data":
            out.append(DataPoisoner(name, task, shard, make_vetting(shard)))
        elif attack == "signflip":
            out.append(SignFlipper(name, task, shard, make_vetting(shard)))
        else:
            spec = out[0].loop.replica.spec
            initial = out[0].loop.replica.snapshot()
            if attack == "alie":
                out.append(Alie(name, spec))
            elif attack == "dissensus":
                out.append(Dissensus(name, spec))
            elif attack == "freerider":
                out.append(FreeRider(name, initial.state))
            else:
                raise ValueError(f"unknown attack {attack!r}; choose from {ATTACKS}")
    return out


def exchange(a: Peer, b: Peer, swarm: Swarm, now: float) -> str:
    """One exchange between `a` and `b`, as two averagers run it; returns how it ended."""
    if (a.bans and a.bans.is_banned(b.name, now)) or (b.bans and b.bans.is_banned(a.name, now)):
        return "banned"
    offer_a, offer_b = a.offer(b, swarm), b.offer(a, swarm)
    verdict_a, verdict_b = a.vet(b, offer_a, offer_b, now), b.vet(a, offer_b, offer_a, now)
    merged = verdict_a.decision is not None and verdict_b.decision is not None
    a.settle(offer_a, offer_b, verdict_a if merged else None)
    b.settle(offer_b, offer_a, verdict_b if merged else None)
    return "merged" if merged else "rejected"


def run_swarm(task: Task, peers: list[Peer], steps: int, period: float, seed: int, evals: int) -> dict:
    """Step every training peer `steps` times, exchanging every `period` steps; score the honest median `evals` times."""
    swarm = Swarm(peers, {n: t.clone() for n, t in peers[0].loop.replica.snapshot().state.items()})
    rng = random.Random(seed)
    honest = [p for p in peers if p.honest]
    grid = {round(steps * k / evals) for k in range(1, evals + 1)}
    curve: list[dict] = []
    outcomes: dict[str, int] = {}
    train_cpu = exchange_cpu = 0.0
    offset = {p.name: (i + 1) * period / len(peers) for i, p in enumerate(peers)}
    next_merge = dict(offset)
    for step in range(1, steps + 1):
        for p in peers:
            if p.loop is not None:
                began = time.process_time()
                p.loop.step()
                if p.honest:
                    train_cpu += time.process_time() - began
        for p in peers:  # exchanges due by this step, in a fixed order
            while next_merge[p.name] <= step:
                next_merge[p.name] += period
                tried: set[str] = set()
                for _ in range(MAX_ATTEMPTS):  # as `Averager.average_once`: partners until one merges
                    now = step * STEP_S
                    left = [q for q in peers if q is not p and q.name not in tried and not (p.bans and p.bans.is_banned(q.name, now))]
                    if not left:
                        break
                    partner = rng.choice(left)
                    tried.add(partner.name)
                    began = time.process_time()
                    ended = exchange(p, partner, swarm, now)
                    exchange_cpu += (time.process_time() - began) * sum(q.honest for q in (p, partner)) / 2
                    outcomes[ended] = outcomes.get(ended, 0) + 1
                    if ended == "merged":
                        break
        if step in grid:
            losses = [p.loop.evaluate().metrics[task.metric.name] for p in honest]
            curve.append(
                {
                    "step": step,
                    "honest_samples": step * task.batch_size * len(honest),
                    "loss": statistics.median(losses),
                }
            )
    return {
        "curve": curve,
        "outcomes": outcomes,
        "exchange_cpu_share": exchange_cpu / max(train_cpu, 1e-9),
        "refusals": refusals(peers),
    }


def refusals(peers: list[Peer]) -> dict[str, dict]:
    """How honest peers judged each partner kind: merges (and those in the second half of the run), refusals,
    bans, the first refusal's reason and the quartiles of the scored changes."""
    kinds = {p.name: ("honest" if p.honest else p.name) for p in peers}
    out: dict[str, dict] = {}
    for p in peers:
        if not (p.honest and isinstance(p, Replicated)):
            continue
        for k, (partner, verdict) in enumerate(p.verdicts):
            row = out.setdefault(
                kinds[partner], {"merged": 0, "refused": 0, "merged_late": 0, "reason": "", "banned_by": 0, "scored": []}
            )
            if verdict.decision is None:
                row["refused"] += 1
                row["reason"] = row["reason"] or verdict.reason
            else:
                row["merged"] += 1
                row["merged_late"] += k >= len(p.verdicts) // 2  # in the second half of this peer's exchanges
            if verdict.score is not None:
                row["scored"].append(round(verdict.score.change, 4))
    for name, row in out.items():
        row["banned_by"] = sum(1 for p in peers if p.honest and p.bans and name in p.bans.banned_until)
        changes = sorted(row.pop("scored"))
        if changes:
            row["scored_change_quartiles"] = [
                changes[len(changes) // 4],
                changes[len(changes) // 2],
                changes[3 * len(changes) // 4],
                changes[-1],
            ]
    return out


def compare(attacked: dict, clean: dict, alone: dict) -> dict:
    """The attacked run's final honest loss against the attack-free swarm's at equal time and at equal samples,
    and against its honest peers training alone (equal time and samples both)."""
    final = attacked["curve"][-1]
    at_time = next(c for c in clean["curve"] if c["step"] == final["step"])
    equal = [c for c in clean["curve"] if c["honest_samples"] <= final["honest_samples"]][-1]
    by_themselves = alone["curve"][-1]["loss"]
    return {
        "loss": final["loss"], "clean_equal_time": at_time["loss"], "clean_equal_samples": equal["loss"],
        "alone": by_themselves, "ratio_equal_time": final["loss"] / at_time["loss"],
        "ratio_equal_samples": final["loss"] / equal["loss"], "ratio_alone": final["loss"] / by_themselves,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--attackers", default="1,2,3")
    parser.add_argument("--defences", default="screening,scored")
    parser.add_argument("--steps", type=int, default=64, help="steps per training peer")
    parser.add_argument("--period", type=float, default=4.0, help="steps between a peer's exchanges")
    parser.add_argument("--evals", type=int, default=8, help="honest evaluations per run, evenly spaced")
    parser.add_argument(
        "--score-windows", type=int, default=8, help="held windows a merge is scored on"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.01, help="relative rise of the held loss a merge may cause"
    )
    parser.add_argument(
        "--trust-ramp", type=float, default=Trust.ramp, help="passes after which a peer is scored half the time"
    )
    parser.add_argument(
        "--trust-floor", type=float, default=Trust.min_rate, help="the least share of a trusted peer's merges scored"
    )
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--baselines", type=Path, nargs="+", default=[],
                        help="reuse the attack-free runs (attack none and alone) of this earlier output with the same "
                             "steps, period and defence settings, rather than run them again")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/poisoning.json"))
    parser.add_argument("--report", type=Path, nargs="+", default=None,
                        help="run nothing: combine these outputs (baselines and attacks from separate runs) into one table")
    args = parser.parse_args(argv)
    if args.report:
        print_table(combine([row for path in args.report for row in json.loads(path.read_text())["rows"]]))
        return 0
    torch.set_num_threads(1)
    task = load_task(args.task)
    if args.evals % args.peers:
        parser.error("--evals must be a multiple of --peers: equal samples falls on the attack-free run's grid")
    rows: list[dict] = []
    reused = [row for path in args.baselines for row in json.loads(path.read_text())["rows"]]

    def record(row: dict, began: float) -> dict:
        rows.append({**row, "wall_s": round(time.monotonic() - began, 1)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        return row

    for seed in (int(s) for s in args.seeds.split(",")):
        for defence in args.defences.split(","):
            make = functools.partial(vetting, task, defence, score_windows=args.score_windows, tolerance=args.tolerance,
                                     trust_ramp=args.trust_ramp, trust_floor=args.trust_floor)  # fmt: skip

            def swarm(attack: str | None, attackers: int, peers: int, make=make, seed: int = seed) -> dict:
                return run_swarm(task, build(task, attack, attackers, peers, seed, make), args.steps, args.period,
                                 seed, args.evals)  # fmt: skip

            key = {"seed": seed, "defence": defence}

            def baseline(attackers: int, key: dict = key, swarm=swarm) -> dict:
                began, label = time.monotonic(), {"attack": "none" if attackers == 0 else "alone", "attackers": attackers}
                found = [r for r in reused if r.items() >= {**key, **label}.items()]
                if found:
                    rows.append(found[0])
                    return found[0]
                return record({**key, **label, **swarm(None, 0, args.peers - attackers)}, began)

            clean = baseline(0)
            for k in (int(a) for a in args.attackers.split(",")):
                alone = baseline(k)
                for attack in filter(None, args.attacks.split(",")):  # none: the baselines only
                    began = time.monotonic()
                    result = swarm(attack, k, args.peers)
                    record({**key, "attack": attack, "attackers": k, **result, **compare(result, clean, alone)}, began)
    print_table(rows)
    return 0


def combine(rows: list[dict]) -> list[dict]:
    """`rows` from several outputs, each attacked run compared again with the baselines among them (the last of each kind)."""
    baselines = {(r["seed"], r["defence"], r["attack"], r["attackers"]): r for r in rows if r["attack"] in ("none", "alone")}
    out = list(baselines.values())
    for r in rows:
        if r["attack"] in ("none", "alone"):
            continue
        clean = baselines.get((r["seed"], r["defence"], "none", 0))
        alone = baselines.get((r["seed"], r["defence"], "alone", r["attackers"]))
        out.append({**r, **compare(r, clean, alone)} if clean and alone else r)
    return out


def print_table(rows: list[dict]) -> None:
    """Medians over seeds: honest loss against the honest peers alone and the attack-free swarm of all peers."""
    print("\n| defence | attack | attackers | seeds | honest loss | ×alone | ×clean, equal samples | ×clean, equal time "
          "| attackers' merges refused | honest merges refused | exchange CPU share |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    keys = sorted({(r["defence"], r["attack"], r["attackers"]) for r in rows}, key=lambda k: (k[0], k[2], k[1] != "alone", k[1]))
    for defence, attack, k in keys:
        mine = [r for r in rows if (r["defence"], r["attack"], r["attackers"]) == (defence, attack, k)]

        def med(key: str, mine: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        loss = med("loss") if "loss" in mine[0] else statistics.median(r["curve"][-1]["loss"] for r in mine)
        ratios = [f"{med(key):.3f}" if key in mine[0] else "—" for key in ("ratio_alone", "ratio_equal_samples", "ratio_equal_time")]
        refused = [refused_share(mine, honest=False), refused_share(mine, honest=True)]
        print(f"| {defence} | {attack} | {k} | {len(mine)} | {loss:.3f} | {' | '.join(ratios)} | {' | '.join(refused)} "
              f"| {med('exchange_cpu_share'):.1%} |")  # fmt: skip


def refused_share(rows: list[dict], honest: bool) -> str:
    """The share of the honest peers' verdicts on honest (or attacking) partners that refused, over `rows`."""
    judged = [v for r in rows for name, v in r["refusals"].items() if (name == "honest") == honest]
    total = sum(v["merged"] + v["refused"] for v in judged)
    return f"{sum(v['refused'] for v in judged) / total:.0%}" if total else "—"


if __name__ == "__main__":
    sys.exit(main())
