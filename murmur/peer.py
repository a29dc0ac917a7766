"""`murmur.Peer`: join a swarm from your own training loop.

The peer runs an ordinary Murmur node (the one `murmur run` runs: Noise, validation,
screening, bans, checkpoints, state sync, status file, metrics) on a background thread
with its own Trio event loop. Your thread keeps the model: the node's snapshots, merges
and checkpoints wait for your next `peer.step()`, which runs them between two of your
steps (`murmur.node.learn.user_loop`). `peer.step()` itself never waits on the network.

    with murmur.Peer(model, optimizer, run_id="my-run", bootstrap=[addr]) as peer:
        for batch in loader:
            loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
            peer.step(samples=len(batch["input_ids"]))
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import logging
import threading
from pathlib import Path
from typing import Any, get_type_hints

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch
from torch import nn

from murmur.node.averaging.outcome import Result
from murmur.node.averaging.state_sync import StateSyncRefused
from murmur.node.learn.device import DeviceError, check_mixed_precision, resolve_device
from murmur.node.learn.replica import Replica, model_device
from murmur.node.learn.tasks import BUILTIN_TASKS, DigitsTask, load_task
from murmur.node.learn.user_loop import ModelMismatch, StepGate, check_optimizer
from murmur.node.net.identity import load_or_create_identity
from murmur.node.ops.assembly import build_node
from murmur.node.ops.config import NodeConfig
from murmur.node.ops.logs import route_library_logs
from murmur.node.ops.node import Node
from murmur.node.ops.node_status import NodeStatus
from murmur.node.ops.status import STATUS_FILE
from murmur.node.ops.tracking import require_trackers
from murmur.protocol.codec import TensorSpec

log = logging.getLogger("murmur.peer")

# `murmur run` options of Murmur's own training loop (its evaluation and its end); an API peer's loop is the user's.
LOOP_ONLY = ("eval_every", "ema_decay", "duration")
_FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}
_HINTS = get_type_hints(NodeConfig)
STOP_TIMEOUT_S = 30.0  # the node's own goodbye (3 s) and checkpoint fit well within this


JOIN_POLL_S = 0.05  # how often `wait_joined` looks at the peer table (on the node's event loop)


class NotJoined(TimeoutError):
    """`Peer.wait_joined` timed out: no peer of the run answered; the message gives each bootstrap's reason."""


class PeerClosed(RuntimeError):
    """This `murmur.Peer` was closed (or its node stopped on an error, given as the cause): it takes no more steps."""


