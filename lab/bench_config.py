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
    # digits' spec fixes SGD at lr 0.05 (momentum 0.9); `lr_scale` holds the multipliers `murmur bench --sweep-lr`
    # chose, each between worse neighbours (docs/bench/sweep-lr, docs/bench/digits-lr-with-average); diloco trains
    # at sync-equal's, solo at murmur's until a sweep chooses its own. Runs are short, and an evaluation is cheap,
    # so every method evaluates every 0.25 s. Accuracy on the small held-out set is noisy from one evaluation to
    # the next: read where it first crossed the target,
    # sync-equal would read high, so every method trains past `equal_samples` and is read at that count.
    "digits": {"step_time": 20.0, "target": 0.95, "metric": "accuracy", "higher": True, "max_s": 120.0,
               "lr_scale": {"sync-equal": 8.0, "diloco": 8.0, "sync-proportional": 16.0,
                            **dict.fromkeys(["murmur-uniform", "murmur-work", "murmur", "solo"], 8.0)},
               "local_steps": 8, "eval_every": 0.25, "equal_samples": 10_240},
    # `step_time` keeps the headline mix's training within the machine's 2 cores, so that every emulated device
    # keeps its speed (docs/history/2026-12-06-lab-calibration.md). `lr_scale`: the choices of `murmur bench --sweep-lr`
    # (docs/bench/sweep-lr); sync-adaptive and the diloco variants, not swept, train at sync-proportional's rate.
    "charlm": {"step_time": 80.0, "target": 2.5, "metric": "loss", "higher": False, "max_s": 120.0,
               "lr_scale": {"sync-proportional": 0.5, "sync-adaptive": 0.5, "diloco": 0.5, "diloco-proportional": 0.5},
               "local_steps": 8},
    # 2.15M parameters (8.6 MB of float32), the slow-link task. `step_time` keeps the headline mix within 2 cores
    # (docs/history/2026-12-06-lab-calibration.md). An evaluation costs a step or two, so every peer evaluates every 6 s, not every
    # second. diloco syncs every 4 steps: over a slow link one all-reduce of the whole model costs several steps.
    "charlm-large": {"step_time": 1250.0, "target": 3.0, "metric": "loss", "higher": False, "max_s": 120.0,
                     "lr_scale": {}, "local_steps": 4, "eval_every": 6.0},
}
# What every task, seed, mix and scenario runs before its methods, to compare them with:
#   ideal     every peer alone for a few seconds: Σ standalone speeds (throughput)
#   solo      every peer alone to the target, same pacing: the fastest peer's own time is what no swarm must lose to
#   headroom  sync all-reduce on as many peers as fast as the fastest: how much sooner the task lets N peers learn
REFERENCES = ["ideal", "solo", "headroom"]
METHODS = ["sync-equal", "sync-proportional", "sync-adaptive", "diloco", "diloco-proportional", "murmur-uniform", "murmur-work", "murmur"]
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
    # The exchange share as it was measured first: of exchanges' whole duration (wall), float32 on the wire.
    "murmur-share-0.05": ["--exchange-share", "0.05", "--exchange-share-of", "wall", "--wire-dtype", "float32"],
    "murmur-share-0.25": ["--exchange-share", "0.25", "--exchange-share-of", "wall", "--wire-dtype", "float32"],
    "murmur-share-0.5": ["--exchange-share", "0.5", "--exchange-share-of", "wall", "--wire-dtype", "float32"],
    "murmur-share-1": ["--exchange-share", "1", "--exchange-share-of", "wall", "--wire-dtype", "float32"],
    "murmur-int8-share-1": ["--exchange-share", "1", "--exchange-share-of", "wall", "--wire-dtype", "int8"],
    # The defaults before the arena: float32 on the wire, exchanges at most 10 % of wall time.
    "murmur-fp32-wall-0.1": ["--exchange-share", "0.1", "--exchange-share-of", "wall", "--wire-dtype", "float32"],
    # A share of exchanges' CPU time, with the int8 wire (the defaults are cpu, 1 and int8).
    "murmur-int8-cpu-0.25": ["--exchange-share", "0.25", "--exchange-share-of", "cpu", "--wire-dtype", "int8"],
    "murmur-int8-cpu-1": ["--exchange-share", "1", "--exchange-share-of", "cpu", "--wire-dtype", "int8"],
    "murmur-fp16": ["--wire-dtype", "float16"],
    "murmur-sparse": ["--compression", "sparse"],
    "murmur-strong": ["--compression", "strong"],
    "murmur-solo": ["--average-every", "1000000"],  # every peer trains alone: what merging buys
}


def at_chosen_lr(methods: list[str]) -> list[tuple[str, None]]:
    """A configuration's "runs": each method at its task's chosen learning rate (`TASKS[task]["lr_scale"]`).

    Every configuration names what it runs this one way: (method, learning-rate scale or None) pairs.
    """
    return [(m, None) for m in methods]


