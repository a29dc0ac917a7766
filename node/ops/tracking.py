"""Experiment tracking: a node's scalars written to TensorBoard or Weights & Biases as it runs.

`ScalarWriter` is the interface, one short class per backend (`TensorBoardWriter`,
`WandbWriter`). `Tracking` fans the node's status out to every writer it was given: the node
calls `record` at each status tick (the same `NodeStatus` that status.json and the Prometheus
metrics get), and `close` when it stops. `scalars_of` names the scalars; their tags are an
interface (dashboards and scripts select them by name). The x-axis (step) of every scalar is
the node's own work: the samples (or tokens) its own steps counted, `NodeStatus.samples`.

Neither backend is a dependency of Murmur: `require_trackers` imports what the configured ones
need and raises `TrackingUnavailable`, naming the pip command, before a node starts.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from murmur.node.averaging.outcome import Result

if TYPE_CHECKING:
    from murmur.node.ops.config import NodeConfig
    from murmur.node.ops.node_status import NodeStatus

log = logging.getLogger("murmur.tracking")

# The scalars of every record besides the held-out metrics (`murmur/eval/<metric>`), by tag.
TAGS = {
    "murmur/loss": "training loss of the latest step",
    "murmur/samples_per_s": "own samples (or tokens) per second since training started",
    "murmur/merges": "exchanges that merged a partner's model, in total",
    "murmur/bytes_sent": "bytes sent on every Murmur stream, in total",
    "murmur/bytes_received": "bytes received on every Murmur stream, in total",
    "murmur/peers": "live peers in this node's membership table",
}
EVAL_PREFIX = "murmur/eval/"  # + each metric of the latest held-out evaluation (`murmur run`'s tasks)
TENSORBOARD_MODULE = "torch.utils.tensorboard"  # raises ImportError when the tensorboard package is missing
# SummaryWriter's default is 120 s: a live TensorBoard would lag a node by two minutes. A flush is one small file write.
TENSORBOARD_FLUSH_S = 10


class TrackingUnavailable(RuntimeError):
    """A configured tracker cannot start, in one line naming its option: its package is not installed (the message
    names the pip command that adds it), or its backend refused (a folder it cannot write, a W&B setting W&B rejects)."""


def _refused(option: str, what: str, exc: BaseException) -> TrackingUnavailable:
    return TrackingUnavailable(f"{option}: {what}: {type(exc).__name__}: {' '.join(str(exc).split())}")


def _import(module: str, option: str, extra: str) -> ModuleType:
    """`module`, imported; raises `TrackingUnavailable` naming `option` and `pip install 'murmur-gossip[extra]'` if it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackingUnavailable(
            f"{option} needs the {extra} package, which is not installed ({exc}): pip install 'murmur-gossip[{extra}]'"
        ) from None