def _default(name: str) -> Any:
    f = _FIELDS[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _flag_aliases() -> dict[str, tuple[str, bool]]:
    """`murmur run`'s flag names that are not field names, as keywords: name -> (field, negated).

    `--relay` sets `relays`; `--no-state-sync` sets `sync_state` to false (negated).
    """
    aliases = {}
    for name, f in _FIELDS.items():
        how = f.metadata.get("option")
        if how is not None and how.flag:
            alias = how.flag.replace("-", "_")
            aliases[alias] = (name, alias.startswith("no_") and _HINTS[name] is bool)
    return aliases


FLAG_NAMES = _flag_aliases()
# Settings of `murmur run`'s own loop or of its hardware emulation: refused, with why.
REFUSED = (*LOOP_ONLY, "slowdown", "step_time")


def _field_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` by `NodeConfig` field name: flag-named keywords (`relay`, `no_state_sync`, …) translated."""
    out = {}
    for name, value in options.items():
        if name not in FLAG_NAMES:
            out[name] = value
            continue
        field, negated = FLAG_NAMES[name]
        if field in options:
            raise TypeError(f"murmur.Peer got both {name!r} and {field!r}: pass one")
        if negated and not isinstance(value, bool):
            raise TypeError(f"{name} takes True or False, got {value!r}")
        out[field] = not value if negated else value
    return out


def run_config(options: dict[str, Any]) -> NodeConfig:
    """The `NodeConfig` for `Peer`'s keyword arguments: `murmur run`'s options, same defaults.

    Options are named like `murmur run`'s flags (`relay`, `no_state_sync`, `no_nat_traversal`,
    `wire_dtype`, …); the `NodeConfig` field names (`relays`, `sync_state`, `nat_traversal`) work too.
    Raises `TypeError` for an unknown name (suggesting the closest), `ValueError` for a bad
    value or for an option of `murmur run`'s own loop (its pace, its evaluation).
    """
    for name in options:
        if name in REFUSED:
            raise ValueError(f"{name} is for `murmur run`'s own training loop; a murmur.Peer trains and evaluates in your loop")
        if name not in _FIELDS and name not in FLAG_NAMES:
            close = difflib.get_close_matches(name, [*_FIELDS, *FLAG_NAMES], n=1)
            raise TypeError(f"murmur.Peer got an unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    values = {name: _checked(name, value) for name, value in _field_options(options).items()}
    return NodeConfig(**values)


def check_options(options: dict[str, Any]) -> None:
    """Raise now what `Peer(model, optimizer, **options)` would raise for the options alone, before any model
    exists (a trainer callback's construction): `TypeError`/`ValueError` as `run_config` does, and
    `TrackingUnavailable` for a tracker (`tensorboard`, `wandb`) whose package is missing. `task` is a label, not checked.
    """
    require_trackers(run_config({k: v for k, v in options.items() if k != "task"}))


def _checked(name: str, value: Any) -> Any:
    """`value` as `murmur run` would parse it: paths expanded, choices and addresses checked."""
    how = _FIELDS[name].metadata.get("option")
    if Path in getattr(_HINTS[name], "__args__", (_HINTS[name],)) and isinstance(value, str):
        value = Path(value).expanduser()
    if how is None or value is None:
        return value
    if getattr(_HINTS[name], "__origin__", None) is list and not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} takes a list (e.g. {name}=[...]), got {type(value).__name__}")
    items = list(value) if isinstance(value, (list, tuple)) else None
    try:
        for item in items if items is not None else [value]:
            if how.parse is not None and isinstance(item, str):
                how.parse(item)
            if how.choices is not None and item not in how.choices():
                raise ValueError(f"choose from {', '.join(map(str, how.choices()))}")
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ValueError(f"invalid {name}={value!r}: {exc}") from None
    return items if items is not None else value


def _task_name(spec: str) -> str:
    """The name a run's task goes by (it labels the model's fingerprint), without building its model.

    A built-in task's name, a `package.module:factory` task's name, or else `spec` itself: the
    label of the user's own model (shown in status and on dashboards; peers must use the same).
    """
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec].name
    if ":" in spec:
        return load_task(spec).name
    if not spec.strip() or len(spec) > 64:
        raise ValueError(f"invalid task={spec!r}: a label of 1 to 64 characters, a built-in task or package.module:factory")
    return spec


def _default_label(model: nn.Module) -> str:
    """The label of a model passed without `task`: "digits" for the built-in digits model (so it
    joins a default `murmur run` swarm), else the model's class name."""
    digits = DigitsTask().build_model()
    same = type(model) is type(digits) and TensorSpec.of(model.state_dict()) == TensorSpec.of(digits.state_dict())
    return DigitsTask.name if same else type(model).__name__


class Peer:
    """A Murmur peer whose model your own loop trains; a context manager that closes it.

    Construction starts the node, joins through `bootstrap`, resumes from a checkpoint in
    `data_dir` and pulls the swarm's model (state sync) before returning, so your first
    step starts from it. Raises `ModelMismatch` when the run's peers or the checkpoint hold
    another model, `ForeignOptimizer` when the optimizer steps other parameters,
    `DeviceError` for a device this machine lacks or that the model is not on,
    `TrackingUnavailable` when `tensorboard` or `wandb` cannot start (its package missing, its backend refusing), and
    `TypeError`/`ValueError` for unknown or invalid options.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        label = options.pop("task", None)  # None: "digits" for the built-in digits model, else the model's class name
        name = _task_name(label) if label is not None else _default_label(model)
        config = run_config(options)  # a label is checked as one (`_task_name`), not as `murmur run`'s task
        if label is not None:
            config = dataclasses.replace(config, task=label)
        device = model_device(model)
        if config.device != "auto" and resolve_device(config.device) != device:  # raises DeviceError first if absent
            raise DeviceError(f"device={config.device!r} but the model is on {device}")
        if config.mixed_precision:
            check_mixed_precision(device)
        check_optimizer(model, optimizer)
        require_trackers(config)
        route_library_logs()
        self.config = config
        self._gate = StepGate()
        self._make_replica = lambda rule, compression: Replica(name, model, optimizer, rule=rule, access=self._gate,
                                                               compression=compression)
        self._key_pair = load_or_create_identity(config.data_dir)
        self._node: Node | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._addrs: list[str] = []
        self._error: BaseException | None = None
        self._closed = False
        self._ready = threading.Event()  # set once training may start, or the node failed
        self._thread = threading.Thread(target=self._run_node, name="murmur-peer", daemon=True)
        self._thread.start()
        self._ready.wait()  # bounded by the node's own join and state-sync timeouts
        if self._error is not None:
            self._thread.join()
            raise self._error
        refusal = self._refusal()
        if refusal is not None:
            self.node.checkpoint_on_exit = False  # the refused model's checkpoint would block the next run
            self.close()
            raise ModelMismatch(f"the run's peers refused this model: {refusal}")
        self._gate.open()  # from now on the model is touched only inside `step`

    def _refusal(self) -> str | None:
        """Why the run's peers would not train with this model, if every bootstrap peer (or state sync) refused it."""
        results = self.node.membership.join_results.values()
        mismatches = [r for r in results if r.startswith("refused: task mismatch")]
        if mismatches and "ok" not in results:
            return mismatches[0].removeprefix("refused: ")
        outcome = self.node.sync_outcome
        if outcome is not None and outcome.result == Result.FAILED and outcome.reason.startswith(StateSyncRefused.__name__):
            return outcome.reason
        return None

    def _run_node(self) -> None:
        try:
            anyio.run(self._serve, backend="trio")
        except BaseException as exc:
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            self._error = exc
            log.error("murmur.Peer's node stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = anyio.lowlevel.current_token()
        node = self._node = build_node(self.config, self._key_pair, user_loop=self._make_replica)
        node.say = log.info  # a library prints nothing: `peer.addrs` has the addresses
        node.on_phase = self._on_phase
        await node.run()

    def _on_phase(self, phase: str) -> None:
        if phase == "training":  # joined and synced: the user's loop may start
            self._addrs = self.node.transport.addresses()
            self._ready.set()

    @property
    def node(self) -> Node:
        assert self._node is not None, "set before construction returns"
        return self._node

    @property
    def addrs(self) -> list[str]:
        """The addresses other peers bootstrap from, each ending in `/p2p/<peer id>`."""
        return list(self._addrs)

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def samples(self) -> int:
        """The work (samples or tokens) this peer's own steps counted, resumed ones included."""
        return self.node.replica.samples

    @property
    def work(self) -> float:
        """The swarm's progress embodied in this peer's model, in the unit `step` counts (samples or
        tokens): what a learning-rate schedule follows (`murmur.schedule`). Status.json's `work`.

        Each of this peer's steps adds its work; a merge gives both partners the mean of their
        two models' work (the sum is conserved, so in a mixed swarm it is the swarm's total work
        per peer: how far one peer of a data-parallel run would have got); a state sync adopts the
        model and the work of the peer it came from, so a newcomer continues the swarm's schedule
        instead of restarting it; a resume restores it from the checkpoint. Peers joining or
        leaving leave it as it is. It may step back a little when a merge meets a partner behind.
        """
        return self.node.replica.work

    @property
    def swarm_samples(self) -> float:
        """An estimate of the whole swarm's total work so far: `work` times the peers this peer
        knows, itself included. Merges conserve the sum of work, so it is exact for a mixed swarm
        whose peers all trained from the start and are all in this peer's view; but a newcomer's
        state sync copies work no sample earned, and the count of peers known moves with churn and
        discovery, so it jumps when peers come and go: a schedule follows `work` instead."""
        return self.node.replica.work * (1 + len(self.node.table.members))

    @property
    def model_version(self) -> int:
        """How many times the swarm changed the model (a merge, a state sync, a resume); read it
        after `step()`. Whoever mirrors the model elsewhere (other data-parallel ranks) copies it
        when this number changed."""
        return self.node.replica.version

    @property
    def joined(self) -> bool:
        """Whether this peer knows a live peer of its run now (status.json's `joined`)."""
        return bool(self.node.table.members)

    @property
    def alone_reason(self) -> str | None:
        """Why this peer knows no peer now, in one line (each bootstrap's last outcome); None once it knows one."""
        return self.node.membership.alone_reason(self.config.bootstrap)

    def wait_joined(self, timeout: float | None = None) -> None:
        """Block until this peer knows a live peer of its run (returns at once if it does).

        Bootstrap peers are retried with backoff meanwhile. Raises `NotJoined` (a `TimeoutError`)
        naming each bootstrap's reason if none answered within `timeout` seconds (None: wait
        forever), and `PeerClosed` if the peer is closed.
        """
        if self._closed or not self._thread.is_alive() or self._token is None:
            raise PeerClosed("this murmur.Peer is closed") from self._error

        async def wait() -> bool:
            with anyio.move_on_after(float("inf") if timeout is None else timeout):
                while not self.node.table.members:
                    await anyio.sleep(JOIN_POLL_S)
                return True
            return False

        try:
            joined = anyio.from_thread.run(wait, token=self._token)
        except anyio.RunFinishedError:
            raise PeerClosed("this murmur.Peer's node stopped") from self._error
        if not joined:
            raise NotJoined(f"no peer joined within {timeout:g} s: {self.alone_reason}")

    def step(self, samples: int | None = None, *, tokens: int | None = None, loss: float | None = None) -> None:
        """Count one finished step of your loop (`samples` or `tokens` of work) and apply pending merges.

        Call it between optimizer steps (after `optimizer.step()`), from the thread that trains.
        Never waits on the network: it runs only local work the node queued (a snapshot copy,
        a merge). Raises `PeerClosed` after `close` or once the node stopped on an error.
        """
        if self._closed or not self._thread.is_alive():
            raise PeerClosed("this murmur.Peer is closed: create a new one to keep training with the swarm") from self._error
        if (samples is None) == (tokens is None):
            raise ValueError("pass the step's work as exactly one of samples= or tokens=")
        work = samples if samples is not None else tokens
        if not isinstance(work, int) or isinstance(work, bool) or work < 0:
            raise ValueError(f"work must be a non-negative int, got {work!r}")
        self.node.replica.record(work, loss)
        self.node.stats.steps += 1
        self._gate.serve()

    def status(self) -> dict[str, Any]:
        """What `murmur run` writes to status.json, as a dict: as of now, or the final one once closed."""
        if not self._closed and self._thread.is_alive() and self._token is not None:
            try:
                return anyio.from_thread.run_sync(self.node.status, token=self._token).to_dict()
            except anyio.RunFinishedError:
                pass
        return NodeStatus.from_json((self.config.data_dir / STATUS_FILE).read_text()).to_dict()  # written as the node stopped

    def close(self) -> None:
        """Stop the node: apply what is queued, say goodbye, checkpoint, write the final status. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gate.park()  # your loop has ended: the node's last checkpoint runs directly
        if self._thread.is_alive() and self._token is not None:
            try:
                anyio.from_thread.run_sync(self.node.request_stop, token=self._token)
            except anyio.RunFinishedError:
                pass
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("murmur.Peer's node did not stop within %.0f s", STOP_TIMEOUT_S)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _signature_default(field: str, negated: bool) -> Any:
    if field == "task":
        return None  # `Peer` labels the model itself (see `_default_label`)
    return not _default(field) if negated else _default(field)


# `help(murmur.Peer)` lists every option it accepts with its default, named like `murmur run`'s flags
# (`relay`, not `relays`); the options it refuses (`REFUSED`) are left out.
_BY_FLAG = {field: alias for alias, (field, _) in FLAG_NAMES.items()}
Peer.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=nn.Module),
     inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.optim.Optimizer)]
    + [inspect.Parameter(_BY_FLAG.get(name, name), inspect.Parameter.KEYWORD_ONLY,
                         default=_signature_default(name, FLAG_NAMES.get(_BY_FLAG.get(name, ""), ("", False))[1]),
                         annotation=bool if FLAG_NAMES.get(_BY_FLAG.get(name, ""), ("", False))[1]
                         else str | None if name == "task" else _HINTS[name])
       for name in _FIELDS if name not in REFUSED]
)
