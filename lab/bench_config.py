"""The benchmark's fixed workloads, speed mixes, methods and run configurations (`murmur bench`)."""

MIXES = {
    "homogeneous": [1.0, 1.0, 1.0, 1.0],
    "mild": [1.0, 1.0, 1.0, 2.0],
    "headline": [1.0, 1.0, 2.0, 4.0],
    "extreme": [1.0, 1.0, 1.0, 10.0],
    "pair": [1.0, 2.0],  # the smallest swarm, for the harness test
}
# Fixed workloads; step_time pads every step to S x step_time ms per 32 samples. `lr_scale`: each
# method's learning-rate multiplier, from `--sweep-lr` (methods not listed train at 1); `local_steps`: diloco's H;
# `eval_every`: seconds between held-out evaluations (default 1); `equal_samples`: where every method's metric is
# compared (all train past it), by default where sync-equal reached the target.
TASKS = {
    # digits' spec fixes SGD at lr 0.05 (momentum 0.9); the sweep (2 seeds, ×0.25-×8, live weights) found ×8 best for
    # sync-equal and ×4 for murmur. With the weight average (3 seeds, docs/bench/digits-lr-with-average) murmur is
    # best at ×8 and sync-proportional at ×16 (×32 diverges); sync-equal stays at ×8, diloco trains at its rate.
    # `murmur bench --sweep-lr` (3 seeds, ×2-×64, docs/bench/sweep-lr) confirms all three, each between worse neighbours.
    # Runs last 2-10 s, so every method evaluates (a few ms) every 0.25 s. Accuracy on the 360 held-out images swings
    # by ~1 point between evaluations, so sync-equal, read where it first crossed 0.95, read high there: every method
    # trains past 10,240 samples and is read at that count.
    "digits": {"step_time": 20.0, "target": 0.95, "metric": "accuracy", "higher": True, "max_s": 120.0,
               "lr_scale": {"sync-equal": 8.0, "diloco": 8.0, "sync-proportional": 16.0,
                            **dict.fromkeys(["murmur-uniform", "murmur-work", "murmur"], 8.0)},
               "local_steps": 8, "eval_every": 0.25, "equal_samples": 10_240},
    # A charlm step computes for ~24 ms on one core: at 80 ms the headline mix keeps ~0.8 of the 2 cores
    # busy training (at 40 ms it needed 1.65 and the emulated devices fell ~20 % behind their speeds).
    # `murmur bench --sweep-lr` (3 seeds, docs/bench/sweep-lr; scales there of the 1.5e-3 charlm had then): with
    # the weight average Murmur reaches loss 2.5 in 13 s (13-14) at 3e-3 against 15 s at 1.5e-3 and 29 s at 6e-3, so
    # 3e-3 is charlm's rate now; sync-equal is best there too (39.4 s, erratic: 37-54, against 40.3 at 1.5e-3);
    # sync-proportional is best at 1.5e-3 (16.1 s against 18.0 at 3e-3 and 24.1 at 7.5e-4); diloco, not swept,
    # keeps the 1.5e-3 it had.
    "charlm": {"step_time": 80.0, "target": 2.5, "metric": "loss", "higher": False, "max_s": 120.0,
               "lr_scale": {"sync-proportional": 0.5, "diloco": 0.5}, "local_steps": 8},
    # 2.15M parameters (8.6 MB of float32), the slow-link task. A step computes for ~410 ms on one thread (best of
    # 40, measured on the shared 2-core machine): at 1250 ms the headline mix keeps ~0.9 of the 2 cores busy
    # training (0.41 x (1 + 1 + 1/2 + 1/4) / 1.25). An evaluation (128 windows of 64 bytes) computes for ~0.6-1 s,
    # so every peer evaluates every 6 s, not every second. One sync-proportional run on loopback reached loss 3.0
    # after ~52 s (2.91 at 112 s; `python -m lab.sync_baseline --task charlm-large --slowdowns 1,1,2,4
    # --mode proportional --step-time-ms 1250 --duration 110 --eval-every 5`, on a busy machine).
    # diloco syncs every 4 steps: over a 20 Mbit/s link one all-reduce of 8.6 MB takes ~5 s.
    "charlm-large": {"step_time": 1250.0, "target": 3.0, "metric": "loss", "higher": False, "max_s": 120.0,
                     "lr_scale": {}, "local_steps": 4, "eval_every": 6.0},
}
METHODS = ["sync-equal", "sync-proportional", "diloco", "murmur-uniform", "murmur-work", "murmur"]
# What each Murmur method tells `murmur run` beyond the workload; `murmur` keeps every default.
MURMUR_ARGS = {
    "murmur-uniform": ["--merge", "average", "--weighting", "uniform"],
    "murmur-work": ["--merge", "average", "--weighting", "work"],
    "murmur": [],
    # Ablations, for `--methods` (not in the default run): what each part of the default buys.
    "murmur-keep-state": ["--merge", "average", "--weighting", "work", "--optimizer-state", "keep"],
    "murmur-avg-state": ["--merge", "average", "--weighting", "work", "--optimizer-state", "average"],
    "murmur-outer": ["--merge", "outer", "--weighting", "work", "--optimizer-state", "average"],
    "murmur-link-speed": ["--partners", "link-speed"],
    "murmur-share-0.05": ["--exchange-share", "0.05"],
    "murmur-share-0.25": ["--exchange-share", "0.25"],
    "murmur-share-0.5": ["--exchange-share", "0.5"],
    "murmur-fp16": ["--wire-dtype", "float16"],
}


