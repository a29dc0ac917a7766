"""Large-model exchange benchmark: a ~25M-parameter model between two local peers, per wire dtype.

    python -m lab.bench_exchange [--params 25e6] [--exchanges 3] [--out docs/bench-exchange]

Two OS processes, each a real peer: `Libp2pTransport` over loopback (TCP + Noise +
yamux), a `TrainingLoop` on a wide MLP and the node's `Averager`. In one run it measures:

1. a raw py-libp2p stream between the same two hosts (MB/s, 1 MiB writes);
2. for each wire dtype, exchanges with training paused on both peers: duration, MB/s
   (parameter bytes both ways / duration) and each side's peak extra resident memory
   during the exchange (RSS sampled every 2 ms; training paused so that the figure is
   the exchange's own);
3. the same exchanges with both peers training: duration and how many training steps
   each side completed during them (training never waits for the network);
4. the error each lossy wire dtype adds to a merge: two digits models trained apart,
   merged in every dtype, compared with the exact float32 merge.

Writes `results.json` and `results.md` under `--out` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

from murmur.node.averaging.outcome import Result
from murmur.protocol.codec import WIRE_DTYPES, TensorSpec, quantize

RAW_PROTOCOL = "/murmur-bench/raw/1.0.0"
RUN_ID = "bench-exchange"
PAGE = os.sysconf("SC_PAGE_SIZE")


class WideMLPTask:
    """Three d×d linear layers (3d² + 3d parameters) learning the identity on Gaussian inputs."""

    name = "wide-mlp"
    batch_size = 32

    def __init__(self, params: int) -> None:
        from murmur.node.learn.tasks.task import Metric

        self.metric = Metric("loss", higher_is_better=False)
        self.width = int(math.sqrt(params / 3))

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        d = self.width
        return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_batches(self, shard: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(shard)
        while True:
            x = torch.randn(self.batch_size, self.width, generator=g)
            yield x, x

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x = torch.randn(64, self.width, generator=torch.Generator().manual_seed(10**6))
        with torch.no_grad():
            return {"loss": nn.functional.mse_loss(model(x), x).item()}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class MemorySampler:
    """Samples this process's resident memory every `interval` s on a daemon thread.

    Large buffers are mmapped and freed to the OS at once (as in `murmur run`), so RSS
    tracks live memory rather than what the allocator keeps for reuse.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.samples.append((time.time(), _rss()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def _peer(role: str, params: int, plan: dict, addr_q: Any, result_q: Any, training: Any, done: Any) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from murmur.node.averaging.factory import build_averager
    from murmur.node.learn.loop import TrainingLoop
    from murmur.node.net.libp2p_transport import Libp2pTransport
    from murmur.node.net.peers import PeerTable
    from murmur.node.net.transport import ByteStream

    transport = Libp2pTransport(create_new_key_pair())
    loop = TrainingLoop(WideMLPTask(params), shard=0 if role == "initiator" else 1)
    loop.step()  # both models carry work, so merges are real merges, not adoptions
    averager = build_averager(
        transport, loop.replica, run_id=RUN_ID, table=PeerTable(transport.peer_id, liveness_timeout=1e9),
        exchange_timeout=120.0, rng=random.Random(0),
    )  # fmt: skip
    steps: list[float] = []
    memory = MemorySampler()

    async def raw_sink(stream: ByteStream) -> None:
        total = 0
        while chunk := await stream.receive_some():
            total += len(chunk)
        await stream.send_all(total.to_bytes(8, "big"))
        await stream.close()

    async def train_when_asked() -> None:
        while not done.is_set():
            if training.is_set():
                await anyio.to_thread.run_sync(loop.step)
                steps.append(time.time())
            else:
                await anyio.sleep(0.02)

    transport.set_handler(RAW_PROTOCOL, raw_sink)
    results: dict[str, Any] = {"role": role, "numel": loop.replica.spec.numel}
    async with transport.run(["/ip4/127.0.0.1/tcp/0"]), anyio.create_task_group() as tg:
        tg.start_soon(train_when_asked)
        if role == "responder":
            addr_q.put((transport.peer_id, transport.addresses()))
            while not done.is_set():
                await anyio.sleep(0.05)
        else:
            peer_id, addrs = addr_q.get(timeout=120)
            results["raw"] = await _raw_throughput(transport, peer_id, addrs, plan["raw_mb"], plan["repeats"])
            results["exchanges"] = []
            for with_training in (False, True):
                training.set() if with_training else training.clear()
                await anyio.sleep(1.0 if with_training else 0.2)  # let steps start (or drain)
                for dtype in plan["dtypes"]:
                    averager.wire_dtype = dtype
                    for _ in range(plan["exchanges"]):
                        await anyio.sleep(0.5)  # the responder applies its merge a moment after we do
                        begin = time.time()
                        outcome = await averager.exchange_with(peer_id, addrs)
                        results["exchanges"].append({
                            "dtype": dtype, "training": with_training, "result": outcome.result,
                            "reason": outcome.reason, "begin": begin, "end": time.time(), "seconds": outcome.duration_s,
                            "bytes_each_way": loop.replica.spec.wire_size(dtype),
                        })  # fmt: skip
            training.clear()
            done.set()
        tg.cancel_scope.cancel()
    memory.stop()
    results["steps"] = steps
    results["memory"] = memory.samples
    result_q.put(results)


async def _raw_throughput(transport: Any, peer_id: str, addrs: list[str], megabytes: int, repeats: int) -> list[float]:
    """MB/s of one stream carrying `megabytes` MiB in 1 MiB writes, until the sink confirms."""
    block = os.urandom(1 << 20)
    rates = []
    for _ in range(repeats):
        stream = await transport.open_stream(peer_id, addrs, RAW_PROTOCOL)
        start = time.perf_counter()
        for _ in range(megabytes):
            await stream.send_all(block)
        await stream.close()
        ack = b""
        while len(ack) < 8 and (chunk := await stream.receive_some()):
            ack += chunk
        assert int.from_bytes(ack, "big") == megabytes << 20, "raw sink lost bytes"
        rates.append((megabytes << 20) / 1e6 / (time.perf_counter() - start))
    return rates


def _peer_process(role: str, params: int, plan: dict, addr_q: Any, result_q: Any, training: Any, done: Any) -> None:
    from murmur.node.ops.run import release_big_buffers_promptly

    release_big_buffers_promptly()  # as `murmur run` does
    torch.set_num_threads(1)
    anyio.run(_peer, role, params, plan, addr_q, result_q, training, done, backend="trio")


def run_pair(params: int, plan: dict) -> tuple[dict, dict]:
    """Run both peers as OS processes; return (initiator results, responder results)."""
    ctx = mp.get_context("spawn")
    addr_q, result_q = ctx.Queue(), ctx.Queue()
    training, done = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=_peer_process, args=(role, params, plan, addr_q, result_q, training, done), daemon=True)
        for role in ("responder", "initiator")
    ]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            r = result_q.get(timeout=plan["timeout_s"])
            results[r["role"]] = r
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results["initiator"], results["responder"]


