"""`charlm`: a small byte-level causal transformer LM on the Python standard library.

The corpus is the `.py` source of the running interpreter's standard library, so
every machine has it offline; peers on the same Python version read identical
bytes. The vocabulary is the 256 byte values, fixed, so every peer builds the same
model whatever text it has. The model follows nanoGPT's layout: pre-LayerNorm
blocks, learned positional embedding, and an output layer tied to the input
embedding (about 0.12M parameters: 2 layers of width 64, so a step of 32×32 bytes
takes ~24 ms on one core and benchmarks stay affordable).
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from murmur.node.learn.tasks.task import Batch, Metric

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
TRAIN_CAP_BYTES = 4 * 2**20
EVAL_CAP_BYTES = 256 * 2**10
INIT_SEED = 0
EVAL_WINDOWS = 4 * 64


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level causal LM: maps int64 tokens [B, T] to logits [B, T, vocab_size]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init_weights)
        # GPT-2's scaling: keep the residual stream's variance from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        # Tied output layer, applied directly so the state_dict holds the matrix once.
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def _stdlib_sources(root: Path) -> list[str]:
    """Return the sorted relative POSIX paths of `.py` files under `root`, minus EXCLUDED_DIRS."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(found)


@lru_cache(maxsize=1)
def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Return (train, held_out) uint8 byte streams from the standard library's source.

    A file is held out when crc32 of its relative path is 0 mod 10, so the split is
    the same on every machine. Files are concatenated in path order and each stream
    is cut at its cap; reading stops once both are full. Cached per process.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    caps = {"train": TRAIN_CAP_BYTES, "held_out": EVAL_CAP_BYTES}
    parts: dict[str, list[bytes]] = {"train": [], "held_out": []}
    sizes = dict.fromkeys(caps, 0)
    for rel in _stdlib_sources(root):
        if all(sizes[k] >= caps[k] for k in caps):
            break
        split = "held_out" if zlib.crc32(rel.encode()) % 10 == 0 else "train"
        if sizes[split] < caps[split]:
            data = (root / rel).read_bytes()
            parts[split].append(data)
            sizes[split] += len(data)
    train, held_out = (b"".join(parts[k])[: caps[k]] for k in ("train", "held_out"))
    if min(len(train), len(held_out)) <= GPTConfig.block_size:
        raise RuntimeError(f"too little Python source under {root} for the charlm task")
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8), torch.frombuffer(bytearray(held_out), dtype=torch.uint8))


def _windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> Batch:
    """Return (x, y) int64 [len(starts), length] with y the next byte after each x byte."""
    chunk = data[starts[:, None] + torch.arange(length + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


class CharLMTask:
    """The `charlm` task: next-byte prediction with a context of 32 bytes."""

    name = "charlm"
    metric = Metric("loss", False)
    batch_size = 32
    # The rate at which Murmur's peers reached the target first in `murmur bench --sweep-lr`
    # (docs/bench/sweep-lr); each baseline trains at its own best rate (lab/bench_config.py).
    learning_rate = 3e-3
    config = GPTConfig()  # a bigger model on the same bytes is a subclass with another config
    eval_windows = EVAL_WINDOWS

    def __init__(self) -> None:
        self.cfg = self.config
        self._train, held_out = _corpus()
        # Fixed, evenly spaced held-out windows: every peer scores the same data.
        last = len(held_out) - self.cfg.block_size - 1
        starts = torch.linspace(0, last, self.eval_windows).long()
        self._eval = _windows(held_out, starts, self.cfg.block_size)

    def build_model(self) -> nn.Module:
        """Return the GPT, initialised identically on every call and process.

        The global torch RNG is forked so seeding here does not disturb the caller.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            return GPT(self.cfg)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Return AdamW with lr `learning_rate`, betas (0.9, 0.99) and no weight decay."""
        return torch.optim.AdamW(model.parameters(), lr=self.learning_rate, betas=(0.9, 0.99), weight_decay=0.0)

    def train_batches(self, shard: int) -> Iterator[Batch]:
        """Yield (x, y) int64 [batch_size, 32] batches forever, y being x shifted by one byte.

        Window offsets are uniform over the training stream, drawn from a generator
        seeded by `shard`, so peers see different windows.
        """
        gen = torch.Generator().manual_seed(shard)
        high = len(self._train) - self.cfg.block_size
        while True:
            starts = torch.randint(high, (self.batch_size,), generator=gen)
            yield _windows(self._train, starts, self.cfg.block_size)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Return the mean next-byte cross-entropy (nats) of `model` on `batch`."""
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Return {"loss", "bits_per_byte"} on 512 fixed held-out windows.

        Runs in eval mode without gradients and restores the model's previous mode.
        """
        was_training = model.training
        device = next(model.parameters()).device
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for x, y in zip(self._eval[0].split(self.batch_size), self._eval[1].split(self.batch_size)):
                    total += self.loss(model, (x.to(device), y.to(device))).item() * len(x)
        finally:
            model.train(was_training)
        loss = total / self.eval_windows
        return {"loss": loss, "bits_per_byte": loss / math.log(2)}
