"""Simulate Murmur at 100, 300 and 1,000 peers: gossip vs partial views vs a ring vs ideal all-reduce.

Every gossip peer runs the real averager (merge policy, screening, exchange state
machine, tensor codec, state sync) over simulated links in simulated time; see
`lab.simulation` for the network model. For each swarm size and topology this
runs one simulation on the digits task and records held-out accuracy (of a sample of
peers) and consensus distance (of all peers) on a simulated-time grid. `alone` (no
averaging: the reference) runs at the smallest size only, since its peers never
interact. Writes `results.json`, PNG plots and `summary.md` to `--out`.

    python -m lab.simulation.cli                  # 100, 300, 1000 peers
    python -m lab.simulation.cli --quick          # 20 and 50 peers
    python -m lab.simulation.cli --peers 1000 --topologies gossip,partial
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

from lab.extras import plotting_missing
from lab.progress import Progress
from lab.simulation import TOPOLOGIES, NetworkModel, SimConfig, simulate
from lab.simulation.report import fmt, write_report


def parse_args(argv: list[str] | None, root: Path) -> argparse.Namespace:
    """Parse `argv` (default `sys.argv[1:]`); the default output folders are under `root`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=None, help="comma-separated swarm sizes (default 100,300,1000; --quick: 20,50)")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help=f"comma-separated, from {','.join(TOPOLOGIES)}")
    p.add_argument(
        "--quick", action="store_true", help="small swarms and short runs: a smoke test of the whole pipeline"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default docs/sim; --quick: results/sim-quick)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.95, help="held-out accuracy target")
    p.add_argument("--max-time", type=float, default=10.0, help="simulated seconds at most per gossip-type run")
    p.add_argument("--allreduce-max-time", type=float, default=150.0, help="simulated seconds at most for all-reduce")
    p.add_argument(
        "--linger", type=float, default=1.0, help="keep simulating this long after 90%% of peers reach the target"
    )
    p.add_argument("--eval-sample", type=int, default=32, help="peers evaluated per grid point")
    p.add_argument("--eval-every", type=float, default=0.25, help="simulated seconds between evaluations")
    p.add_argument("--churn", type=float, default=0.01, help="fraction of the swarm replaced per simulated second")
    p.add_argument("--view-size", type=int, default=32, help="partial view size")
    p.add_argument(
        "--report-at", type=float, default=4.0, help="simulated time at which the table compares accuracy and consensus"
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="simulations to run at once (one process each; 2 uses both cores)"
    )
    p.add_argument(
        "--max-wall", type=float, default=900.0, help="real seconds at most per simulation (then marked truncated)"
    )
    p.add_argument("--replot", action="store_true", help="only rebuild the tables and plots from --out/results.json")
    args = p.parse_args(argv)
    sizes = args.peers or ("20,50" if args.quick else "100,300,1000")
    args.sizes = [int(n) for n in sizes.split(",")]
    args.topology_list = [t.strip() for t in args.topologies.split(",") if t.strip()]
    unknown = set(args.topology_list) - set(TOPOLOGIES)
    if unknown:
        p.error(f"unknown topologies {sorted(unknown)}; choose from {list(TOPOLOGIES)}")
    if args.quick:
        args.max_time, args.allreduce_max_time, args.eval_every, args.report_at = 4.0, 30.0, 0.5, 2.0
    args.out = args.out or (root / ("results/sim-quick" if args.quick else "docs/sim"))
    return args


def plan(args: argparse.Namespace) -> list[SimConfig]:
    """One config per (size, topology); `alone` only at the smallest size."""
    base = SimConfig(
        target=args.target, linger=args.linger, eval_every=args.eval_every, eval_sample=args.eval_sample,
        view_size=args.view_size, network=NetworkModel(churn=args.churn), seed=args.seed, max_wall_s=args.max_wall,
    )  # fmt: skip
    configs = []
    for n in args.sizes:
        for topology in args.topology_list:
            if topology == "alone" and n != min(args.sizes):
                continue
            max_time = args.allreduce_max_time if topology == "allreduce" else args.max_time
            configs.append(replace(base, peers=n, topology=topology, max_time=max_time))
    return configs


def _run(config: SimConfig) -> dict[str, Any]:
    result = simulate(config)
    record = result.to_json()
    record["evaluated"] = result.evaluated
    return record


def main(argv: list[str] | None = None, *, root: Path) -> int:
    """Run (or with `--replot` only re-report) the planned simulations; returns the exit status."""
    args = parse_args(argv, root)
    if plotting_missing("lab.simulation"):
        return 2
    if args.replot:
        saved = json.loads((args.out / "results.json").read_text())
        write_report(saved["runs"], args.out, saved["runs"][0]["config"]["target"], saved["meta"]["report_at"])
        return 0
    configs = plan(args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"simulate: {len(configs)} runs: {args.sizes} peers x {args.topology_list}; digits task, target accuracy {args.target:g};"
    )
    print(f"simulate: held-out accuracy is evaluated on a sample of {args.eval_sample} peers per grid point "
          f"(consensus distance on all peers)", flush=True)  # fmt: skip
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds torch's thread pools
    with (
        ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) if args.jobs > 1 else _Inline() as pool,
        Progress(total=len(configs), label="simulate") as progress,
    ):
        results = iter(pool.map(_run, configs))  # inline: each run happens when its result is taken
        for config in configs:
            progress.start(f"{config.peers} peers, {config.topology}")
            record = next(results)
            records.append(record)
            progress.advance()
            print(
                f"  {config.peers:5d} peers  {config.topology:9s}  target(median) {fmt(record['time_to_target'])} s"
                f"  target(90%) {fmt(record['time_to_target_p10'])} s  final acc {record['accuracy_median'][-1]:.3f}"
                f"  consensus {record['consensus'][-1]:.3f}  wall {record['wall_s']:.0f} s",
                flush=True,
            )
    total = time.perf_counter() - start
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "wall_s": total,
        "cpus": os.cpu_count(),
        "report_at": args.report_at,
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    write_report(records, args.out, args.target, args.report_at)
    print(f"simulate: {total:.0f} s in all")
    return 0


class _Inline:
    """`map` in this process (the default: the runs share one core politely)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn: Any, items: list[SimConfig]) -> Any:
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main(root=Path(__file__).resolve().parents[2]))
