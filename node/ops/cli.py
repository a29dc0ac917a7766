"""The `murmur` command: `run` a peer, `demo` a local swarm, print a node's `id`."""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import anyio

from node.ops.logs import LOG_FORMATS, LOG_LEVELS, configure_logging

DEFAULT_DATA_DIR = Path.home() / ".murmur"
RUN_EPILOG = (
    "Every option can also be set as an environment variable MURMUR_<OPTION> (e.g. MURMUR_BOOTSTRAP, "
    "MURMUR_METRICS_PORT; repeatable options take a comma- or space-separated list, flags true or false) "
    "or as a key of the --config TOML file (named like the option, with dashes or underscores). "
    "Precedence: flags > environment > config file > defaults."
)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    from node.learn.rules import RULES
    from protocol.messages import WIRE_DTYPE_NAMES

    p.add_argument("--task", default="digits", help="built-in task (digits, charlm) or package.module:factory")
    p.add_argument("--run-id", default=None, help="swarm run id; peers only pair within one run (default: the task name)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="identity key, status and metrics (default ~/.murmur)")
    p.add_argument("--listen", action="append", default=None, metavar="MULTIADDR", help="listen address, repeatable (default /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--bootstrap", action="append", default=[], type=_bootstrap_addr, metavar="MULTIADDR", help="a peer to join through: /ip4/…/tcp/…/p2p/<id>, repeatable")
    p.add_argument("--addr-file", type=Path, default=None, help="write the listening (then announced) addresses here, one per line")
    p.add_argument("--announce", action="append", default=[], type=_announce_addr, metavar="MULTIADDR",
                   help="public address peers should dial instead of the listen addresses (port mapping, NAT), repeatable")
    p.add_argument("--relay", action="append", default=[], type=_relay_addr, metavar="MULTIADDR",
                   help="circuit-relay v2 peer (/ip4/…/tcp/…/p2p/<id>) to reserve a slot on when this node cannot be "
                        "dialed directly; it is then reached at <relay>/p2p-circuit/p2p/<own id>, repeatable")
    p.add_argument("--relay-service", action="store_true", help="relay (circuit v2 hop) for peers behind NAT, within fixed limits")
    p.add_argument("--slowdown", type=float, default=1.0, help="emulate a device S times slower (sleep (S-1) x compute after each step)")
    p.add_argument("--step-time", type=float, default=None, metavar="MS", help="pad every step to S x MS ms per 32 samples")
    p.add_argument("--weighting", choices=sorted(RULES), default="work", help="how to weight the two models of a merge")
    p.add_argument("--average-every", type=float, default=0.1, metavar="SECONDS", help="seconds between averaging attempts")
    p.add_argument("--exchange-timeout", type=float, default=10.0, metavar="SECONDS", help="give up an exchange after this long")
    p.add_argument("--liveness-timeout", type=float, default=10.0, metavar="SECONDS", help="drop peers silent for this long")
    p.add_argument("--view-size", type=_view_size, default=32, metavar="N", help="peers kept in the membership view, a rotating sample of the swarm (0: all)")
    p.add_argument("--eval-every", type=float, default=1.0, metavar="SECONDS", help="evaluate on held-out data this often")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="stop after this many seconds of training")
    p.add_argument("--shard", type=int, default=None, help="data shard / seed (default: derived from the peer id)")
    p.add_argument("--no-state-sync", action="store_true", help="do not pull the swarm's model before the first step")
    p.add_argument("--checkpoint-every", type=float, default=30.0, metavar="SECONDS", help="checkpoint this often (and on exit)")
    p.add_argument("--allow-peers", type=Path, default=None, metavar="FILE", help="only these peer IDs (one per line) may connect")
    p.add_argument("--swarm-secret-file", type=Path, default=None, metavar="FILE", help="shared secret that Murmur streams must prove")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPE_NAMES, default="float32", help="dtype parameters travel in when this node starts an exchange or state sync: float32 (exact), bfloat16/float16 (half the bytes), int8 (a quarter, per-tensor scale)")
    p.add_argument("--max-connections", type=int, default=300, help="connection limit (inbound + outbound)")
    p.add_argument("--start-at", type=float, default=None, metavar="UNIX_TIME", help="join first, start training at this time")
    p.add_argument("--start-file", type=Path, default=None, metavar="FILE",
                   help="join first, then wait until FILE holds a Unix time and start training then (status phase 'waiting' meanwhile)")
    p.add_argument("--record-params", action="store_true", help="save the parameters at every evaluation (benchmarks)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO", help="log records this severe and worse (default INFO)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text: readable lines; json: one JSON object per line (time, level, logger, message, peer)")
    p.add_argument("--metrics-port", type=_port, default=None, metavar="PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address the metrics endpoint binds to (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--config", type=Path, default=None, metavar="FILE", help="TOML file of options (see below); flags and MURMUR_* variables override it")
    p.add_argument("--device", type=_device_syntax, default="auto", metavar="DEVICE",
                   help="auto, cpu, cuda, cuda:N or mps; auto = cuda if available, else mps, else cpu (default auto)")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 autocast for forward pass and loss (CUDA only)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads for training (default: torch's own, usually one per core)")


def _device_syntax(spec: str) -> str:
    from node.learn.device import DeviceError, check_device_syntax

    try:
        return check_device_syntax(spec)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _announce_addr(text: str) -> str:
    import multiaddr

    try:
        multiaddr.Multiaddr(text)
    except Exception as exc:
        raise argparse.ArgumentTypeError(f"not a multiaddr: {text!r} ({exc})") from None
    if "/p2p-circuit" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is a relay circuit: use --relay <relay address> instead")
    return text


def _bootstrap_addr(text: str) -> str:
    import multiaddr
    from libp2p.peer.id import ID

    from node.net.membership import parse_bootstrap

    try:
        peer_id, _ = parse_bootstrap(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        multiaddr.Multiaddr(text)
        ID.from_base58(peer_id)
    except Exception as exc:  # the libraries raise assorted types for bad input
        raise argparse.ArgumentTypeError(f"bootstrap address {text!r} is not a valid multiaddr with a peer id ({exc})") from None
    return text


def _relay_addr(text: str) -> str:
    from node.net.relay import split_peer

    try:
        split_peer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0-65535")
    return port


def _view_size(text: str) -> int:
    size = int(text)
    if size < 0:
        raise argparse.ArgumentTypeError(f"view size {size} is negative (0 keeps every peer)")
    return size


def build_run_parser() -> argparse.ArgumentParser:
    """`murmur run` alone: the options that flags, MURMUR_* variables and --config files set."""
    parser = argparse.ArgumentParser(prog="murmur run", description="Run a Murmur peer (the daemon).", epilog=RUN_EPILOG)
    _add_run_options(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="murmur", description="Decentralized gossip training of PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_options(sub.add_parser("run", help="run a peer (the daemon)"))
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
    from node.ops.node import NodeConfig

    try:  # before anything else, so a wrong device costs one line and no half-started node
        device = resolve_device(args.device)
        if args.mixed_precision:
            check_mixed_precision(device)
    except DeviceError as exc:
        print(f"murmur run: error: {exc}", file=sys.stderr)
        return 2
    release_big_buffers_promptly()
    key_pair = load_or_create_identity(args.data_dir)
    configure_logging(args.log_level, peer_id_of(key_pair), args.log_format)
    config = NodeConfig(
        data_dir=args.data_dir, task=args.task, run_id=args.run_id, listen=args.listen or ["/ip4/0.0.0.0/tcp/0"],
        bootstrap=args.bootstrap, announce=args.announce, relays=args.relay, relay_service=args.relay_service,
        addr_file=args.addr_file, slowdown=args.slowdown, step_time_ms=args.step_time,
        weighting=args.weighting, average_every=args.average_every, exchange_timeout=args.exchange_timeout,
        liveness_timeout=args.liveness_timeout, view_size=args.view_size or None, eval_every=args.eval_every, duration=args.duration,
        shard=args.shard, sync_state=not args.no_state_sync, start_at=args.start_at, start_file=args.start_file, record_params=args.record_params,
        checkpoint_every=args.checkpoint_every, allow_peers=args.allow_peers,
        swarm_secret_file=args.swarm_secret_file, max_connections=args.max_connections, wire_dtype=args.wire_dtype,
        device=str(device), mixed_precision=args.mixed_precision,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, threads=args.threads,
    )
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
    from node.ops.config import ConfigError, resolve_options

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
