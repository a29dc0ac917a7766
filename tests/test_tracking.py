"""Experiment tracking (node/ops/tracking.py): `--tensorboard` and `--wandb` write the node's status scalars.

What the writers wrote is read back with TensorBoard's `EventAccumulator` and from the offline
W&B run's file (`tests/wandb_offline.py`); W&B runs offline only (conftest.py sets WANDB_MODE).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import murmur
from murmur.node.learn.tasks import DigitsTask
from murmur.node.ops.config import NodeConfig
from murmur.node.ops.tracking import (
    TAGS,
    ScalarWriter,
    TensorBoardWriter,
    Tracking,
    TrackingUnavailable,
    WandbWriter,
    require_trackers,
    scalars_of,
)
from tests.status_example import example_status
from tests.wandb_offline import read_offline_run

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
BUILT_IN_LOOP_TAGS = {*TAGS, "murmur/eval/accuracy", "murmur/eval/loss"}  # digits' held-out metrics


@pytest.fixture(autouse=True)
def _wandb_offline_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B's files under this test's folder, offline, whatever the environment says."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    for name in ("WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(name, raising=False)
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None:  # W&B reads its variables once per process: the next test's WANDB_DIR needs a fresh start
        wandb.teardown()


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in `log_dir`'s event files, by tag, as (step, value) in the order written."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


class Recording(ScalarWriter):
    def __init__(self, fail_on_write: bool = False) -> None:
        self.writes: list[tuple[int, Mapping[str, float]]] = []
        self.closed = False
        self.fail_on_write = fail_on_write

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self.fail_on_write:
            raise OSError("disk full")
        self.writes.append((step, dict(scalars)))

    def close(self) -> None:
        self.closed = True


def test_the_scalars_of_a_status_are_its_tagged_values() -> None:
    assert scalars_of(example_status()) == {
        "murmur/loss": 0.5, "murmur/samples_per_s": 320.0, "murmur/merges": 1.0, "murmur/bytes_sent": 2000.0,
        "murmur/bytes_received": 1000.0, "murmur/peers": 2.0, "murmur/eval/accuracy": 0.8,
    }  # fmt: skip
    before_the_first_step = scalars_of(example_status(loss=math.nan, eval={}, exchanges={}))
    assert "murmur/loss" not in before_the_first_step and before_the_first_step["murmur/merges"] == 0.0


def test_tracking_writes_once_per_step_of_own_work_and_drops_a_failing_writer() -> None:
    kept, failing = Recording(), Recording(fail_on_write=True)
    tracking = Tracking([failing, kept])
    for samples in (0, 0, 640, 640, 1280):  # status ticks while the node waits, then trains
        tracking.record(example_status(samples=samples))
    assert [step for step, _ in kept.writes] == [0, 640, 1280]
    assert kept.writes[-1][1] == scalars_of(example_status())
    tracking.close()
    assert kept.closed and not failing.closed  # the failing one was dropped at its first write
    tracking.record(example_status(samples=2000))
    assert len(kept.writes) == 3  # closed: no more writes


def test_the_tensorboard_writer_writes_event_files_tensorboard_reads(tmp_path: Path) -> None:
    writer = TensorBoardWriter(tmp_path / "tb")
    writer.write(10, {"murmur/loss": 2.0, "murmur/peers": 1.0})
    writer.write(20, {"murmur/loss": 1.5, "murmur/peers": 3.0})
    writer.close()
    assert tensorboard_scalars(tmp_path / "tb") == {
        "murmur/loss": [(10, 2.0), (20, 1.5)],
        "murmur/peers": [(10, 1.0), (20, 3.0)],
    }


def test_the_wandb_writer_writes_an_offline_run_grouped_by_run_id(tmp_path: Path) -> None:
    writer = WandbWriter("my-project", peer_id="12D3KooWabcdefgh12345678", run_id="swarm-1", task="digits")
    writer.write(10, {"murmur/loss": 2.0, "murmur/peers": 1.0})
    writer.write(20, {"murmur/loss": 1.5, "murmur/peers": 3.0})
    writer.close()
    run = read_offline_run(tmp_path)
    assert (run.project, run.name, run.group) == ("my-project", "murmur-12345678", "swarm-1")
    assert {k: run.config[k] for k in ("peer_id", "run_id", "task")} == {
        "peer_id": "12D3KooWabcdefgh12345678",
        "run_id": "swarm-1",
        "task": "digits",
    }
    assert [(row["_step"], row["murmur/loss"], row["murmur/peers"]) for row in run.history] == [
        (10, 2.0, 1.0),
        (20, 1.5, 3.0),
    ]


def test_the_wandb_run_opens_beside_the_users_own_and_leaves_it_global_and_open() -> None:
    import wandb

    users = wandb.init(project="user-project")  # e.g. a Trainer's report_to="wandb", opened before the peer
    try:
        writer = WandbWriter("my-project", peer_id="12D3KooWabcdefgh12345678", run_id="swarm-1", task="digits")
        assert wandb.run is users  # the user's `wandb.log` still goes to the user's run
        writer.write(1, {"murmur/loss": 1.0})
        writer.close()
        wandb.log({"user/metric": 1.0})  # raises if closing the node's run had finished the user's
    finally:
        users.finish()


@pytest.mark.parametrize(
    ("module", "option", "extra"),
    [("torch.utils.tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")],
)
def test_a_missing_package_is_a_typed_error_naming_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, option: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what `import` does then: ImportError, as if not installed
    settings = {option: tmp_path / "tb" if option == "tensorboard" else "project"}
    with pytest.raises(
        TrackingUnavailable, match=rf"^--{option} needs the {extra} package, .*: pip install 'murmur-gossip\[{extra}\]'$"
    ):
        require_trackers(NodeConfig(**settings))
    model = DigitsTask().build_model()
    with pytest.raises(murmur.TrackingUnavailable, match=rf"pip install 'murmur-gossip\[{extra}\]'"):
        murmur.Peer(model, DigitsTask().make_optimizer(model), listen=LOOPBACK, data_dir=tmp_path / "data", **settings)
    assert not (tmp_path / "data").exists()  # refused before the node was started


def test_a_tracker_its_backend_refuses_is_a_typed_error_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(TrackingUnavailable, match=r"^--tensorboard: cannot write to .*a-file/tb: NotADirectoryError: "):
        TensorBoardWriter(tmp_path / "a-file" / "tb")
    model = DigitsTask().build_model()
    with pytest.raises(
        murmur.TrackingUnavailable, match=r"^--tensorboard: cannot write to .*a-file/tb: NotADirectoryError: "
    ):
        murmur.Peer(model, DigitsTask().make_optimizer(model), listen=LOOPBACK, data_dir=tmp_path / "data",
                    tensorboard=tmp_path / "a-file" / "tb")  # fmt: skip
    import wandb

    def no_credentials(**settings: object) -> None:  # what W&B raises online without an API key, and no terminal to ask
        raise wandb.errors.UsageError("api_key not configured (no-tty).\n call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_credentials)
    with pytest.raises(TrackingUnavailable) as refused:
        WandbWriter("p", peer_id="12D3KooWabcdefgh12345678", run_id="r", task="digits")
    assert str(refused.value) == (
        "--wandb: W&B could not start a run: UsageError: api_key not configured (no-tty). call wandb.login(key=[your_api_key])"
    )


def test_murmur_run_without_the_package_stops_in_one_line_before_it_starts(tmp_path: Path) -> None:
    missing = tmp_path / "site" / "wandb"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    done = subprocess.run(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path / "data"), "--wandb", "p", "--duration", "1"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "murmur run: error: --wandb needs the wandb package, which is not installed (No module named 'wandb'): "
        "pip install 'murmur-gossip[wandb]'\n"
    )
    assert not (tmp_path / "data").exists()


def test_murmur_run_with_a_tensorboard_folder_it_cannot_make_stops_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path / "data"), "--listen", LOOPBACK[0],
         "--tensorboard", str(tmp_path / "a-file" / "tb"), "--duration", "1"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"murmur run: error: --tensorboard: cannot write to {tmp_path / 'a-file' / 'tb'}: NotADirectoryError: "
    )
    assert not (tmp_path / "data" / "checkpoints").exists()  # it never trained


def _tick(data_dir: Path) -> dict:
    """The data dir's status.json as the node's last status tick wrote it (the tick that also recorded it), or {}."""
    try:
        return json.loads((data_dir / "status.json").read_text())
    except (OSError, ValueError):  # not written yet, or mid-replace
        return {}


def _wait_for(data_dir: Path, ready: Callable[[dict], bool], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _tick(data_dir)
        if ready(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"{data_dir}'s status never got ready within {timeout} s")


def test_murmur_run_writes_both_trackers_while_it_runs_and_flushes_them_on_sigterm(tmp_path: Path) -> None:
    data = tmp_path / "data"
    node = subprocess.Popen(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(data), "--listen", LOOPBACK[0], "--threads", "1",
         "--eval-every", "0.5", "--tensorboard", str(tmp_path / "tb"), "--wandb", "murmur-test", "--run-id", "tracked"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Two status ticks with an evaluation: the writers have written while the node runs, not only at its end.
        first = _wait_for(data, lambda s: s.get("eval") and s.get("samples", 0) > 0, timeout=90)
        _wait_for(data, lambda s: s.get("samples", 0) > first["samples"] and s["t"] > first["t"], timeout=60)
        node.send_signal(signal.SIGTERM)
        _, err = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate()
    assert node.returncode == 0, err[-2000:]
    final = json.loads((data / "status.json").read_text())

    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == BUILT_IN_LOOP_TAGS
    steps = [step for step, _ in scalars["murmur/samples_per_s"]]
    assert len(steps) >= 3 and steps == sorted(set(steps))
    assert steps[-1] == final["samples"]  # the last point is the final status, written as the node stopped
    assert scalars["murmur/samples_per_s"][-1][1] == pytest.approx(final["samples_per_s"])
    assert scalars["murmur/peers"][-1][1] == 0 and scalars["murmur/merges"][-1][1] == 0  # alone

    run = read_offline_run(tmp_path)
    assert (run.project, run.group, run.config["peer_id"]) == ("murmur-test", "tracked", final["peer_id"])
    assert [row["_step"] for row in run.history] == steps  # the same records as TensorBoard's
    for tag, points in scalars.items():
        logged = [(row["_step"], row[tag]) for row in run.history if tag in row]
        assert logged == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag


def test_a_peer_tracks_its_swarm_from_the_users_loop(tmp_path: Path) -> None:
    task = DigitsTask()
    models = [task.build_model() for _ in range(2)]
    optimizers = [task.make_optimizer(m) for m in models]
    with (
        murmur.Peer(models[0], optimizers[0], run_id="t", listen=LOOPBACK, data_dir=tmp_path / "a",
                    tensorboard=str(tmp_path / "tb")) as tracked,
        # One thread steps both: neither can serve the other's state sync or parting merge while it opens or
        # closes the other, so those would wait out their timeout.
        murmur.Peer(models[1], optimizers[1], run_id="t", listen=LOOPBACK, data_dir=tmp_path / "b",
                    bootstrap=tracked.addrs, no_state_sync=True, exchange_timeout=1.0) as other,
    ):  # fmt: skip
        batches = [task.train_batches(0), task.train_batches(1)]
        deadline, tick = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            tick = _tick(tmp_path / "a")
            if tick.get("known_peers") == 1 and tick["exchanges"].get("merged", 0) >= 2:
                break
            for peer, model, optimizer, shard in zip((tracked, other), models, optimizers, batches):
                x, y = next(shard)
                loss = task.loss(model, (x, y))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                peer.step(samples=len(x), loss=loss.item())
            time.sleep(0.005)
    assert tick.get("known_peers") == 1 and tick["exchanges"].get("merged", 0) >= 2, tick.get("exchanges")
    final = json.loads((tmp_path / "a" / "status.json").read_text())
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == set(TAGS)  # a Peer's loop evaluates nothing of its own
    at_tick = {tag: dict(points)[tick["samples"]] for tag, points in scalars.items()}  # the tick's own record
    assert at_tick["murmur/peers"] == 1 and at_tick["murmur/merges"] == tick["exchanges"]["merged"]
    assert tick["bytes_out"] > 0 and tick["bytes_in"] > 0
    assert at_tick["murmur/bytes_sent"] == pytest.approx(tick["bytes_out"], rel=1e-6)  # TensorBoard keeps float32
    assert at_tick["murmur/bytes_received"] == pytest.approx(tick["bytes_in"], rel=1e-6)
    assert scalars["murmur/loss"][-1] == (final["samples"], pytest.approx(final["loss"]))  # flushed on close
