"""The poisoning benchmark's attacks on a small in-process swarm: scored merges keep the honest peers learning."""

import time

import pytest

from lab.attacks import ATTACKS
from lab.poisoning import build, compare, run_swarm, vetting
from lab.swarm import start_peer, start_swarm, stop_swarm, wait_for_address
from murmur.node.learn.tasks import load_task

pytestmark = pytest.mark.slow
PEERS, STEPS, PERIOD, EVALS = 4, 32, 4.0, 4


@pytest.fixture(scope="module")
def task():
    return load_task("charlm")


def swarm(task, attack, defence):
    peers = build(task, attack, 1 if attack else 0, PEERS, 0, lambda shard: vetting(task, defence, shard))
    return run_swarm(task, peers, STEPS, PERIOD, 0, EVALS)


@pytest.fixture(scope="module")
def clean(task):
    """The attack-free swarm, and its honest peers alone (all but the attacker's place)."""
    return swarm(task, None, "scored"), run_swarm(task, build(task, None, 0, PEERS - 1, 0, lambda s: vetting(task, "scored", s)),
                                                  STEPS, PERIOD, 0, EVALS)


@pytest.mark.parametrize("attack", ATTACKS)
def test_scored_merges_keep_honest_loss_within_2_percent_of_the_honest_peers_alone(task, clean, attack: str) -> None:
    result = swarm(task, attack, "scored")
    ratio = compare(result, *clean)["ratio_alone"]
    print(f"{attack}: honest loss {ratio:.3f}x the honest peers' alone; {result['refusals']}")
    assert ratio <= 1.02
    honest, attacker = result["refusals"]["honest"], result["refusals"][f"peer-{PEERS - 1}"]
    assert honest["refused"] <= 0.2 * (honest["merged"] + honest["refused"])  # few honest merges refused
    if attack in ("data", "signflip"):  # the attacks whose models add loss: mostly refused (a free-rider's echo of a
        # model it just received passes, and is harmless; see docs/poisoning.md)
        assert attacker["refused"] > attacker["merged"], attacker


def test_real_peers_refuse_a_data_poisoner_that_changed_no_code(tmp_path) -> None:
    """Three `murmur run` peers scoring merges, and one that trains charlm's model on corrupted text."""
    extra = ["--task", "charlm", "--duration", "25", "--log-level", "DEBUG", "--score-windows", "32"]
    honest = start_swarm(tmp_path, [1, 1, 1], extra, fork=True)
    poisoner = start_peer(
        9, tmp_path, 1, ["--task", "lab.attacks:corrupted_charlm", *extra[2:]], wait_for_address(honest[0]), fork=True
    )
    deadline = time.monotonic() + 25 + 60
    while time.monotonic() < deadline and any(p.process.poll() is None for p in honest):
        time.sleep(0.5)
    stop_swarm([*honest, poisoner])
    assert all(p.process.returncode == 0 for p in honest)
    lines = [
        line
        for p in honest
        for line in (p.data_dir / "log.txt").read_text().splitlines()
        if f"exchange with {poisoner.peer_id[-8:]}:" in line
    ]
    refused = [
        line for line in lines if "rejected (scored: merging the partner's model raises our held loss by" in line
    ]
    merged = [line for line in lines if ": merged" in line]
    print(f"{len(refused)} refused, {len(merged)} merged")
    assert refused and len(refused) > len(merged), (refused[:2], merged[:2])
