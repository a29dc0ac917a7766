"""A node's checkpoints in its data dir: resumed from at start, written every so often and on exit.

The file format, atomic writes and fallback to an older file are `murmur.node.learn.checkpoint`'s;
this is when a node writes and what it does when a write fails (a full disk): it keeps training.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio

from murmur.node.learn.checkpoint import (
    CheckpointWriteFailed,
    load_latest,
    newest_first,
    remove_unfinished,
    save_checkpoint,
)
from murmur.node.learn.replica import Replica
from murmur.node.learn.user_loop import ModelMismatch

CHECKPOINT_DIR = "checkpoints"
log = logging.getLogger("murmur.node")


class Checkpoints:
    """The checkpoints of `replica` under `data_dir`/checkpoints.

    `users_model`: the model is the user's own (`murmur.Peer`), so a checkpoint of another model
    is refused rather than skipped (and later overwritten).
    """

    def __init__(self, data_dir: Path, replica: Replica, every_s: float, users_model: bool) -> None:
        self.directory = data_dir / CHECKPOINT_DIR
        self.replica = replica
        self.every_s = every_s
        self.users_model = users_model

    def restore(self) -> Path | None:
        """Resume the replica from the newest readable checkpoint; returns its path, or None if there was none to use.

        Raises `ModelMismatch` for another model's checkpoint when the model is the user's; otherwise that
        checkpoint is logged and not used.
        """
        for name in remove_unfinished(self.directory):  # the node is the data dir's one writer, and it has not started
            log.info("removed %s: an unfinished checkpoint write (the node was stopped mid-write)", name)
        found = load_latest(self.directory)
        if found is None:
            return None
        state, path = found
        try:
            self.replica.restore(state)
        except (ValueError, KeyError, RuntimeError) as exc:
            if self.users_model:  # keep their checkpoint rather than overwrite it
                raise ModelMismatch(f"the checkpoint {path} is not this model's: {exc}; "
                                    "move it aside or use another data_dir") from exc  # fmt: skip
            log.warning("not resuming from %s: %s", path, exc)
            return None
        log.info("resumed from %s (work %.0f, %d samples)", path.name, self.replica.work, self.replica.samples)
        return path

    async def save(self) -> Path:
        """Checkpoint the model now; raises `CheckpointWriteFailed` (the earlier checkpoints kept) if it cannot be written."""
        state = await anyio.to_thread.run_sync(self.replica.checkpoint_state)
        return await anyio.to_thread.run_sync(save_checkpoint, self.directory, state)

    async def save_periodically(self) -> None:
        """Checkpoint every `every_s` seconds until cancelled; a failed write (a full disk) is logged and training goes on."""
        failing: str | None = None
        while True:
            await anyio.sleep(self.every_s)
            try:
                await self.save()
            except CheckpointWriteFailed as exc:
                # Once per kind of failure, not every period: the line says it all until the disk is freed.
                if str(exc) != failing:
                    kept = newest_first(self.directory)
                    log.warning("checkpoint failed: %s; training goes on, %s", exc,
                                f"{kept[0].name} is kept" if kept else "with no checkpoint yet")  # fmt: skip
                failing = str(exc)
            else:
                if failing is not None:
                    log.info("checkpoints are written again")
                failing = None
