"""A plain PyTorch training loop that joins a Murmur swarm: 4 lines of Murmur in your own loop.

A small character model (output layer tied to the embedding, as in GPT-2) learns Python
source from the standard library, with an LR schedule that follows the swarm's progress
(cosine with warmup over `peer.work`, so a peer that joins late resumes it where the swarm is),
gradient clipping and gradient accumulation.

    python examples/plain_loop.py --data-dir /tmp/a --listen /ip4/0.0.0.0/tcp/4001
    python examples/plain_loop.py --data-dir /tmp/b --bootstrap /ip4/<A's IP>/tcp/4001/p2p/<A's id>

Runs offline on a CPU in well under a minute (`--seconds`); prints the loss and the swarm's progress.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import murmur
from murmur.schedule import cosine_with_warmup

CONTEXT, DIM, VOCAB = 8, 64, 256


class CharModel(nn.Module):
    """The next byte from the previous `CONTEXT` bytes; the output layer is the embedding, transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Sequential(nn.Linear(CONTEXT * DIM, 256), nn.GELU(), nn.Linear(256, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: Murmur sends and merges it once

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.emb(context).flatten(1)))


def corpus(limit: int = 400_000) -> torch.Tensor:
    """Bytes of the standard library's source: offline, the same on every machine."""
    data = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:60])[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(len(data) - CONTEXT - 1, (size,), generator=gen)
        window = torch.stack([data[s : s + CONTEXT + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="~/.murmur-example")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--addr-file", help="write this peer's addresses here (for the second peer to bootstrap from)")
    parser.add_argument("--seconds", type=float, default=20.0, help="train this long (a SIGTERM ends it sooner, cleanly)")
    parser.add_argument("--schedule-samples", "--swarm-samples", dest="schedule_samples", type=float, default=100_000,
                        help="the schedule's length, in the swarm's progress (`peer.work`, samples)")
    parser.add_argument("--seed", type=int, default=0, help="this peer's data order")
    args = parser.parse_args()

    torch.manual_seed(0)  # every peer starts from the same model
    torch.set_num_threads(1)
    model = CharModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data, accumulate, micro = corpus(), 2, 32

    with murmur.Peer(model, optimizer, run_id="plain-loop-example", listen=[args.listen], bootstrap=args.bootstrap,
                     data_dir=args.data_dir, addr_file=args.addr_file) as peer:
        print(f"peer {peer.peer_id} at {peer.addrs[0]}", flush=True)
        # Cosine with warmup over the swarm's progress (a newcomer starts where the swarm is), not this loop's steps.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: cosine_with_warmup(
            peer.work, warmup=0.05 * args.schedule_samples, total=args.schedule_samples, floor=0.1))
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # `kill` ends training like --seconds does
        stream, deadline, step = batches(data, micro, args.seed), time.monotonic() + args.seconds, 0
        while time.monotonic() < deadline and not stop:
            for _ in range(accumulate):  # gradient accumulation: 2 micro-batches per optimizer step
                x, y = next(stream)
                loss = F.cross_entropy(model(x), y)
                (loss / accumulate).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            peer.step(samples=accumulate * micro, loss=loss.item())
            step += 1
            if step % 200 == 0:
                print(f"step {step} loss {loss.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"work {peer.work:.0f}", flush=True)
        status = peer.status()
    print(f"done: {step} steps, loss {status['loss']:.3f}, work {peer.work:.0f}, {status['samples']} own samples, "
          f"{peer.swarm_samples:.0f} swarm samples, merged {status['exchanges'].get('merged', 0)} times", flush=True)


if __name__ == "__main__":
    main()
