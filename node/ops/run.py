"""`murmur run`: one peer, configured by flags, `MURMUR_*` variables and a TOML file, until it is told to stop."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import TYPE_CHECKING, NoReturn

import anyio

from murmur.node.ops.config import add_options, run_settings
from murmur.node.ops.config_sources import ConfigError, resolve_options
from murmur.node.ops.logs import configure_logging

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
    parser = argparse.ArgumentParser(prog="murmur run", description="Run a Murmur peer (the daemon).", epilog=RUN_EPILOG)
    add_options(parser)
    return parser


# `murmur run --duration` given bootstrap peers that never merged with any peer: it trained alone.
EXIT_NEVER_JOINED = 3


async def _run_until_signal(config, key_pair, pacing, around: Around | None) -> Node:
    """Run a node (inside `around(node)`, if given) and return it; the first SIGINT/SIGTERM stops it gracefully, a second one at once."""
    from murmur.node.ops.node import build_node

    node = build_node(config, key_pair, pacing=pacing)
    async with around(node) if around is not None else nullcontext(), anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
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
    from murmur.node.ops.metrics import MetricsUnavailable

    config, options, emulation = run_settings(args)
    try:  # before anything else, so a wrong device costs one line and no half-started node
        device = resolve_device(config.device)
        if config.mixed_precision:
            check_mixed_precision(device)
    except DeviceError as exc:
        print(f"murmur run: error: {exc}", file=sys.stderr)
        return 2
    release_big_buffers_promptly()
    key_pair = load_or_create_identity(config.data_dir)
    configure_logging(options.log_level, peer_id_of(key_pair), options.log_format)
    config = dataclasses.replace(config, device=str(device))
    unavailable: BaseException | None = None
    node = None
    # Modules and start-up objects live as long as the process: keep full collections from rescanning them.
    gc.freeze()
    try:
        node = anyio.run(_run_until_signal, config, key_pair, Pacing(emulation.slowdown), around, backend="trio")
    except* MetricsUnavailable as group:  # e.g. a taken port: one line, not a traceback
        unavailable = group
        while isinstance(unavailable, BaseExceptionGroup):
            unavailable = unavailable.exceptions[0]
    if unavailable is not None:
        print(f"murmur run: error: {unavailable}", file=sys.stderr)
        return 1
    return never_joined_exit(node)


def never_joined_exit(node: Node | None) -> int:
    """`EXIT_NEVER_JOINED` (with one line on stderr) if a run that ended by its `--duration` had
    bootstrap peers but never merged with a peer; else 0. A run stopped by a signal was stopped
    on purpose, and a node without bootstrap peers is a swarm's first: both exit 0."""
    reason = node.never_joined() if node is not None and node.duration_ended else None
    if reason is None:
        return 0
    print(f"murmur run: never merged with a peer: {reason}", file=sys.stderr)
    return EXIT_NEVER_JOINED


def main(argv: list[str], around: Around | None = None) -> int:
    """`murmur run ARGV`: run a peer until its `--duration` ends or a stop signal; return the exit status.

    A bad setting exits 2 with one line naming it (as argparse does); an unusable device
    returns 2 and a taken metrics port 1, each with one line on stderr; a `--duration` run given
    bootstrap peers that never merged with one returns 3 (`EXIT_NEVER_JOINED`). `around(node)`, if
    given, is entered once the node is built, before it runs, and exited after it stopped;
    its errors propagate.
    """
    parser = build_run_parser()
    try:
        args = resolve_options(parser, argv, os.environ)
    except ConfigError as exc:
        parser.exit(2, f"murmur run: error: {exc}\n")
    return cmd_run(args, around)


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def quiet_stop_signals() -> Iterator[None]:
    """A SIGTERM while a command starts up (importing torch) exits cleanly; once it has returned,
    stop signals are ignored. Python resets handlers to the default while tearing down, which
    would let a late SIGTERM kill a finished process (-15). A running node handles signals itself."""
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_now(code: int) -> NoReturn:
    """Exit at once after `murmur run` stopped cleanly (checkpoint and status on disk): the
    interpreter's teardown of torch and libp2p would take another 1-3 s, which every restart,
    benchmark run and supervisor waits for."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


