"""The `murmur` command: `run` a peer, `demo` a local swarm, print a node's `id`."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import anyio

from node.ops.config import DEFAULT_DATA_DIR, ConfigError, add_options, resolve_options, run_settings
from node.ops.logs import configure_logging

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="murmur", description="Decentralized gossip training of PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_options(sub.add_parser("run", help="run a peer (the daemon)"))
    demo = sub.add_parser("demo", help="run a local swarm of emulated heterogeneous peers")
    demo.add_argument("--peers", type=int, default=4)
    demo.add_argument("--slowdowns", default="1,1,2,4", help="comma-separated slowdown per peer (cycled)")
    demo.add_argument("--duration", type=float, default=60.0, help="seconds of training")
    demo.add_argument("--task", default="digits")
    demo.add_argument("--weighting", default="work")
    demo.add_argument("--step-time", type=float, default=20.0, metavar="MS", help="emulated ms per 32 samples at slowdown 1")
    demo.add_argument("--no-sync", action="store_true", help="skip the synchronous baseline run")
    demo.add_argument("--out", type=Path, default=Path("murmur-demo"), help="folder for peer data, summary and plot")
    sub.add_parser("bench", help="heterogeneous-swarm benchmark vs synchronous all-reduce (see --help)", add_help=False)
    sub.add_parser("status", help="show a running node's state, or check its health (see --help)", add_help=False)
    ident = sub.add_parser("id", help="print this node's peer ID (creating its key if needed)")
    ident.add_argument("--data-dir", type=Path, default=Path(os.environ.get("MURMUR_DATA_DIR", DEFAULT_DATA_DIR)).expanduser(),
                       help="the node's data dir (default $MURMUR_DATA_DIR or ~/.murmur)")
    return parser


async def _run_until_signal(config, key_pair) -> None:
    """Run a node; the first SIGINT/SIGTERM stops it gracefully, a second one at once."""
    from node.ops.node import build_node

    node = build_node(config, key_pair)
    async with anyio.create_task_group() as tg:

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


def cmd_run(args: argparse.Namespace) -> int:
    from node.learn.device import DeviceError, check_mixed_precision, resolve_device
    from node.net.identity import load_or_create_identity, peer_id_of
    from node.ops.metrics import MetricsUnavailable

    config, options = run_settings(args)
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
    # Modules and start-up objects live as long as the process: keep full collections from rescanning them.
    gc.freeze()
    try:
        anyio.run(_run_until_signal, config, key_pair, backend="trio")
    except* MetricsUnavailable as group:  # e.g. a taken port: one line, not a traceback
        unavailable = group
        while isinstance(unavailable, BaseExceptionGroup):
            unavailable = unavailable.exceptions[0]
    if unavailable is not None:
        print(f"murmur run: error: {unavailable}", file=sys.stderr)
        return 1
    return 0


def _run_args(argv: list[str]) -> argparse.Namespace:
    """`murmur run`'s options from flags, MURMUR_* variables and --config; exits 2 on a bad setting."""
    parser = build_run_parser()
    try:
        args = resolve_options(parser, argv, os.environ)
    except ConfigError as exc:
        parser.exit(2, f"murmur run: error: {exc}\n")
    args.command = "run"
    return args


def cmd_id(args: argparse.Namespace) -> int:
    from node.net.identity import load_or_create_identity, peer_id_of

    print(peer_id_of(load_or_create_identity(args.data_dir)))
    return 0


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    # A stop request that arrives while still starting up (importing torch) is a clean
    # exit too; once the node runs, its own signal handling takes over.
    signal.signal(signal.SIGTERM, _exit_quietly)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from node.lab.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["status"]:  # no torch import: cheap enough for a container's HEALTHCHECK
        from node.ops.status import main as status_main

        return status_main(argv[1:])
    args = _run_args(argv[1:]) if argv[:1] == ["run"] else build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "id":
            return cmd_id(args)
        from node.lab.demo import run_demo

        return run_demo(args)
    finally:
        # The work is done and the process is exiting: a stop request now has nothing
        # left to stop. Python resets handlers to the default while tearing down, which
        # would let a late SIGTERM kill the process (-15); ignored signals stay ignored.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def entry() -> None:
    """The `murmur` command. After `murmur run` has stopped cleanly (checkpoint and status
    on disk), exit at once: the interpreter's teardown of torch and libp2p would take
    another 1-3 s, which every restart, benchmark run and supervisor waits for."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["run"]:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