SWEEP_METHODS = ["solo", "sync-equal", "sync-proportional", "murmur"]
# A ×2 grid around the rate each method trains at (`lr_scale`): the choice is confirmed when it beats both
# neighbours, and a best rate at an edge says which way to sweep on. A config's "lr_factors" multiply its runs' scales.
SWEEP_FACTORS = [0.25, 0.5, 1.0, 2.0, 4.0]
# The default run is sized for a quarter of an hour on 2 cores: digits' homogeneous and mild mixes and the
# `murmur-work` row (`murmur`'s defaults while they are average, work weights, own Adam moments) run with
# `--mixes` / `--methods`.
DEFAULT = {"tasks": ["digits", "charlm"], "mixes": {"digits": ["headline", "extreme"], "charlm": ["headline"]},
           "seeds": [0, 1, 2], "max_s": {"digits": 25.0, "charlm": 60.0},
           "runs": at_chosen_lr(["sync-equal", "sync-proportional", "diloco", "murmur-uniform", "murmur"])}
QUICK = {"tasks": ["digits"], "mixes": {"digits": ["headline"]}, "seeds": [0], "max_s": {"digits": 20.0}, "runs": at_chosen_lr(METHODS)}
SWEEP = {"tasks": ["charlm", "digits"], "mixes": {"charlm": ["headline"], "digits": ["headline"]}, "seeds": [0, 1, 2],
         "max_s": DEFAULT["max_s"], "sweep": True, "runs": at_chosen_lr(SWEEP_METHODS), "lr_factors": SWEEP_FACTORS}
# Slow links (`murmur bench --link-mbit`, root): the 2M-parameter LM over capped links, the baselines over the same
# links. Murmur runs with its own exchange cadence; nothing is tuned per link. The uneven variant gives each peer of
# the headline mix its own cap, in peer order (`--link-mbit 100,50,20,10`). 180 s: over a 20 Mbit/s link every
# all-reduce of the 8.6 MB model takes seconds, and the synchronous baselines need minutes to reach the target.
# Every method evaluates its live weights here: with steps and all-reduces this long, a 10-step average would lag
# the run by a sizeable part of it, and the published slow-link figures are of live weights.
SLOW_LINK = {"tasks": ["charlm-large"], "mixes": {"charlm-large": ["headline"]}, "seeds": [0, 1, 2],
             "max_s": {"charlm-large": 180.0},
             "runs": at_chosen_lr(["sync-equal", "sync-proportional", "diloco", "murmur-work", "murmur"]),
             "link_mbit": [20.0], "ema_decay": 0.0}
SLOW_LINK_UNEVEN = {**SLOW_LINK, "link_mbit": [100.0, 50.0, 20.0, 10.0]}
# The real arena on loopback (`murmur bench --scenario NAME[,NAME]`, `--trace FILE`): charlm's headline mix under
# a speed trace (`lab.traces`) over a 90 s horizon, against the sync baselines that follow changing speeds. The target
# is lower than charlm's own so that every method is still training when the scenario's events come (a third of the
# horizon on); loss at equal samples is read where sync-adaptive, the best-tuned of them, reached it.
ARENA = {"tasks": ["charlm"], "mixes": {"charlm": ["headline"]}, "seeds": [0, 1, 2], "max_s": {"charlm": 120.0},
         "horizon_s": {"charlm": 90.0}, "target": {"charlm": 2.0}, "reference": "sync-adaptive", "scenarios": ["drift"],
         "runs": at_chosen_lr(["sync-adaptive", "sync-proportional", "murmur"])}
# The slow-link arena (`murmur bench --long-horizon`, root): charlm-large's headline mix over uneven links for 10
# minutes a run. Its links are 100, 50, 20 and 10 Mbit/s scaled by LONG_HORIZON_LINK_SCALE, so that one float32
# model transfer takes as many fast-peer steps as a 1B-parameter model's on one A100 would at those rates
# (20 steps at 100 Mbit/s; the arithmetic is in docs/arena.md). DiLoCo runs at the H its sweep chose
# (`tuned_local_steps`, seed 0: docs/arena.md); `--local-steps 8,32,128` sweeps it again. Every peer starts
# from the task's seeded initial model (`same_init`), as DDP's broadcast would give, instead of pulling it over a
# link that would take minutes.
LONG_HORIZON_NOMINAL_MBIT = [100.0, 50.0, 20.0, 10.0]
LONG_HORIZON_LINK_SCALE = 0.0275
LONG_HORIZON = {"tasks": ["charlm-large"], "mixes": {"charlm-large": ["headline"]}, "seeds": [0, 1, 2],
                "max_s": {"charlm-large": 600.0}, "target": {"charlm-large": 2.8}, "reference": "diloco-proportional", "ema_decay": 0.0,
                "link_mbit": [round(m * LONG_HORIZON_LINK_SCALE, 4) for m in LONG_HORIZON_NOMINAL_MBIT],
                "same_init": True, "tuned_local_steps": {"diloco-proportional": 128, "diloco": 32},
                "runs": at_chosen_lr(["diloco-proportional", "diloco", "murmur", "murmur-int8-share-1"])}
