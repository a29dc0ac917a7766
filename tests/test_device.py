"""Devices: `--device` resolution and its errors, the CPU path end to end, and peers whose
models differ in device or dtype exchanging through the device-independent wire format."""

from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

import murmur.node.learn.device
from murmur.node.averaging.outcome import Result
from murmur.node.learn.checkpoint import read_checkpoint, save_checkpoint
from murmur.node.learn.device import DeviceError, check_mixed_precision, cpu_copy, resolve_device, to_device
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.tasks import Batch, DigitsTask
from murmur.node.net.transport import MemoryNetwork
from murmur.node.ops.node import STATUS_FILE, Node, NodeConfig
from murmur.node.ops.node_status import NodeStatus
from murmur.protocol.codec import decode_state, encode_state

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


class CastDigits(DigitsTask):
    """Digits with the model and inputs in another float dtype: a peer running another precision."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def build_model(self) -> nn.Module:
        return super().build_model().to(self.dtype)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return super().loss(model, (x.to(self.dtype), y))


# --- resolution ---------------------------------------------------------------------------


def _pretend(monkeypatch: pytest.MonkeyPatch, cuda_devices: int, mps: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(murmur.node.learn.device, "_mps_available", lambda: mps)


def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, cuda_devices=2, mps=True)
    assert resolve_device("auto") == torch.device("cuda", 0)
    _pretend(monkeypatch, cuda_devices=0, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    _pretend(monkeypatch, cuda_devices=0, mps=False)
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_index_is_explicit_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, cuda_devices=2, mps=False)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_unknown_and_unavailable_devices_are_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    for spec in ("gpu", "cuda:", "cuda:x", "CPU", "tpu"):
        with pytest.raises(DeviceError, match="unknown device"):
            resolve_device(spec)
    _pretend(monkeypatch, cuda_devices=0, mps=False)
    with pytest.raises(DeviceError, match="'cuda:0' is not available"):
        resolve_device("cuda:0")
    with pytest.raises(DeviceError, match="'mps' is not available"):
        resolve_device("mps")


def test_mixed_precision_is_refused_off_cuda() -> None:
    with pytest.raises(DeviceError, match="needs a CUDA device"):
        check_mixed_precision(torch.device("cpu"))
    with pytest.raises(DeviceError, match="needs a CUDA device"):
        TrainingLoop(DigitsTask(), shard=0, device="cpu", mixed_precision=True)


# --- helpers ------------------------------------------------------------------------------


def test_to_device_and_cpu_copy_walk_nested_containers() -> None:
    x, y = torch.ones(2), torch.zeros(2, dtype=torch.long)
    moved = to_device({"pair": (x, y), "list": [x], "n": 3}, torch.device("cpu"))
    assert isinstance(moved["pair"], tuple) and moved["pair"][1].dtype == torch.long and moved["n"] == 3
    copied = cpu_copy({"state": {"buf": x}, "groups": [{"lr": 0.1, "params": [0]}]})
    x.add_(1)  # a copy must not follow later changes to the live tensor
    assert torch.equal(copied["state"]["buf"], torch.ones(2))
    assert copied["groups"] == [{"lr": 0.1, "params": [0]}]


# --- CPU path end to end ------------------------------------------------------------------


@pytest.mark.anyio
async def test_cpu_nodes_train_and_merge(tmp_path: Path) -> None:
    net = MemoryNetwork()

    def make(name: str, bootstrap: list[str]) -> Node:
        config = NodeConfig(data_dir=tmp_path / name, bootstrap=bootstrap, device="cpu", gossip_every=0.2)
        return Node(config, net.transport(name))

    first = make("first", [])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            addrs = await tg.start(first.run)
            second = make("second", [addrs[0]])
            await tg.start(second.run)
            while not (second.averager.outcomes[Result.MERGED] and second.replica.samples):  # not a fixed training time
                await anyio.sleep(0.05)
            first.request_stop()
            second.request_stop()
    status = NodeStatus.from_json((tmp_path / "second" / STATUS_FILE).read_text())
    assert status.device == "cpu"
    assert status.samples > 0 and status.exchanges.get(Result.MERGED, 0) >= 1


# --- device- and dtype-independent exchange -----------------------------------------------


def _exchange(a: TrainingLoop, b: TrainingLoop) -> None:
    """One uniform merge between `a` and `b` through the codec, as the averager does it."""
    snap_a, snap_b = a.replica.snapshot(), b.replica.snapshot()
    remote_for_b = decode_state(encode_state(snap_a.state, a.replica.spec), b.replica.spec)
    remote_for_a = decode_state(encode_state(snap_b.state, b.replica.spec), a.replica.spec)
    a.replica.merge(snap_a, remote_for_a, 0.5, 1.0)
    b.replica.merge(snap_b, remote_for_b, 0.5, 1.0)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-6), (torch.bfloat16, 2e-2)])
def test_peers_in_different_dtypes_pair_and_merge_through_the_codec(dtype: torch.dtype, tolerance: float) -> None:
    a = TrainingLoop(DigitsTask(), shard=1, device="cpu")
    b = TrainingLoop(CastDigits(dtype), shard=2, device="cpu")
    assert a.replica.fingerprint == b.replica.fingerprint  # the dtype is not part of a model's identity
    for _ in range(3):
        a.step(), b.step()
    before_a, before_b = a.replica.snapshot().state, b.replica.snapshot().state
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in before_b.values())
    _exchange(a, b)
    after_a, after_b = a.replica.snapshot().state, b.replica.snapshot().state
    for name in after_a:
        mean = (before_a[name] + before_b[name]) / 2
        torch.testing.assert_close(after_a[name], mean, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(after_b[name], mean, atol=tolerance, rtol=tolerance)
    assert next(b.replica.model.parameters()).dtype == dtype  # merging does not change a model's own dtype
    b.step()  # and it still trains


def test_adopt_and_checkpoints_cross_dtypes(tmp_path: Path) -> None:
    source = TrainingLoop(DigitsTask(), shard=1, device="cpu")
    for _ in range(3):
        source.step()
    state = source.replica.checkpoint_state()
    assert all(t.device.type == "cpu" for t in state["model"].values())
    resumed = TrainingLoop(CastDigits(torch.float64), shard=1, device="cpu")
    resumed.replica.restore(read_checkpoint(save_checkpoint(tmp_path, state)))
    assert (resumed.replica.samples, resumed.replica.work) == (source.replica.samples, source.replica.work)
    for name, tensor in source.replica.model.state_dict().items():
        assert resumed.replica.model.state_dict()[name].dtype == torch.float64
        torch.testing.assert_close(resumed.replica.model.state_dict()[name].float(), tensor)
    momentum = next(iter(resumed.replica.optimizer.state.values()))["momentum_buffer"]
    assert momentum.dtype == torch.float64  # optimizer state follows its parameters
    fresh = TrainingLoop(CastDigits(torch.float64), shard=3, device="cpu")
    fresh.replica.adopt(source.replica.snapshot().state, work=source.replica.work)
    for name, tensor in fresh.replica.snapshot().state.items():
        torch.testing.assert_close(tensor, source.replica.snapshot().state[name])


# --- GPU (skipped without one) ------------------------------------------------------------


@needs_cuda
def test_cuda_trainer_exchanges_with_a_cpu_trainer_and_checkpoints_portably(tmp_path: Path) -> None:
    gpu = TrainingLoop(DigitsTask(), shard=1, device=resolve_device("cuda"))
    cpu = TrainingLoop(DigitsTask(), shard=2, device="cpu")
    for _ in range(3):
        gpu.step(), cpu.step()
    assert next(gpu.replica.model.parameters()).is_cuda
    assert all(t.device.type == "cpu" for t in gpu.replica.snapshot().state.values())
    before_gpu, before_cpu = gpu.replica.snapshot().state, cpu.replica.snapshot().state
    _exchange(gpu, cpu)
    for name, tensor in gpu.replica.snapshot().state.items():
        torch.testing.assert_close(tensor, (before_gpu[name] + before_cpu[name]) / 2)
        torch.testing.assert_close(tensor, cpu.replica.snapshot().state[name])
    path = save_checkpoint(tmp_path, gpu.replica.checkpoint_state())
    on_cpu = TrainingLoop(DigitsTask(), shard=1, device="cpu")
    on_cpu.replica.restore(read_checkpoint(path))
    on_cpu.step()  # optimizer state came back on the CPU too
    back_on_gpu = TrainingLoop(DigitsTask(), shard=1, device="cuda")
    back_on_gpu.replica.restore(read_checkpoint(path))
    back_on_gpu.step()


@needs_cuda
def test_mixed_precision_trains_on_cuda() -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    loop = TrainingLoop(DigitsTask(), shard=0, device="cuda", mixed_precision=True)
    losses = []
    for _ in range(30):
        loop.step()
        losses.append(loop.replica.last_loss)
    assert next(loop.replica.model.parameters()).dtype == torch.float32  # autocast leaves the weights alone
    assert losses[-1] < losses[0]
    assert loop.evaluate().metrics["accuracy"] > 0.5
