"""The Murmur node: one task group that owns the host, membership, averaging and training.

Start-up order: listen (and announce addresses), greet bootstrap peers, pull the
current model from a live peer (state sync), then train and gossip until cancelled.
Training never waits on the network: it runs steps on a worker thread while the
event loop serves peers.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import torch

from murmur.node.averaging.factory import build_averager
from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.learn.checkpoint import CheckpointWriteFailed
from murmur.node.learn.deltas import Compression, compression_for
from murmur.node.learn.device import describe, resolve_device
from murmur.node.learn.loop import Evaluation, TrainingLoop, TrainStats, train
from murmur.node.learn.replica import Replica
from murmur.node.learn.rules import MergeRule, make_rule
from murmur.node.learn.scoring import HELD_SHARD, MergeScorer, held_batches
from murmur.node.learn.step import Pacing
from murmur.node.learn.tasks import load_task
from murmur.node.net.membership import PEERS_PROTOCOL, Membership
from murmur.node.net.partners import PARTNER_CHOICES
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import Transport
from murmur.node.ops.checkpoints import Checkpoints
from murmur.node.ops.config import NodeConfig
from murmur.node.ops.dashboard import (
    DashboardState,
    SwarmHistory,
    nonlocal_bind_warning,
    recent_partners,
    serve_dashboard,
    swarm_view,
)
from murmur.node.ops.data_dir import DataDirLock, append_line, write_atomic
from murmur.node.ops.logs import exit_summary, progress_line
from murmur.node.ops.metrics import CountingTransport, NodeMetrics, Traffic
from murmur.node.ops.node_status import NetworkStatus, NodeStatus, current_trio_task_names, current_trio_tasks
from murmur.node.ops.status import STATUS_FILE
from murmur.node.ops.tracking import Tracking, open_writers
from murmur.protocol.messages import PeerSummary

log = logging.getLogger("murmur.node")
STATUS_INTERVAL = 1.0  # seconds between status.json writes (and metrics updates)
METRICS_FILE = "metrics.jsonl"
BANS_FILE = "bans.json"
# A resumed node adopts a peer's model (state sync) only if it carries at least this many times its own work.
CATCH_UP_RATIO = 1.0


def _shard_of(peer_id: str) -> int:
    return int.from_bytes(peer_id.encode()[-6:], "big") % (2**31)


class Node:
    def __init__(
        self, config: NodeConfig, transport: Transport, bans: BanList | None = None,
        listen_addresses: Callable[[], list[str]] | None = None,
        network_info: Callable[[], dict] | None = None,
        user_loop: Callable[[MergeRule, Compression | None], Replica] | None = None, pacing: Pacing = Pacing(),
    ) -> None:
        """`listen_addresses` gives the real listen addresses when they differ from `transport.addresses()`;
        `network_info` the transport's reachability and connections for status, as `NetworkStatus` fields (`Libp2pTransport.network_info`).

        `user_loop` (from `murmur.Peer`) builds the replica of a model that the user's own loop steps,
        given the merge rule and compression: the node then runs no training loop (`loop` is None), and a checkpoint
        of another model raises `ModelMismatch` instead of being skipped (and later overwritten).
        Otherwise the node trains `config.task` in its own `TrainingLoop`, at `pacing`'s pace.

        Three attributes let whatever runs the node add to it (the lab does), set before `run`:
        `pacing`, the emulated device's pace (`pacing` above); `start_gate`, awaited once the node
        has joined and synced, before training starts (status phase "waiting" meanwhile); and
        `on_evaluation`, called with each evaluation of the built-in loop once it is written to
        metrics.jsonl (on the event loop: keep it short).
        """
        self.config = config
        self._listen_addresses = listen_addresses or transport.addresses
        self._network_info = network_info or dict  # no NAT traversal: `NetworkStatus`'s defaults
        self.traffic = Traffic()
        transport = CountingTransport(transport, self.traffic)  # counts every protocol's bytes, for metrics
        self.transport = transport
        self.peer_id = transport.peer_id
        if config.threads is not None:  # the operator's choice; benchmarks sharing a machine pass 1
            torch.set_num_threads(config.threads)
        shard = config.shard if config.shard is not None else _shard_of(self.peer_id)
        rule = make_rule(config.weighting, config.merge, optimizer_state=config.optimizer_state)
        compression = compression_for(config.compression, config.compression_density, config.compression_bits)
        self.loop: TrainingLoop | None = None
        if user_loop is None:
            self.loop = TrainingLoop(load_task(config.task), shard, resolve_device(config.device), config.mixed_precision, rule=rule,
                                     ema_decay=config.ema_decay, compression=compression)
            self.replica = self.loop.replica
        else:
            self.replica = user_loop(rule, compression)
        self.pacing = pacing
        self.start_gate: Callable[[], Awaitable[None]] | None = None
        self.on_evaluation: Callable[[Evaluation], None] = lambda evaluation: None
        log.info("training on %s (%d threads)%s", describe(self.replica.device), torch.get_num_threads(), " with bf16 autocast" if config.mixed_precision else "")
        self.rng = random.Random(shard)
        self.table = PeerTable(self.peer_id, config.liveness_timeout, partners=PARTNER_CHOICES[config.partners](), view_size=config.view_size)
        self.bans = bans or BanList()
        self.averager = build_averager(
            transport, self.replica, run_id=config.run_id, table=self.table, bans=self.bans, rng=self.rng,
            exchange_timeout=config.exchange_timeout, min_link_mbit=config.min_link_mbit, wire_dtype=config.wire_dtype,
            scorer=self._scorer(config, shard),
        )
        self.identity = self.averager.identity
        self.membership = Membership(
            transport, self.table, self.identity, rng=self.rng, bans=self.bans, summary=self.summary
        )
        self.stats = TrainStats()
        self._serve_scope = anyio.CancelScope()
        self.phase = "joining"  # then "waiting" (ready, not yet told to start) and "training"
        self.on_phase: Callable[[str], None] = lambda phase: None  # called on the event loop at each change
        self.sync_outcome: Outcome | None = None  # state sync's, once tried
        self.duration_ended = False  # whether `run` ended because `config.duration` passed
        # False: `run` writes no final checkpoint (`murmur.Peer` after the swarm refused its model,
        # so that model's checkpoint cannot block the next run with the right one).
        self.checkpoint_on_exit = True
        # Where the lines a user reads at start-up go (addresses, dashboard URL): stdout for
        # `murmur run`; `murmur.Peer`, a library, logs them instead.
        self.say: Callable[[str], None] = _print_now
        self.last_eval: dict[str, float] = {}
        self.metrics = NodeMetrics(self.peer_id, self.replica.name)
        self.metrics_url: str | None = None
        self.dashboard_url: str | None = None
        self.dashboard = DashboardState(self.metrics.registry)
        self.tracking = Tracking([])  # `run` opens the configured writers (`--tensorboard`, `--wandb`)
        self.history = SwarmHistory()
        self._failing_writes: set[str] = set()  # data dir files whose last write failed (`_write_or_warn`)
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = Checkpoints(config.data_dir, self.replica, config.checkpoint_every, users_model=self.loop is None)
        self.resumed_from = self.checkpoints.restore()
        self._metrics_path = config.data_dir / METRICS_FILE
        self._metrics_path.unlink(missing_ok=True)
        self.data_dir_lock: DataDirLock | None = None  # released when `run` returns (`build_node` sets it)

    @property
    def stopping(self) -> bool:
        return self._serve_scope.cancel_called

    @property
    def merged_with_anyone(self) -> bool:
        """Whether this node ever took in a peer's model: an exchange merged, or state sync adopted one."""
        synced = self.sync_outcome is not None and self.sync_outcome.result == Result.SYNCED
        return synced or self.averager.outcomes[Result.MERGED] > 0

    def never_joined(self) -> str | None:
        """Why a node given bootstrap peers never merged with anyone, in one line; None if it did or had none to join.

        A node without bootstrap peers is a swarm's first: alone by design, never a failure.
        """
        if not self.config.bootstrap or self.merged_with_anyone:
            return None
        alone = self.membership.alone_reason(self.config.bootstrap)
        return alone or f"knew {len(self.table.members)} peers, but no exchange merged"

    def request_stop(self) -> None:
        """Stop gracefully: end the exchange in flight, checkpoint, say goodbye, return from `run`."""
        self._serve_scope.cancel()

    def _scorer(self, config: NodeConfig, shard: int) -> MergeScorer | None:
        """The scorer of partners' models `--score-windows` asks for: held windows of this peer's task, on a stream it does not train on."""
        if not config.score_windows:
            return None
        if self.loop is None:
            log.warning("--score-windows is ignored: scoring needs the built-in training loop's task, not your own loop")
            return None
        task = self.loop.task
        held = held_batches(task.train_batches(HELD_SHARD + shard), config.score_windows)
        return MergeScorer(self.replica.model, task.loss, held, tolerance=config.score_tolerance)

    async def run(self, *, task_status: anyio.abc.TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until `request_stop`, cancellation or `duration`; `task_status.started` gets the addresses.

        On a requested stop or the end of `duration` the host stays up while the node
        hands its unmerged work to a partner (one exchange, bounded by the exchange timeout),
        tells its neighbours it is leaving and checkpoints; after a plain cancellation
        the goodbye is best effort (the host is going away too), bounded by 3 s.
        Raises `CheckpointWriteFailed` once stopped if that last checkpoint could not be written.
        """
        cfg = self.config
        self.transport.set_handler(PEERS_PROTOCOL, self.membership.serve)
        async with self._holding_data_dir(), self._tracking(), self._metrics_endpoint(), self.transport.run(cfg.listen):
            addrs = self.transport.addresses()  # what peers are told (announced/relayed addresses if any)
            listening = self._listen_addresses()
            announced = [a for a in addrs if a not in listening]
            for addr in listening:
                self.say(f"murmur: listening on {addr}")
            for addr in announced:
                self.say(f"murmur: announcing {addr}")
            if cfg.addr_file:
                write_atomic(cfg.addr_file, "".join(a + "\n" for a in listening + announced))
            task_status.started(addrs)
            exit_checkpoint_failed: CheckpointWriteFailed | None = None
            try:
                with self._serve_scope:
                    async with anyio.create_task_group() as tg:
                        # From the start: a node joining or syncing is alive too (`murmur status --health`).
                        tg.start_soon(self._report_status)
                        tg.start_soon(self._log_progress)
                        await self._serve(cfg)
                        tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.averager.timeout_s):
                    await self._parting_merge()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(3):
                    await self.membership.announce_leaving()
                if self.checkpoint_on_exit:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self.checkpoints.save()
                        except CheckpointWriteFailed as exc:
                            exit_checkpoint_failed = exc
                final = self.write_status()
                self.tracking.record(final)  # the last point, flushed as `_tracking` closes the writers
                log.info("%s", exit_summary(final))
            # Raised after the goodbye and the summary: only the last checkpoint is lost.
            if exit_checkpoint_failed is not None:
                raise exit_checkpoint_failed

    async def _parting_merge(self) -> None:
        """One last exchange, if this peer trained since its last merge: a peer that leaves takes none of its work with it."""
        if self.replica.fresh > 0:
            outcome = await self.averager.average_once()
            log.info("parting merge with %s: %s (%s)", outcome.partner or "no one", outcome.result, outcome.reason)

    async def _serve(self, cfg: NodeConfig) -> None:
        if cfg.bootstrap:
            joined = await self.membership.join(cfg.bootstrap)
            if joined:
                log.info("joined through %d of %d bootstrap peers", joined, len(cfg.bootstrap))
            else:
                log.warning("alone: no bootstrap peer answered; retrying with backoff")
            if cfg.sync_state:
                ratio = CATCH_UP_RATIO if self.resumed_from else 0.0
                outcome = self.sync_outcome = await self.averager.state_sync.sync_from_swarm(behind_ratio=ratio)
                if outcome.result != Result.SYNCED:
                    log.info("no state sync (%s): training from the %s model", outcome.reason, "resumed" if self.resumed_from else "initial")
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.membership.run, cfg.bootstrap, cfg.gossip_every)
            tg.start_soon(functools.partial(self.averager.run, cfg.average_every, max_share=cfg.exchange_share,
                                            share_of=cfg.exchange_share_of))
            tg.start_soon(self.checkpoints.save_periodically)
            if self.start_gate is not None:
                self._set_phase("waiting")
                await self.start_gate()
            self._set_phase("training")
            with anyio.move_on_after(cfg.duration if cfg.duration is not None else float("inf")) as deadline:
                if self.loop is None:  # the user's thread steps the model and counts the work
                    self.stats.started = time.monotonic()
                    await anyio.sleep_forever()
                else:
                    await train(self.loop, self.pacing, self.stats, eval_every=cfg.eval_every, on_eval=self._on_eval)
            self.duration_ended = deadline.cancelled_caught
            tg.cancel_scope.cancel()

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.on_phase(phase)
        self.write_status()  # at once: a benchmark waits for every peer to be "waiting"

    def _on_eval(self, evaluation: Evaluation) -> None:
        self.last_eval = evaluation.metrics
        # Stamped when the model was copied: an evaluation on a busy machine may finish much later.
        record = {"t": evaluation.t, "samples": evaluation.samples, "work": evaluation.work, **evaluation.metrics,
                  "exchanges": self.averager.outcomes[Result.MERGED]}
        self._write_or_warn(METRICS_FILE, functools.partial(append_line, self._metrics_path, json.dumps(record)))
        self.on_evaluation(evaluation)

    async def _log_progress(self) -> None:
        """Log `progress_line` every `progress_every` seconds of training (never if 0)."""
        if not self.config.progress_every:
            return
        before = None
        while True:
            await anyio.sleep(self.config.progress_every)
            if self.phase == "training":
                now = self.status()
                log.info("%s", progress_line(now, before))
                before = now

    async def _report_status(self) -> None:
        while True:
            status = self.write_status()
            self.metrics.update(status, list(self.averager.recent), self.traffic)
            self.tracking.record(status)
            if self.dashboard_url is not None:
                swarm = swarm_view(
                    status, self.membership.summaries(), self.history, self.membership.clock(),
                    list(self.averager.recent),
                    {"in": self.traffic.received, "out": self.traffic.sent}, self.table.members,
                )  # fmt: skip
                self.dashboard.publish(status, swarm)
            await anyio.sleep(STATUS_INTERVAL)

    @asynccontextmanager
    async def _holding_data_dir(self) -> AsyncIterator[None]:
        """Release the data dir's lock, if this node holds one, once everything else has stopped."""
        try:
            yield
        finally:
            if self.data_dir_lock is not None:
                self.data_dir_lock.release()

    @asynccontextmanager
    async def _tracking(self) -> AsyncIterator[None]:
        """Write to the configured trackers for the context, and close (flush) them when it exits, cancelled or not.

        Raises `TrackingUnavailable` when one cannot start. They open on a thread: a W&B run takes seconds to create.
        """
        opened = functools.partial(open_writers, self.config, peer_id=self.peer_id, task=self.replica.name)
        self.tracking = Tracking(await anyio.to_thread.run_sync(opened))
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.tracking.close)

    @asynccontextmanager
    async def _metrics_endpoint(self) -> AsyncIterator[None]:
        """Serve this node's dashboard and Prometheus metrics for the context, if `metrics_port` is set."""
        if self.config.metrics_port is None:
            yield
            return
        warning = nonlocal_bind_warning(self.config.metrics_host)
        if warning:
            self.say(warning)
        async with serve_dashboard(self.dashboard, self.config.metrics_host, self.config.metrics_port) as url:
            self.metrics_url = url + "metrics"
            self.dashboard_url = url
            self.say(f"murmur: metrics at {self.metrics_url}")
            self.say(f"murmur: dashboard at {url}")
            yield

    def status(self) -> NodeStatus:
        """This node's state now: what `write_status` writes to status.json."""
        now = time.monotonic()
        elapsed = self.stats.elapsed(now)
        merged = [o for o in self.averager.recent if o.result == Result.MERGED]
        return NodeStatus(
            peer_id=self.peer_id, addrs=tuple(self.transport.addresses()), task=self.replica.name,
            device=str(self.replica.device), t=time.time(), phase=self.phase, uptime_s=elapsed,
            samples=self.replica.samples, samples_per_s=self.replica.samples / elapsed if elapsed else 0.0,
            work=self.replica.work,
            loss=self.replica.last_loss, eval=dict(self.last_eval),
            exchanges=dict(self.averager.outcomes), recent_exchanges=tuple(list(self.averager.recent)[-8:]),
            mean_exchange_s=sum(o.duration_s for o in merged) / len(merged) if merged else None,
            bytes_sent=self.averager.bytes_sent,
            bytes_per_merge=sum(o.bytes_sent for o in merged) / len(merged) if merged else None,
            model_bytes=self.replica.spec.wire_size("float32"), known_peers=len(self.table.members), peers=tuple(sorted(self.table.members)),
            compute_fraction=self.stats.compute_fraction(now), eval_fraction=self.stats.eval_s / elapsed if elapsed else 0.0,
            pid=os.getpid(), status_interval=STATUS_INTERVAL,
            bytes_in=sum(self.traffic.received.values()), bytes_out=sum(self.traffic.sent.values()),
            partner_distance=self.averager.last_partner_distance, metrics_url=self.metrics_url,
            dashboard_url=self.dashboard_url, network=NetworkStatus(**self._network_info()),
            joined=bool(self.table.members), alone_reason=self.membership.alone_reason(self.config.bootstrap),
            bootstrap=dict(self.membership.join_results), trio_tasks=current_trio_tasks(),
            trio_task_names=current_trio_task_names(),
        )  # fmt: skip

    def summary(self) -> PeerSummary:
        """What this node tells its peers about itself in each hello (shown on their dashboards)."""
        now = time.monotonic()
        elapsed = self.stats.elapsed(now)
        metric, value = next(iter(self.last_eval.items()), ("", None))
        loss = self.replica.last_loss
        return PeerSummary(
            task=self.replica.name[:64], samples_per_s=self.replica.samples / elapsed if elapsed else 0.0,
            metric=metric[:32], metric_value=_finite_or_none(value), loss=_finite_or_none(loss),
            work=min(float(self.replica.work), 1e15), phase=self.phase[:16],
            idle=min(1.0, max(0.0, 1.0 - self.stats.compute_fraction(now))), partners=recent_partners(self.averager.recent),
        )  # fmt: skip

    def write_status(self) -> NodeStatus:
        """Write `status()` to the data dir's status.json (atomically) and return it.

        A write that fails (a full disk) is logged, once until one succeeds again, and skipped: the node runs on.
        """
        status = self.status()
        self._write_or_warn(STATUS_FILE, functools.partial(write_atomic, self.config.data_dir / STATUS_FILE, status.to_json()))
        return status

    def _write_or_warn(self, name: str, write: Callable[[], None]) -> None:
        """Run `write` (of the data dir's file `name`); an OSError is logged once until `write` succeeds again."""
        try:
            write()
        except OSError as exc:
            if name not in self._failing_writes:
                log.warning("cannot write %s: %s; the node runs on without it", name, exc.strerror or exc)
                self._failing_writes.add(name)
        else:
            if name in self._failing_writes:
                log.info("%s is written again", name)
                self._failing_writes.discard(name)


def _print_now(line: str) -> None:
    print(line, flush=True)


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and abs(value) <= 1e12 else None
