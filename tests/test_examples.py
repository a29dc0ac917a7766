"""The examples in `examples/` run offline and train together: each script as two OS processes
(two "machines") over loopback, the second joining through the first."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lab.swarm import free_port, peer_id

ROOT = Path(__file__).resolve().parents[1]
DONE = re.compile(r"done: .* (\d+) own samples, (\d+) swarm samples, merged (\d+) times")


def launch(script: str, data_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, f"examples/{script}", "--data-dir", str(data_dir), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, int, int]:
    """Wait for an example; return its (own samples, swarm samples, merges) from its last line."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    found = DONE.search(out)
    assert found, out[-3000:]
    return tuple(int(g) for g in found.groups())  # type: ignore[return-value]




def test_the_plain_loop_on_two_machines() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "B_SECONDS": "6",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # `python` is this interpreter
    done = subprocess.run(["sh", "examples/two_machines.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (own_b, swarm_b, merged_b), (own_a, swarm_a, merged_a) = [tuple(map(int, m)) for m in DONE.findall(done.stdout)]
    assert merged_a > 0 and merged_b > 0
    assert swarm_b > own_b  # the other peer's work reached this model (and its schedule)


STEPS_B = 200  # the second peer's steps: enough for both to merge


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "package", "step_samples"),
    [("hf_trainer.py", "transformers", 16), ("lightning_trainer.py", "lightning", 64)],  # samples per optimizer step
)
def test_a_trainer_example_with_two_peers(tmp_path: Path, script: str, package: str, step_samples: int) -> None:
    pytest.importorskip(package)
    # The first peer's identity and port are fixed beforehand, so both start at once.
    peer_a = peer_id(tmp_path / "a")
    listen_a = f"/ip4/127.0.0.1/tcp/{free_port()}"
    # The first trains until the second is done, then gets a SIGTERM: the two always overlap, however slow the start.
    first = launch(script, tmp_path / "a", "--listen", listen_a, "--steps", "100000")
    second = launch(script, tmp_path / "b", "--bootstrap", f"{listen_a}/p2p/{peer_a}", "--steps", str(STEPS_B), "--seed", "1")
    try:
        own_b, swarm_b, merged_b = finish(second, 120)
    finally:
        first.send_signal(signal.SIGTERM)
        own_a, swarm_a, merged_a = finish(first, 60)
    assert own_b == STEPS_B * step_samples and own_a > 0 and own_a % step_samples == 0
    assert merged_a > 0 and merged_b > 0
