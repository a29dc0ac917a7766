"""`murmur run`: one peer, configured by flags, `MURMUR_*` variables and a TOML file, until it is told to stop."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import TYPE_CHECKING

import anyio

from murmur.node.ops.config import add_options, run_settings
from murmur.node.ops.config_sources import ConfigError, resolve_options
from murmur.node.ops.logs import configure_logging
from murmur.node.ops.parsing import Parser
from murmur.node.ops.process import INTERRUPTED

if TYPE_CHECKING:
    from murmur.node.ops.node import Node

# Entered around a running node, once built: what runs the node (the lab) installs its hooks there.
Around = Callable[["Node"], AbstractAsyncContextManager[object]]

RUN_EPILOG = (
    "Every option can also be set as an environment variable MURMUR_<OPTION> (e.g. MURMUR_BOOTSTRAP, "
    "MURMUR_METRICS_PORT; repeatable options take a comma- or space-separated list, flags true or false) "
    "or as a key of the --config TOML file (named like the option, with dashes or underscores). "
    "Precedence: flags > environment > config file > defaults."
)


def build_run_parser() -> argparse.ArgumentParser:
    """`murmur run` alone: the options that flags, MURMUR_* variables and --config files set."""
    parser = Parser(prog="murmur run", description="Run a Murmur peer (the daemon).", epilog=RUN_EPILOG)
    add_options(parser)
    return parser


# `murmur run --duration` given bootstrap peers that never merged with any peer: it trained alone.
EXIT_NEVER_JOINED = 3


async def _run_until_signal(config, key_pair, pacing, around: Around | None, received: list[int], lock) -> Node:
    """Run a node (inside `around(node)`, if given) and return it; the first SIGINT/SIGTERM stops it gracefully, a
    second one at once. Each stop signal is appended to `received`; the node owns the data dir's `lock` from here on."""
    from murmur.node.ops.assembly import build_node

    # First of all: from here on a stop signal is an event for `stop_on_signal`, never a KeyboardInterrupt raised
    # in whatever task runs then (py-libp2p turns some of those into other errors, or logs them and goes on).
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        node = build_node(config, key_pair, pacing=pacing, data_dir_lock=lock)
        async with around(node) if around is not None else nullcontext(), anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                async for signum in signals:  # those that came while the node was built too
                    received.append(signum)
                    logging.getLogger("murmur").info("received %s: stopping", signal.Signals(signum).name)
                    if node.stopping:
                        tg.cancel_scope.cancel()
                    node.request_stop()

            tg.start_soon(stop_on_signal)
            await node.run()
            tg.cancel_scope.cancel()
    return node


