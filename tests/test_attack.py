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
DURATION = 15.0
EXTRA = ["--task", "digits", "--step-time", "20", "--duration", str(DURATION), "--log-level", "DEBUG"]  # exchanges log at DEBUG
ADVERSARY = [sys.executable, "-m", "lab.adversary"]


def final_accuracy(peers: list[Peer]) -> float:
    """The median peer's accuracy averaged over its last 3 evaluations (one reading is noisy)."""
    return statistics.median(statistics.mean(r["accuracy"] for r in p.metrics()[-3:]) for p in peers)


def run(root: Path, attack: str | None) -> tuple[list[Peer], Peer | None]:
    honest = start_swarm(root, [1, 1, 2, 4], EXTRA, fork=True)  # ready in a second, not several
    attacker = None
    if attack:  # forked too: a fresh interpreter can take most of the honest peers' run to start
        bootstrap = wait_for_address(honest[0])
        attacker = start_peer(9, root, 1, EXTRA, bootstrap, command=ADVERSARY + ["--attack", attack], fork=True)
    everyone = honest + ([attacker] if attacker else [])
    deadline = time.monotonic() + DURATION + 40
    while time.monotonic() < deadline and any(p.process.poll() is None for p in honest):
        time.sleep(0.5)
    stop_swarm(everyone)
    return honest, attacker


ATTACKS = ["scale", "noise", "nan", "work"]


@pytest.fixture(scope="module")
def swarms(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, tuple[list[Peer], Peer | None]]:
    """The calm swarm (None) and one swarm per attack, two at a time: paced digits peers mostly sleep."""
    with ThreadPoolExecutor(2) as pool:
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
    banned_by = {p.index for p in honest if (bans := p.data_dir / "bans.json").exists()
                 and attacker_id in json.loads(bans.read_text())}
    struck_out = {p.index for p in honest
                  if f"strike 3/3 for {attacker_id[-8:]}: " in (p.data_dir / "log.txt").read_text()}
    assert struck_out <= banned_by, f"struck out by {sorted(struck_out)}, banned by {sorted(banned_by)}"
    # Once most peers ban it, the attacker rarely reaches the rest within the run.
    assert len(banned_by) > len(honest) / 2, f"banned by {len(banned_by)} of {len(honest)}"
    if attack != "work":  # a work liar's parameters are honest; everything else must never be merged
        merged = [line for p in honest for line in (p.data_dir / "log.txt").read_text().splitlines()
                  if f"exchange with {attacker_id[-8:]}: merged" in line]
        assert not merged, merged[:3]
