"""`murmur.Peer`: the user's loop trains, the node gossips; misuse is a typed error that loses nothing.

Real libp2p hosts on loopback; the CLI peer is a separate `murmur run` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import murmur
from murmur.node.learn.checkpoint import load_latest
from murmur.node.learn.tasks import DigitsTask

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def digits() -> tuple[DigitsTask, torch.nn.Module, torch.optim.Optimizer]:
    task = DigitsTask()
    model = task.build_model()
    return task, model, task.make_optimizer(model)


def train(peer: murmur.Peer, task: DigitsTask, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, shard: int = 0) -> None:
    batches = task.train_batches(shard)
    for _ in range(steps):
        x, y = next(batches)
        loss = task.loss(model, (x, y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        peer.step(samples=len(x), loss=loss.item())


def test_a_step_after_close_is_refused(tmp_path: Path) -> None:
    task, model, optimizer = digits()
    with murmur.Peer(model, optimizer, run_id="t", listen=LOOPBACK, data_dir=tmp_path) as peer:
        assert peer.addrs and all(a.endswith(f"/p2p/{peer.peer_id}") for a in peer.addrs)
        train(peer, task, model, optimizer, 3)
        status = peer.status()
        assert status["samples"] == 3 * task.batch_size and status["phase"] == "training"
    with pytest.raises(murmur.PeerClosed, match="closed"):
        peer.step(samples=1)
    assert json.loads((tmp_path / "status.json").read_text())["samples"] == 3 * task.batch_size


def test_resume_from_a_checkpoint(tmp_path: Path) -> None:
    task, model, optimizer = digits()
    with murmur.Peer(model, optimizer, run_id="t", listen=LOOPBACK, data_dir=tmp_path) as peer:
        train(peer, task, model, optimizer, 5)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _, fresh, fresh_optimizer = digits()
    first = next(iter(saved))
    assert not torch.equal(fresh.state_dict()[first], saved[first])  # the fresh model starts elsewhere
    with murmur.Peer(fresh, fresh_optimizer, run_id="t", listen=LOOPBACK, data_dir=tmp_path) as resumed:
        assert resumed.samples == 5 * task.batch_size
        for name, tensor in fresh.state_dict().items():
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
        assert fresh_optimizer.state_dict()["state"]  # momentum came back too
        train(resumed, task, fresh, fresh_optimizer, 2)
    assert resumed.samples == 7 * task.batch_size


def test_a_checkpoint_of_another_model_is_kept_and_refused(tmp_path: Path) -> None:
    task, model, optimizer = digits()
    with murmur.Peer(model, optimizer, run_id="t", listen=LOOPBACK, data_dir=tmp_path):
        pass
    other = torch.nn.Linear(64, 10)
    with pytest.raises(murmur.ModelMismatch, match="checkpoint .* is not this model's: .*fingerprint"):
        murmur.Peer(other, torch.optim.SGD(other.parameters(), lr=0.1), run_id="t", listen=LOOPBACK, data_dir=tmp_path)
    assert load_latest(tmp_path / "checkpoints") is not None  # nothing lost


def test_a_model_that_differs_from_the_runs_is_refused_by_fingerprint(tmp_path: Path) -> None:
    task, model, optimizer = digits()
    with murmur.Peer(model, optimizer, run_id="t", listen=LOOPBACK, data_dir=tmp_path / "a") as first:
        other = torch.nn.Linear(64, 10)
        with pytest.raises(murmur.ModelMismatch, match="refused this model: .*model fingerprint"):
            murmur.Peer(other, torch.optim.SGD(other.parameters(), lr=0.1), run_id="t", listen=LOOPBACK,
                        bootstrap=first.addrs, data_dir=tmp_path / "b")


def test_an_optimizer_that_does_not_own_the_model_is_refused(tmp_path: Path) -> None:
    _, model, _ = digits()
    _, _, foreign = digits()
    with pytest.raises(murmur.ForeignOptimizer, match="not this model's"):
        murmur.Peer(model, foreign, data_dir=tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_cuda_is_refused(tmp_path: Path) -> None:
    _, model, optimizer = digits()
    with pytest.raises(murmur.DeviceError, match="cuda"):
        murmur.Peer(model, optimizer, device="cuda", data_dir=tmp_path)


def test_options_are_murmur_runs_with_its_names_and_defaults(tmp_path: Path) -> None:
    import inspect

    params = inspect.signature(murmur.Peer).parameters
    assert params["wire_dtype"].default == "int8" and params["view_size"].default == 32 and params["merge"].default == "average"
    _, model, optimizer = digits()
    with pytest.raises(TypeError, match="did you mean 'wire_dtype'"):
        murmur.Peer(model, optimizer, wire_type="int8", data_dir=tmp_path)
    with pytest.raises(ValueError, match="invalid wire_dtype='int4'"):
        murmur.Peer(model, optimizer, wire_dtype="int4", data_dir=tmp_path)
    with pytest.raises(TypeError, match=r"bootstrap takes a list \(e.g. bootstrap=\[...\]\), got str"):
        murmur.Peer(model, optimizer, bootstrap="/ip4/127.0.0.1/tcp/1/p2p/x", data_dir=tmp_path)
    with pytest.raises(ValueError, match="invalid bootstrap"):
        murmur.Peer(model, optimizer, bootstrap=["/ip4/127.0.0.1/tcp/1"], data_dir=tmp_path)
    with pytest.raises(ValueError, match="duration is for `murmur run`'s own training loop"):
        murmur.Peer(model, optimizer, duration=2.0, data_dir=tmp_path)
    with pytest.raises(ValueError, match="ema_decay is for `murmur run`'s own training loop; a murmur.Peer trains and evaluates"):
        murmur.Peer(model, optimizer, ema_decay=0.0, data_dir=tmp_path)
    with pytest.raises(ValueError, match="exactly one of samples= or tokens="):
        with murmur.Peer(model, optimizer, listen=LOOPBACK, data_dir=tmp_path) as peer:
            peer.step()


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_an_api_peer_and_a_cli_peer_train_together(tmp_path: Path) -> None:
    task, model, optimizer = digits()
    with murmur.Peer(model, optimizer, run_id="mixed", listen=LOOPBACK, data_dir=tmp_path / "api", wire_dtype="bfloat16") as peer:
        cli = subprocess.Popen(
            [sys.executable, "-m", "murmur.node.cli", "run", "--task", "digits", "--run-id", "mixed", "--data-dir", str(tmp_path / "cli"),
             "--listen", LOOPBACK[0], "--bootstrap", peer.addrs[0], "--duration", "60", "--threads", "1", "--log-level", "WARNING"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            # 40 s to merge, counted once the CLI peer trains: its start-up (imports, model pull) is
            # not what this tests, and on a loaded machine it can take most of a fixed window.
            batches, give_up, deadline = task.train_batches(1), time.monotonic() + 90, None
            while time.monotonic() < (deadline or give_up):
                if deadline is None and _status(tmp_path / "cli" / "status.json").get("phase") == "training":
                    deadline = time.monotonic() + 40
                x, y = next(batches)
                loss = task.loss(model, (x, y))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                peer.step(samples=len(x))
                if peer.status()["exchanges"].get("merged", 0) >= 3 and _status(tmp_path / "cli" / "status.json").get("exchanges", {}).get("merged", 0) >= 3:
                    break
                time.sleep(0.005)
            ours, theirs = peer.status(), _status(tmp_path / "cli" / "status.json")
        finally:
            cli.terminate()
            _, err = cli.communicate(timeout=30)
    assert ours["exchanges"].get("merged", 0) >= 3, (ours["exchanges"], ours["recent_exchanges"], theirs, err.decode()[-2000:])
    assert theirs["exchanges"].get("merged", 0) >= 3, theirs.get("exchanges")
    assert theirs["peers"] == [peer.peer_id] and ours["peers"] == [theirs["peer_id"]]
    assert peer.swarm_samples > peer.samples  # the CLI peer's work reached this model


def test_a_peer_with_no_one_to_join_says_so_and_can_wait_for_a_first_peer(tmp_path: Path) -> None:
    _, model, optimizer = digits()
    absent = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGzh6mGrMG5RXEuq6k1qQ2VyS2MZHGuxnWX2WU6fbqT5j"
    with murmur.Peer(model, optimizer, run_id="t", listen=LOOPBACK, bootstrap=[absent], data_dir=tmp_path / "a") as alone:
        assert not alone.joined and alone.alone_reason == "127.0.0.1:1: unreachable: connection refused"
        assert alone.status()["joined"] is False
        with pytest.raises(murmur.NotJoined, match=r"no peer joined within 0.2 s: 127.0.0.1:1: unreachable: connection refused"):
            alone.wait_joined(timeout=0.2)
        _, model2, optimizer2 = digits()
        with murmur.Peer(model2, optimizer2, run_id="t", listen=LOOPBACK, bootstrap=alone.addrs, data_dir=tmp_path / "b") as second:
            second.wait_joined(timeout=30)
            assert second.joined and second.alone_reason is None
            alone.wait_joined(timeout=30)  # greeted by the second peer
            assert alone.joined


def test_a_refused_model_names_the_tensor_that_differs_and_leaves_no_checkpoint(tmp_path: Path) -> None:
    _, model, optimizer = digits()
    with murmur.Peer(model, optimizer, run_id="t", listen=LOOPBACK, data_dir=tmp_path / "a") as first:
        other = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        names = [n for n, _ in model.named_parameters()]
        with pytest.raises(murmur.ModelMismatch, match=r"model fingerprint differs in \S+: shape \S+ here, \S+ there") as refused:
            murmur.Peer(other, torch.optim.SGD(other.parameters(), lr=0.1), run_id="t", listen=LOOPBACK,
                        bootstrap=first.addrs, data_dir=tmp_path / "b")
        assert any(name in str(refused.value) for name in names)
        assert load_latest(tmp_path / "b" / "checkpoints") is None  # the next run, with the right model, is not blocked
        _, model2, optimizer2 = digits()
        # `first` is not stepping (one thread), so it could not serve a state sync.
        with murmur.Peer(model2, optimizer2, run_id="t", listen=LOOPBACK, bootstrap=first.addrs, data_dir=tmp_path / "b",
                         no_state_sync=True) as right:
            assert right.joined


def test_options_take_the_cli_flag_names_and_the_signature_lists_only_accepted_ones() -> None:
    import inspect

    from murmur.peer import run_config

    params = inspect.signature(murmur.Peer).parameters
    assert {"relay", "no_state_sync", "no_nat_traversal"} <= set(params)
    assert not {"relays", "sync_state", "nat_traversal", "duration", "eval_every", "ema_decay", "slowdown"} & set(params)
    assert params["no_state_sync"].default is False and params["task"].default is None
    by_flag = run_config({"relay": ["auto"], "no_state_sync": True, "no_nat_traversal": True})
    by_field = run_config({"relays": ["auto"], "sync_state": False, "nat_traversal": False})  # the older names still work
    assert by_flag == by_field and (by_flag.relays, by_flag.sync_state, by_flag.nat_traversal) == (["auto"], False, False)
    with pytest.raises(TypeError, match="both 'relay' and 'relays'"):
        run_config({"relay": [], "relays": []})
    with pytest.raises(ValueError, match="slowdown is for `murmur run`'s own training loop"):
        run_config({"slowdown": 2.0})


def test_a_users_model_is_labelled_by_task_or_its_class_not_digits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    class TinyNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    absent = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGzh6mGrMG5RXEuq6k1qQ2VyS2MZHGuxnWX2WU6fbqT5j"
    with murmur.Peer(model, optimizer, task="my-model", listen=LOOPBACK, bootstrap=[absent], data_dir=tmp_path / "a") as peer:
        assert peer.status()["task"] == "my-model"
    with murmur.Peer(model, optimizer, listen=LOOPBACK, data_dir=tmp_path / "b") as peer:
        assert peer.status()["task"] == "TinyNet"
    _, digits_model, digits_optimizer = digits()
    with murmur.Peer(digits_model, digits_optimizer, listen=LOOPBACK, data_dir=tmp_path / "c") as peer:
        assert peer.status()["task"] == "digits"  # the built-in model still joins a default `murmur run` swarm
    out, err = capsys.readouterr()
    # A library prints nothing to stdout, and py-libp2p's dial errors stay at DEBUG.
    assert out == "" and "Failed to open TCP stream" not in err