def _window_stats(exchange: dict, side: dict) -> dict:
    begin, end = exchange["begin"], exchange["end"]
    before = [rss for t, rss in side["memory"] if t <= begin]
    during = [rss for t, rss in side["memory"] if begin <= t <= end]
    baseline = before[-1] if before else (during[0] if during else 0)
    return {
        "extra_mb": (max(during, default=baseline) - baseline) / 1e6,
        "steps": sum(1 for t in side["steps"] if begin <= t <= end),
    }


def merge_errors(dtypes: list[str], steps: int = 100) -> dict[str, dict[str, float]]:
    """Relative error a lossy wire dtype adds to one merge of two digits models trained apart."""
    from murmur.node.learn.loop import TrainingLoop
    from murmur.node.learn.rules import MergeDelta
    from murmur.node.learn.tasks import load_task

    a, b = TrainingLoop(load_task("digits"), shard=1), TrainingLoop(load_task("digits"), shard=2)
    for _ in range(steps):
        a.step()
        b.step()
    sa, sb = a.replica.snapshot().state, b.replica.snapshot().state
    exact = MergeDelta(sa, sb, 0.5)
    spec = TensorSpec.of(dict(sa.items()))
    norm_delta = math.sqrt(sum(float((exact[n] ** 2).sum()) for n in exact))
    norm_model = math.sqrt(sum(float((sa[n] ** 2).sum()) for n in sa))
    out = {}
    for dtype in dtypes:
        delta = MergeDelta(quantize(sa, spec, dtype), quantize(sb, spec, dtype), 0.5)
        err = math.sqrt(sum(float(((delta[n] - exact[n]) ** 2).sum()) for n in exact))
        out[dtype] = {"vs_merge_delta": err / norm_delta, "vs_model": err / norm_model}
    return out