def at_chosen_lr(methods: list[str]) -> list[tuple[str, None]]:
    """A configuration's "runs": each method at its task's chosen learning rate (`TASKS[task]["lr_scale"]`).

    Every configuration names what it runs this one way: (method, learning-rate scale or None) pairs.
    """
    return [(m, None) for m in methods]


SWEEP_METHODS = ["sync-equal", "sync-proportional", "murmur"]
# A ×2 grid around the rate each method trains at now (`lr_scale`): the choice is confirmed when it beats both
# neighbours, and a best rate at an edge says which way to sweep on. A config's "lr_factors" multiply its runs' scales.
SWEEP_FACTORS = [0.25, 0.5, 1.0, 2.0, 4.0]
# The default run fits 15 minutes on 2 cores: digits' homogeneous and mild mixes and the `murmur-work` row (today
# exactly `murmur`'s defaults: average, work weights, own Adam moments) run with `--mixes` / `--methods`.
DEFAULT = {"tasks": ["digits", "charlm"], "mixes": {"digits": ["headline", "extreme"], "charlm": ["headline"]},
           "seeds": [0, 1, 2], "max_s": {"digits": 25.0, "charlm": 60.0},
           "runs": at_chosen_lr(["sync-equal", "sync-proportional", "diloco", "murmur-uniform", "murmur"])}
QUICK = {"tasks": ["digits"], "mixes": {"digits": ["headline"]}, "seeds": [0], "max_s": {"digits": 20.0}, "runs": at_chosen_lr(METHODS)}
SWEEP = {"tasks": ["charlm", "digits"], "mixes": {"charlm": ["headline"], "digits": ["headline"]}, "seeds": [0, 1, 2],
         "max_s": DEFAULT["max_s"], "sweep": True, "runs": at_chosen_lr(SWEEP_METHODS), "lr_factors": SWEEP_FACTORS}
# Slow links (`murmur bench --link-mbit`, root): the 2M-parameter LM over capped links, the baselines over the same
# links. Murmur runs with its own exchange cadence; nothing is tuned per link. The uneven variant gives each peer of
# the headline mix its own cap, in peer order (`--link-mbit 100,50,20,10`). 180 s: at 20 Mbit/s one all-reduce of the
# 8.6 MB model takes ~5 s, so the synchronous baselines need ~2-3 minutes to reach charlm-large's target.
# Every method evaluates its live weights here: a 10-step average would lag these 1-3 minute runs by 10-50 s
# (steps of 1.25-5 s, all-reduces of ~5 s), and the published slow-link figures were measured live.
SLOW_LINK = {"tasks": ["charlm-large"], "mixes": {"charlm-large": ["headline"]}, "seeds": [0, 1, 2],
             "max_s": {"charlm-large": 180.0},
             "runs": at_chosen_lr(["sync-equal", "sync-proportional", "diloco", "murmur-work", "murmur"]),
             "link_mbit": [20.0], "ema_decay": 0.0}
SLOW_LINK_UNEVEN = {**SLOW_LINK, "link_mbit": [100.0, 50.0, 20.0, 10.0]}