def release_big_buffers_promptly() -> None:
    """Give every allocation of 8 MiB or more its own mmap, returned to the OS when freed.

    glibc otherwise raises its mmap threshold after the first large free (up to 32 MiB),
    so a big model's exchange buffers would linger in the heap between exchanges.
    Smaller buffers (1 MiB chunks, 4 MiB pieces) stay in the heap, where reuse is cheap.
    A no-op where the C library is not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def cmd_run(args: argparse.Namespace, around: Around | None = None) -> int:
    from murmur.node.learn.device import DeviceError, check_mixed_precision, resolve_device
    from murmur.node.learn.step import Pacing
    from murmur.node.net.identity import load_or_create_identity, peer_id_of
    from murmur.node.ops.data_dir import DataDirError, DataDirLock
    from murmur.node.ops.tracking import TrackingUnavailable, require_trackers

    config, options, emulation = run_settings(args)
    try:  # before anything else, so a wrong device costs one line and no half-started node
        device = resolve_device(config.device)
        if config.mixed_precision:
            check_mixed_precision(device)
    except DeviceError as exc:
        print(f"murmur run: error: {exc}", file=sys.stderr)
        return 2
    try:  # a tracker's missing package, likewise, before the node is built
        require_trackers(config)
    except TrackingUnavailable as exc:
        print(f"murmur run: error: {exc}", file=sys.stderr)
        return 2
    try:  # before the identity is read: a second node on this folder must not start as the same peer
        lock = DataDirLock.acquire(config.data_dir)
    except DataDirError as exc:
        print(f"murmur run: error: {_with_fix(exc)}", file=sys.stderr)
        return 1
    received: list[int] = []
    error: BaseException | None = None
    node = None
    with lock:  # the node releases it when it stops; here too, should it never get that far
        release_big_buffers_promptly()
        key_pair = load_or_create_identity(config.data_dir)
        configure_logging(options.log_level, peer_id_of(key_pair), options.log_format)
        config = dataclasses.replace(config, device=str(device))
        # Modules and start-up objects live as long as the process: keep full collections from rescanning them.
        gc.freeze()
        try:
            node = anyio.run(_run_until_signal, config, key_pair, Pacing(emulation.slowdown), around, received, lock, backend="trio")
        except* _start_errors() as group:  # a taken port, an unknown task, a full disk: one line, not a traceback
            error = _first_leaf(group)
    if error is not None:
        print(f"murmur run: error: {_with_fix(error)}", file=sys.stderr)
        return 2 if _is_setting_error(error) else 1
    if signal.SIGINT in received:
        return INTERRUPTED
    return never_joined_exit(node)


def _start_errors() -> tuple[type[Exception], ...]:
    from murmur.node.learn.checkpoint import CheckpointWriteFailed
    from murmur.node.learn.tasks import UnknownTask
    from murmur.node.net.transport import CannotListen
    from murmur.node.ops.data_dir import DataDirError
    from murmur.node.ops.metrics import MetricsUnavailable
    from murmur.node.ops.tracking import TrackingUnavailable

    # CheckpointWriteFailed: the checkpoint on exit (a full disk); the node stopped cleanly otherwise.
    return MetricsUnavailable, CannotListen, DataDirError, UnknownTask, TrackingUnavailable, CheckpointWriteFailed


def _is_setting_error(error: BaseException) -> bool:
    from murmur.node.learn.tasks import UnknownTask
    from murmur.node.ops.tracking import TrackingUnavailable

    return isinstance(error, UnknownTask | TrackingUnavailable)


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _with_fix(error: BaseException) -> str:
    """The error's one line, with what the user can do about it where the error alone does not say."""
    from murmur.node.net.transport import CannotListen
    from murmur.node.ops.data_dir import DataDirLocked, DataDirUnusable

    if isinstance(error, CannotListen):
        if "in use" in error.reason:
            return f"{error}: another process listens there; give this node another --listen port (tcp/0: any free one)"
        return f"{error}: give --listen an address of this machine, e.g. /ip4/0.0.0.0/tcp/4001"
    if isinstance(error, DataDirLocked):
        holder = f"PID {error.pid}" if error.pid is not None else "PID unknown"
        return f"data dir {error.path} is in use by another Murmur node ({holder}): stop it, or give this node its own --data-dir"
    if isinstance(error, DataDirUnusable):
        return f"{error}: give --data-dir a folder this user can write"
    return str(error)


def never_joined_exit(node: Node | None) -> int:
    """`EXIT_NEVER_JOINED` (with one line on stderr) if a run that ended by its `--duration` had
    bootstrap peers but never merged with a peer; else 0. A run stopped by a signal was stopped
    on purpose, and a node without bootstrap peers is a swarm's first: neither gets 3."""
    reason = node.never_joined() if node is not None and node.duration_ended else None
    if reason is None:
        return 0
    print(f"murmur run: never merged with a peer: {reason}", file=sys.stderr)
    return EXIT_NEVER_JOINED


def main(argv: list[str], around: Around | None = None) -> int:
    """`murmur run ARGV`: run a peer until its `--duration` ends or a stop signal; return the exit status.

    A bad setting exits 2 with one line naming it (as argparse does); an unusable device, an
    unloadable task or a tracker whose package is missing (`--tensorboard`, `--wandb`) returns 2;
    a data dir that another node holds or that cannot be written, a listen or metrics port that
    cannot be opened, and a checkpoint on exit that cannot be written (a full disk), return 1;
    each with one line on stderr. A
    `--duration` run given bootstrap peers that never merged with one returns 3 (`EXIT_NEVER_JOINED`).
    A run stopped by SIGINT (Ctrl-C) returns 130 once it stopped gracefully, as shells expect. `around(node)`, if
    given, is entered once the node is built, before it runs, and exited after it stopped;
    its errors propagate.
    """
    parser = build_run_parser()
    try:
        args = resolve_options(parser, argv, os.environ)
    except ConfigError as exc:
        parser.exit(2, f"murmur run: error: {exc}\n")
    return cmd_run(args, around)




