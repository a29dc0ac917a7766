"""One malicious peer among honest ones: honest peers keep learning and ban it."""

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lab.swarm import Peer, start_peer, start_swarm, stop_swarm, wait_for_address

pytestmark = pytest.mark.slow
TRAIN_S = 15.0  # every swarm trains at least this long, so that their accuracies compare
BAN_WITHIN_S = 45.0  # an attacked swarm trains on until most honest peers banned the attacker, at most this long
# Exchanges log at DEBUG.
EXTRA = ["--task", "digits", "--step-time", "20", "--duration", str(BAN_WITHIN_S), "--log-level", "DEBUG"]
ADVERSARY = [sys.executable, "-m", "lab.adversary"]


def final_accuracy(peers: list[Peer]) -> float:
    """The median peer's accuracy averaged over its last 3 evaluations (one reading is noisy)."""
    return statistics.median(statistics.mean(r["accuracy"] for r in p.metrics()[-3:]) for p in peers)


def banned_by(honest: list[Peer], attacker: Peer) -> set[int]:
    """The honest peers whose saved bans hold the attacker."""
    status = attacker.status()
    if status is None:
        return set()
    return {p.index for p in honest if (bans := p.data_dir / "bans.json").exists()
            and status.peer_id in json.loads(bans.read_text())}


def run(root: Path, attack: str | None) -> tuple[list[Peer], Peer | None]:
    """Train the honest swarm (and `attack`'s attacker) for `TRAIN_S`, and on until most honest peers banned the
    attacker: whether they meet it three times in a given time is chance, so the test waits for the bans, bounded."""
    honest = start_swarm(root, [1, 1, 2, 4], EXTRA, fork=True)  # ready in a second, not several
    attacker = None
    if attack:  # forked too: a fresh interpreter can take most of the honest peers' run to start
        bootstrap = wait_for_address(honest[0])
        attacker = start_peer(9, root, 1, EXTRA, bootstrap, command=ADVERSARY + ["--attack", attack], fork=True)
    everyone = honest + ([attacker] if attacker else [])
    began = time.monotonic()
    try:
        while time.monotonic() < began + BAN_WITHIN_S + 30 and any(p.process.poll() is None for p in honest):
            time.sleep(0.5)
            trained = time.monotonic() >= began + TRAIN_S
            if trained and (attacker is None or len(banned_by(honest, attacker)) > len(honest) / 2):
                break
    finally:
        stop_swarm(everyone)  # SIGTERM: the peers leave gracefully and exit 0
    return honest, attacker


ATTACKS = ["scale", "noise", "nan", "work"]


@pytest.fixture(scope="module")
def swarms(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, tuple[list[Peer], Peer | None]]:
    """The calm swarm (None) and one swarm per attack, three at a time: paced digits peers mostly sleep."""
    with ThreadPoolExecutor(3) as pool:
        runs = pool.map(lambda attack: run(tmp_path_factory.mktemp(attack or "calm"), attack), [None, *ATTACKS])
        return dict(zip([None, *ATTACKS], runs))


@pytest.mark.parametrize("attack", ATTACKS)
def test_honest_peers_keep_learning_and_ban_the_attacker(attack: str, swarms: dict) -> None:
    honest, attacker = swarms[attack]
    baseline = final_accuracy(swarms[None][0])
    assert all(p.process.returncode == 0 for p in honest)
    accuracy = final_accuracy(honest)
    print(f"attack {attack}: honest median accuracy {accuracy:.4f} vs {baseline:.4f} without the attacker")
    assert accuracy >= baseline - 0.01, (accuracy, baseline)
    attacker_id = attacker.status().peer_id
    bans = banned_by(honest, attacker)
    struck_out = {p.index for p in honest
                  if f"strike 3/3 for {attacker_id[-8:]}: " in (p.data_dir / "log.txt").read_text()}
    assert struck_out <= bans, f"struck out by {sorted(struck_out)}, banned by {sorted(bans)}"
    # Once most peers ban it, the attacker rarely reaches the rest within the run.
    assert len(bans) > len(honest) / 2, f"banned by {len(bans)} of {len(honest)} within {BAN_WITHIN_S:g} s"
    if attack != "work":  # a work liar's parameters are honest; everything else must never be merged
        merged = [line for p in honest for line in (p.data_dir / "log.txt").read_text().splitlines()
                  if f"exchange with {attacker_id[-8:]}: merged" in line]
        assert not merged, merged[:3]
