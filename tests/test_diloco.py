"""Tests for lab/diloco.py: int8 quantization, the compressed all-reduce on 2 real gloo ranks (loopback), the
weighted outer step; and the diloco modes end to end (2 ranks, ~1.5 s of training each)."""

from __future__ import annotations

import multiprocessing
import queue
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lab import diloco
from lab import sync_baseline as sb
from murmur.node.learn.tasks import DigitsTask

BLOCK = diloco.BLOCK


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each value's block's largest magnitude, x padded to whole blocks."""
    padded = torch.zeros(-(-len(x) // BLOCK) * BLOCK)
    padded[: len(x)] = x.abs()
    return padded.view(-1, BLOCK).amax(dim=1).repeat_interleave(BLOCK)[: len(x)]


def test_quantize_roundtrip_is_within_half_a_step_of_each_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(4 * BLOCK) * torch.tensor([1e-4, 1.0, 0.0, 1e3]).repeat_interleave(BLOCK)  # one all-zero block
    x[5] = 40.0  # an outlier coarsens only its own block
    codes, scales = diloco.quantize(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.shape == x.shape and scales.shape == (4,)
    back = diloco.dequantize(codes, scales)
    assert back.dtype == torch.float32
    err = (back - x).abs()
    assert torch.all(err <= scales.repeat_interleave(BLOCK) / 2 * (1 + 1e-5))
    assert torch.all(err <= _block_absmax(x) / 254 * (1 + 1e-5))
    assert torch.all(back[2 * BLOCK : 3 * BLOCK] == 0)
    assert back[5] == pytest.approx(40.0) and codes.abs().max() == 127
    assert (back[BLOCK : 2 * BLOCK] - x[BLOCK : 2 * BLOCK]).abs().max() < 1.0 / 254 * 5  # unit-scale block: fine steps


def test_quantize_wants_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        diloco.quantize(torch.zeros(BLOCK + 1))
    with pytest.raises(ValueError, match="1-D"):
        diloco.quantize(torch.zeros(2, BLOCK))


def test_int8_bytes_counts_both_halves_of_the_exchange() -> None:
    # digits' 9610 values over 2 ranks: shards of 19 blocks (4864 values, 19 scales); 2 control slots
    assert diloco.shard_length(9610, 2) == 4864
    assert diloco.int8_bytes(9610, 2, 2) == 2 * 1 * (4864 + 4 * 19) + 8
    assert diloco.int8_bytes(9610, 2, 1) == 0  # alone: nothing to send
    assert diloco.shard_length(10, 4) == BLOCK  # a tiny payload still sends one block per rank
    float32 = 2 * (2 - 1) / 2 * 4 * 9610
    assert float32 / diloco.int8_bytes(9610, 2, 2) > 3.8


def _reduce_rank(rank: int, port: int, inputs: list[list[float]], numel: int, results: Any) -> None:
    # plain lists through the queues: a tensor would travel as shared memory its sender may free first
    try:
        timeout = timedelta(seconds=20)
        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        flat = torch.tensor(inputs[rank])
        diloco.all_reduce_int8(flat, numel)
        dist.destroy_process_group()
        results.put((rank, flat.tolist()))
    except BaseException as e:  # noqa: BLE001 - the test must hear about it
        results.put((rank, repr(e)))


def test_int8_all_reduce_on_two_gloo_ranks_is_the_sum_within_the_quantization_bound() -> None:
    torch.manual_seed(1)
    numel = 3 * BLOCK + 17  # padded to whole blocks and split in two shards
    inputs = [
        torch.cat([torch.randn(numel) * scale, torch.tensor([1.0, 0.25 * k])]) for k, scale in ((0, 1.0), (1, 3.0))
    ]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([sb.RANK_MODULE])
    results = ctx.Queue()
    args = [x.tolist() for x in inputs]
    procs = [
        ctx.Process(target=_reduce_rank, args=(r, store.port, args, numel, results), daemon=True) for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=60) for _ in procs)
    except queue.Empty:
        pytest.fail("a rank did not report within 60 s")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert all(isinstance(v, list) for v in got.values()), got
    assert got[0] == got[1]  # every rank holds the same result
    out, want = torch.tensor(got[0]), inputs[0] + inputs[1]
    assert out[numel:].tolist() == [2.0, 0.25]  # the control slots travel exactly
    # each input is off by at most half its block's step, the summed shard once more by its own
    bound = (_block_absmax(inputs[0][:numel]) + _block_absmax(inputs[1][:numel])) * 2 / 254
    err = (out[:numel] - want[:numel]).abs()
    assert torch.all(err <= bound * (1 + 1e-4))
    assert err.max() > 0  # it really went through int8


def test_the_outer_step_takes_the_sample_weighted_mean_pseudo_gradient() -> None:
    start = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([[3.0]]))]
    outers = [diloco.Outer(start, lr=0.5, momentum=0.0) for _ in range(2)]
    moved = [[p.detach() - torch.full_like(p, d) for p in start] for d in (0.3, 0.1)]  # rank 0 went 3x as far
    summed = torch.zeros(3)
    for outer, params, weight in zip(outers, moved, (3.0, 1.0)):  # e.g. 3 and 1 inner steps of one batch
        flat = torch.zeros(3)
        outer.pseudo_gradient(params, flat, weight)
        summed += flat
    params = [torch.nn.Parameter(p.clone()) for p in moved[1]]
    outers[1].step(params, summed, 4.0)
    mean_delta = (3 * 0.3 + 1 * 0.1) / 4  # 0.25
    for p, s, a in zip(params, start, outers[1].anchor):
        torch.testing.assert_close(p.detach(), s.detach() - 0.5 * mean_delta)
        torch.testing.assert_close(a.detach(), p.detach())  # every rank restarts from the anchor


# ---------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def proportional_run() -> dict[str, Any]:
    return sb.run_sync("digits", [1.0, 2.0], "diloco-proportional", 1.5, 10.0, None, local_steps=8)


def test_diloco_proportional_gives_the_slow_rank_fewer_inner_steps(proportional_run: dict[str, Any]) -> None:
    r = proportional_run
    assert r["method"] == "diloco-proportional" and r["outer_wire"] == "int8" and r["local_steps"] == 8
    assert r["outer_lr"] == 0.7
    fast, slow = r["peers"]
    assert r["inner_steps"][0] == 8 and 3 <= r["inner_steps"][1] <= 5  # x2 slower: about half the steps
    assert [fast["local_steps"], slow["local_steps"]] == r["inner_steps"]
    assert r["rebalances"] >= 3  # once a round
    assert fast["steps"] > 1.4 * slow["steps"]  # and the rounds still end together
    assert fast["samples"] == fast["steps"] * 32 and slow["samples"] == slow["steps"] * 32
    assert r["curve"][-1]["samples"] == r["samples"] == fast["samples"] + slow["samples"]
    per_round = diloco.int8_bytes(9610, 2 + 2, 2)  # control: eval, stop and the two speed slots
    assert fast["bytes_sent"] == slow["bytes_sent"] > 0 and fast["bytes_sent"] % per_round == 0
    assert r["curve"][-1]["accuracy"] > r["curve"][0]["accuracy"] + 0.3


def test_diloco_over_the_float32_wire_counts_ring_bytes() -> None:
    r = sb.run_sync("digits", [1.0, 1.0], "diloco", 1.5, 10.0, None, local_steps=4, outer_wire="float32")
    assert r["method"] == "diloco" and r["outer_wire"] == "float32" and r["inner_steps"] == [4, 4]
    grad_bytes = sum(p.numel() * p.element_size() for p in DigitsTask().build_model().parameters())
    for p in r["peers"]:
        assert p["steps"] == r["steps"] and p["steps"] % 4 == 0
        assert p["bytes_sent"] == int(p["steps"] // 4 * 2 * (2 - 1) / 2 * grad_bytes)
    assert r["curve"][-1]["accuracy"] > r["curve"][0]["accuracy"] + 0.3


def test_bad_wire_or_rebalance_interval_starts_no_rank() -> None:
    with pytest.raises(ValueError, match="outer_wire"):
        sb.run_sync("digits", [1.0, 1.0], "diloco", 1.0, 10.0, None, outer_wire="int4")
    with pytest.raises(ValueError, match="rebalance_every"):
        sb.run_sync("digits", [1.0, 1.0], "adaptive", 1.0, 10.0, None, rebalance_every=0)
    assert multiprocessing.active_children() == []
