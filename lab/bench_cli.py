"""`murmur bench`'s command line: picks a configuration (`bench_config`), narrows it, runs it (`bench.run_bench`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab import bench
from lab.bench_config import (
    ARENA,
    DEFAULT,
    LONG_HORIZON,
    METHODS,
    MIXES,
    MURMUR_ARGS,
    QUICK,
    SLOW_LINK,
    SWEEP,
    SWEEP_FACTORS,
    SWEEP_METHODS,
    TASKS,
)
from lab.bench_report import rescore
from lab.extras import plotting_missing
from lab.links import LinkSpecError, LinksUnavailable, parse_link_mbit
from lab.traces import SCENARIOS, TraceError
from lab.traces import load as load_trace
from murmur.node.learn.weight_average import DEFAULT_DECAY


def _link_mbit(text: str) -> list[float]:
    try:
        return parse_link_mbit(text)
    except LinkSpecError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--link-mbit: ")) from None


def parse_method(text: str) -> tuple[str, float | None]:
    """`method` or `method@scale` -> (method, scale or None); raises ValueError naming what is wrong."""
    method, _, scale = text.partition("@")
    if method not in METHODS and method not in MURMUR_ARGS and method != "solo":  # solo runs anyway; named, at its scale
        raise ValueError(f"unknown method {method!r}: choose from {['solo', *METHODS, *MURMUR_ARGS]}")
    if not scale:
        return method, None
    if not float(scale) > 0:
        raise ValueError(f"learning-rate scale must be positive, got {scale!r}")
    return method, float(scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="murmur bench", description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="digits, headline mix, one seed")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks (default: digits,charlm)")
    parser.add_argument("--mixes", default=None, help=f"comma-separated mixes from {list(MIXES)}")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (seeds 0 … N-1)")
    parser.add_argument("--seed", default=None, metavar="I[,I...]",
                        help="exactly these seeds, e.g. 1,2 to add seeds to a finished run")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--sweep-lr", action="store_true",
                        help=f"run {SWEEP_METHODS} at {SWEEP_FACTORS} times the learning rate each trains at and print "
                             "the best of each (charlm and digits, headline mix, 3 seeds); with --methods, exactly the points named")
    parser.add_argument("--link-mbit", type=_link_mbit, default=None, metavar="MBIT[,MBIT...]",
                        help="slow links: cap every peer's link at MBIT Mbit/s, or each peer's in peer order (100,50,20,10); "
                             "one network namespace per peer and rank (needs root). Runs SLOW_LINK (charlm-large, headline mix, "
                             "3 seeds; --tasks/--mixes/--seeds change it)")
    parser.add_argument("--methods", default=None, metavar="M[@SCALE],…",
                        help=f"run these methods instead (from {[*METHODS, *(m for m in MURMUR_ARGS if m not in METHODS)]}), "
                             "each optionally at a learning-rate scale, e.g. sync-equal@0.5,murmur@2")
    parser.add_argument("--ema-decay", type=float, default=None, metavar="DECAY",
                        help=f"every method evaluates a moving average of its weights (default {DEFAULT_DECAY}, `murmur run`'s; "
                             "0: the live models)")
    parser.add_argument("--max-s", type=float, default=None, metavar="SECONDS",
                        help="stop every run after this long (default: the configuration's per task)")
    parser.add_argument("--target", type=float, default=None, metavar="VALUE",
                        help="the metric's target for every task (default: the configuration's, else the task's)")
    parser.add_argument("--scenario", default=None, metavar="NAME[,NAME...]",
                        help=f"the real arena: speeds that change and peers that come and go, from {list(SCENARIOS)} "
                             "(lab.traces). Runs ARENA (charlm, headline mix, 3 seeds; --tasks/--mixes/--seeds/--methods change it)")
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="the arena under your own speed trace (JSON: times and slowdowns per peer, optional "
                             "leave/crash/join events; see docs/bench.md)")
    parser.add_argument("--long-horizon", action="store_true",
                        help="the slow-link arena: LONG_HORIZON (charlm-large, headline mix, links 100/50/20/10 Mbit/s scaled to "
                             "its step time, 10 min a run, 3 seeds; needs root; see docs/bench.md)")
    parser.add_argument("--local-steps", default=None, metavar="H[,H...]",
                        help="run each DiLoCo method at each of these H (inner steps between syncs): the H sweep")
    parser.add_argument("--no-cpu-quotas", action="store_true",
                        help="let the emulated peers and ranks share the machine's cores instead of giving each an equal "
                             "CPU quota (cgroups, as root)")
    parser.add_argument("--rescore", type=Path, default=None, metavar="RESULTS_JSON",
                        help="run nothing: score an earlier run's results.json again and write the table and plots to --out")
    args = parser.parse_args(argv)
    if plotting_missing("murmur bench"):
        return 2
    if args.rescore:
        rescore(args.rescore, args.out)
        return 0
    arena = args.scenario is not None or args.trace is not None
    base = (QUICK if args.quick else SWEEP if args.sweep_lr else LONG_HORIZON if args.long_horizon else SLOW_LINK if args.link_mbit
            else ARENA if arena else DEFAULT)  # fmt: skip
    config = json.loads(json.dumps(base))
    if args.scenario is not None:
        config["scenarios"] = args.scenario.split(",")
        unknown = [s for s in config["scenarios"] if s not in SCENARIOS]
        if unknown:
            parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    if args.trace is not None:
        try:
            load_trace(args.trace)
        except TraceError as e:
            parser.error(str(e))
        config.pop("scenarios", None)
        config["trace_file"] = str(args.trace)
    if args.local_steps:
        try:
            config["local_steps"] = [int(h) for h in args.local_steps.split(",")]
        except ValueError:
            parser.error(f"--local-steps takes whole numbers of steps, got {args.local_steps!r}")
        if any(h < 1 for h in config["local_steps"]):
            parser.error("--local-steps must be at least 1")
    if args.link_mbit:
        config["link_mbit"] = args.link_mbit
    if args.tasks:
        config["tasks"] = args.tasks.split(",")
        unknown = [t for t in config["tasks"] if t not in TASKS]
        if unknown:
            parser.error(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
        for t in config["tasks"]:
            config["mixes"].setdefault(t, ["headline"])
            config["max_s"].setdefault(t, DEFAULT["max_s"].get(t, TASKS[t]["max_s"]))
    if args.mixes:
        config["mixes"] = {t: args.mixes.split(",") for t in config["tasks"]}
    if args.trace is not None:  # the trace says every peer's speed
        config["mixes"] = {t: ["trace"] for t in config["tasks"]}
    if args.max_s:
        config["max_s"] = dict.fromkeys(config["tasks"], args.max_s)
    if args.target is not None:
        config["target"] = dict.fromkeys(config["tasks"], args.target)
    if args.methods:
        try:
            config["runs"] = [parse_method(m) for m in args.methods.split(",")]
            config.pop("lr_factors", None)  # a sweep of named points runs exactly those
        except ValueError as e:
            parser.error(str(e))
    if args.seeds is not None and args.seed is not None:
        parser.error("give --seeds (how many) or --seed (which), not both")
    if args.seeds is not None:
        if args.seeds < 1:
            parser.error(f"--seeds is how many seeds to run (at least 1), got {args.seeds}; --seed I picks seed I")
        config["seeds"] = list(range(args.seeds))
    if args.seed is not None:
        try:
            config["seeds"] = [int(i) for i in args.seed.split(",")]
        except ValueError:
            parser.error(f"--seed takes whole numbers, e.g. 1,2, got {args.seed!r}")
    if args.no_cpu_quotas:
        config["cpu_quotas"] = False
    if args.ema_decay is not None:
        if not 0 <= args.ema_decay < 1:
            parser.error(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
        config["ema_decay"] = args.ema_decay
    try:
        bench.run_bench(config, args.out)
    except LinkSpecError as e:
        parser.error(str(e))
    except LinksUnavailable as e:
        print(f"murmur bench: skipped, slow links need network namespaces: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