def summarize(initiator: dict, responder: dict, params: int, errors: dict) -> dict:
    numel = initiator["numel"]
    rows = []
    for ex in initiator["exchanges"]:
        mine, theirs = _window_stats(ex, initiator), _window_stats(ex, responder)
        rows.append({
            **{k: ex[k] for k in ("dtype", "training", "result", "seconds", "bytes_each_way")},
            "mb_per_s": 2 * ex["bytes_each_way"] / 1e6 / ex["seconds"] if ex["seconds"] else None,
            "extra_memory_x_model": max(mine["extra_mb"], theirs["extra_mb"]) * 1e6 / (4 * numel),
            "steps_initiator": mine["steps"], "steps_responder": theirs["steps"],
        })  # fmt: skip
    table = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        idle = [r for r in rows if r["dtype"] == dtype and not r["training"] and r["result"] == Result.MERGED]
        busy = [r for r in rows if r["dtype"] == dtype and r["training"] and r["result"] == Result.MERGED]
        table.append({
            "dtype": dtype, "merged": f"{len(idle) + len(busy)}/{sum(r['dtype'] == dtype for r in rows)}",
            "seconds_idle": _median([r["seconds"] for r in idle]), "mb_per_s_idle": _median([r["mb_per_s"] for r in idle]),
            "extra_memory_x_model": max((r["extra_memory_x_model"] for r in idle), default=None),
            "seconds_training": _median([r["seconds"] for r in busy]),
            "steps_during_exchange": [(r["steps_initiator"], r["steps_responder"]) for r in busy],
            "merge_error_vs_delta": errors.get(dtype, {}).get("vs_merge_delta"),
            "merge_error_vs_model": errors.get(dtype, {}).get("vs_model"),
        })  # fmt: skip
    return {
        "params": numel, "model_mb_fp32": 4 * numel / 1e6, "raw_stream_mb_per_s": initiator["raw"],
        "table": table, "exchanges": rows, "merge_errors": errors,
    }


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def markdown(summary: dict) -> str:
    raw = summary["raw_stream_mb_per_s"]
    lines = [
        f"Model: {summary['params']:,} parameters ({summary['model_mb_fp32']:.0f} MB in float32). "
        f"Raw py-libp2p stream, same hosts, same run: {_median(raw):.1f} MB/s (median of {len(raw)}: "
        f"{', '.join(f'{r:.1f}' for r in raw)}).",
        "",
        "| wire dtype | merged | exchange s (idle) | MB/s both ways | peak extra memory × model | exchange s (training) | steps during exchange (A, B) | merge error vs delta | vs model |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["table"]:
        lines.append(
            f"| {r['dtype']} | {r['merged']} | {_f(r['seconds_idle'], '.2f')} | {_f(r['mb_per_s_idle'], '.1f')} | "
            f"{_f(r['extra_memory_x_model'], '.2f')} | {_f(r['seconds_training'], '.2f')} | "
            f"{' '.join(f'({a}, {b})' for a, b in r['steps_during_exchange'])} | "
            f"{_f(r['merge_error_vs_delta'], '.1e')} | {_f(r['merge_error_vs_model'], '.1e')} |"
        )
    return "\n".join(lines) + "\n"


def _f(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6, help="model size in parameters (default 25e6)")
    parser.add_argument("--exchanges", type=int, default=3, help="exchanges per wire dtype and phase")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,int8")
    parser.add_argument("--raw-mb", type=int, default=100, help="MiB per raw-stream measurement")
    parser.add_argument("--out", type=Path, default=Path("docs/bench-exchange"))
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in WIRE_DTYPES]
    if unknown:
        parser.error(f"unknown wire dtypes {unknown}; choose from {sorted(WIRE_DTYPES)}")
    plan = {"dtypes": dtypes, "exchanges": args.exchanges, "raw_mb": args.raw_mb, "repeats": 3, "timeout_s": 1200}
    started = time.monotonic()
    initiator, responder = run_pair(int(args.params), plan)
    summary = summarize(initiator, responder, int(args.params), merge_errors(dtypes))
    summary["wall_s"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    (args.out / "results.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"results: {args.out / 'results.json'}  ({summary['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