class ScalarWriter(ABC):
    """Where a node's scalars go. `write` is called on the node's event loop: it must only queue, not wait on a network."""

    @abstractmethod
    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record `scalars` (tag -> value) at `step`; steps only grow from one call to the next."""

    @abstractmethod
    def close(self) -> None:
        """Flush what was written and release the writer; it takes no more writes. May block briefly (it runs on a thread)."""


class TensorBoardWriter(ScalarWriter):
    """Event files in `log_dir` (created if missing), written by `torch.utils.tensorboard.SummaryWriter`.

    Raises `TrackingUnavailable` if the tensorboard package is not installed or `log_dir` cannot be made.
    """

    def __init__(self, log_dir: Path) -> None:
        summary = _import(TENSORBOARD_MODULE, "--tensorboard", "tensorboard")
        try:
            self._writer = summary.SummaryWriter(log_dir=str(log_dir), flush_secs=TENSORBOARD_FLUSH_S)
        except OSError as exc:
            raise _refused("--tensorboard", f"cannot write to {log_dir}", exc) from None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()  # flushes


class WandbWriter(ScalarWriter):
    """A Weights & Biases run in `project`, one per node, grouped by the swarm's `run_id`.

    W&B's own environment variables apply: `WANDB_ENTITY`, `WANDB_MODE` (offline: files in
    `WANDB_DIR`, nothing sent), `WANDB_DIR`; `WANDB_NAME` and `WANDB_RUN_GROUP` override the run's
    name (default: "murmur-" and the peer ID's last 8 characters) and group. The run is created
    beside any run the user's own code has open (`reinit="create_new"`), never replacing it.
    Raises `TrackingUnavailable` if the wandb package is not installed or W&B cannot start the run
    (a setting it rejects; online, no credentials).
    """

    def __init__(self, project: str, *, peer_id: str, run_id: str, task: str) -> None:
        wandb = _import("wandb", "--wandb", "wandb")
        try:
            self._run = wandb.init(
                project=project,
                name=os.environ.get("WANDB_NAME") or f"murmur-{peer_id[-8:]}",
                group=os.environ.get("WANDB_RUN_GROUP") or run_id,
                config={"peer_id": peer_id, "run_id": run_id, "task": task},
                reinit="create_new",
            )
        # W&B raises its own assorted types (UsageError, CommError, pydantic's ValidationError).
        except Exception as exc:
            raise _refused("--wandb", "W&B could not start a run", exc) from None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


def require_trackers(config: NodeConfig) -> None:
    """Import what `config`'s trackers need; raises `TrackingUnavailable` (with the pip command) for a missing one."""
    if config.tensorboard is not None:
        _import(TENSORBOARD_MODULE, "--tensorboard", "tensorboard")
    if config.wandb is not None:
        _import("wandb", "--wandb", "wandb")


def open_writers(config: NodeConfig, *, peer_id: str, task: str) -> list[ScalarWriter]:
    """The writers `config` asks for (none without `tensorboard` or `wandb`); raises `TrackingUnavailable`.

    Creating a W&B run takes a second or two (it starts W&B's service process): call this on a thread.
    """
    writers: list[ScalarWriter] = []
    try:
        if config.tensorboard is not None:
            writers.append(TensorBoardWriter(config.tensorboard))
        if config.wandb is not None:
            writers.append(WandbWriter(config.wandb, peer_id=peer_id, run_id=config.run_id or task, task=task))
    except BaseException:
        for writer in writers:
            writer.close()
        raise
    return writers


def scalars_of(status: NodeStatus) -> dict[str, float]:
    """The tracked scalars of `status`, by tag (`TAGS`, then `murmur/eval/<metric>`); non-finite values left out."""
    values = {
        "murmur/loss": status.loss,
        "murmur/samples_per_s": status.samples_per_s,
        "murmur/merges": status.exchanges.get(Result.MERGED, 0),
        "murmur/bytes_sent": status.bytes_out,
        "murmur/bytes_received": status.bytes_in,
        "murmur/peers": status.known_peers,
        **{EVAL_PREFIX + metric: value for metric, value in status.eval.items()},
    }
    return {tag: float(value) for tag, value in values.items() if value is not None and math.isfinite(value)}


class Tracking:
    """Every writer of one node: `record` writes a status's scalars to each, once per step the node's own work reached.

    A writer that raises is logged once and dropped: tracking never stops a node.
    """

    def __init__(self, writers: Sequence[ScalarWriter]) -> None:
        self._writers = list(writers)
        self._last_step = -1

    def record(self, status: NodeStatus) -> None:
        """Write `status`'s scalars at step `status.samples`, unless a record at that step was written already."""
        if not self._writers or status.samples <= self._last_step:
            return
        self._last_step = status.samples
        scalars = scalars_of(status)
        for writer in list(self._writers):
            try:
                writer.write(status.samples, scalars)
            except Exception as exc:  # a backend's own failure (disk full, a W&B error)
                log.warning("%s failed, writing no more to it: %s: %s", type(writer).__name__, type(exc).__name__, exc)
                self._writers.remove(writer)

    def close(self) -> None:
        """Close (flush) every writer; one that fails to close is logged, the others are closed anyway."""
        writers, self._writers = self._writers, []
        for writer in writers:
            try:
                writer.close()
            except Exception as exc:
                log.warning("closing %s failed: %s: %s", type(writer).__name__, type(exc).__name__, exc)
