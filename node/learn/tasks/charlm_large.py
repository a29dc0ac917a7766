"""`charlm-large`: charlm's byte-level nanoGPT at a real size (about 2.15M parameters).

Same corpus, vocabulary (the 256 byte values), split, optimizer and model classes as
`charlm` (`murmur.node.learn.tasks.charlm`); only the shape differs: 4 pre-LayerNorm blocks of
width 208 with 4 heads and a context of 64 bytes. Its float32 parameters are ~8.6 MB, so a
whole-model exchange takes ~3.4 s over a 20 Mbit/s link: the task the slow-link benchmark
(`murmur bench --link-mbit`) trains. A step of 32×64 bytes computes for ~0.3-0.45 s on one
core (measured on the 2-core lab machine), which is why the benchmark pads it to
`TASKS["charlm-large"]["step_time"]` and evaluates it every few seconds on 128 windows.
"""

from __future__ import annotations

from murmur.node.learn.tasks.charlm import CharLMTask, GPTConfig

LARGE_CONFIG = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=208)


class CharLMLargeTask(CharLMTask):
    """The `charlm-large` task: next-byte prediction with a context of 64 bytes, ~2.15M parameters."""

    name = "charlm-large"
    config = LARGE_CONFIG
    # 128 windows of 64 bytes (8192 predictions): an evaluation costs a few steps, not a minute.
    eval_windows = 128
    # charlm's too: the best of the rates compared over slow links (docs/bench/slow-links-20mbit-lr).
    learning_rate = 3e-3
