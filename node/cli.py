"""The `murmur` command: `run` a peer, `demo` a local swarm, print a node's `id`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import anyio

DEFAULT_DATA_DIR = Path.home() / ".murmur"


def _add_run_options(p: argparse.ArgumentParser) -> None:
    from node.merge import POLICIES

    p.add_argument("--task", default="digits", help="built-in task (digits, charlm) or package.module:factory")
    p.add_argument("--run-id", default=None, help="swarm run id; peers only pair within one run (default: the task name)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="identity key, status and metrics (default ~/.murmur)")
    p.add_argument("--listen", action="append", default=None, metavar="MULTIADDR", help="listen address, repeatable (default /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="a peer to join through: /ip4/…/tcp/…/p2p/<id>, repeatable")
    p.add_argument("--addr-file", type=Path, default=None, help="write the listening addresses here, one per line")
    p.add_argument("--slowdown", type=float, default=1.0, help="emulate a device S times slower (sleep (S-1) x compute after each step)")
    p.add_argument("--step-time", type=float, default=None, metavar="MS", help="pad every step to S x MS ms per 32 samples")
    p.add_argument("--weighting", choices=sorted(POLICIES), default="work", help="how to weight the two models of a merge")
    p.add_argument("--average-every", type=float, default=0.1, metavar="SECONDS", help="seconds between averaging attempts")
    p.add_argument("--exchange-timeout", type=float, default=10.0, metavar="SECONDS", help="give up an exchange after this long")
    p.add_argument("--liveness-timeout", type=float, default=10.0, metavar="SECONDS", help="drop peers silent for this long")
    p.add_argument("--eval-every", type=float, default=1.0, metavar="SECONDS", help="evaluate on held-out data this often")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="stop after this many seconds of training")
    p.add_argument("--shard", type=int, default=None, help="data shard / seed (default: derived from the peer id)")
    p.add_argument("--no-state-sync", action="store_true", help="do not pull the swarm's model before the first step")
    p.add_argument("--checkpoint-every", type=float, default=30.0, metavar="SECONDS", help="checkpoint this often (and on exit)")
    p.add_argument("--allow-peers", type=Path, default=None, metavar="FILE", help="only these peer IDs (one per line) may connect")
    p.add_argument("--swarm-secret-file", type=Path, default=None, metavar="FILE", help="shared secret that Murmur streams must prove")
    p.add_argument("--max-connections", type=int, default=300, help="connection limit (inbound + outbound)")
    p.add_argument("--start-at", type=float, default=None, metavar="UNIX_TIME", help="join first, start training at this time")
    p.add_argument("--record-params", action="store_true", help="save the parameters at every evaluation (benchmarks)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


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
    ident = sub.add_parser("id", help="print this node's peer ID (creating its key if needed)")
    ident.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    return parser


def configure_logging(level: str, peer_id: str = "") -> None:
    tag = f"[{peer_id[-8:]}]" if peer_id else ""
    logging.basicConfig(level=level.upper(), format=f"murmur{tag} %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


async def _run_until_signal(config, key_pair) -> None:
    """Run a node; the first SIGINT/SIGTERM stops it gracefully, a second one at once."""
    from node.node import build_node

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


def cmd_run(args: argparse.Namespace) -> int:
    from node.identity import load_or_create_identity, peer_id_of
    from node.node import NodeConfig

    key_pair = load_or_create_identity(args.data_dir)
    configure_logging(args.log_level, peer_id_of(key_pair))
    config = NodeConfig(
        data_dir=args.data_dir, task=args.task, run_id=args.run_id, listen=args.listen or ["/ip4/0.0.0.0/tcp/0"],
        bootstrap=args.bootstrap, addr_file=args.addr_file, slowdown=args.slowdown, step_time_ms=args.step_time,
        weighting=args.weighting, average_every=args.average_every, exchange_timeout=args.exchange_timeout,
        liveness_timeout=args.liveness_timeout, eval_every=args.eval_every, duration=args.duration,
        shard=args.shard, sync_state=not args.no_state_sync, start_at=args.start_at, record_params=args.record_params,
        checkpoint_every=args.checkpoint_every, allow_peers=args.allow_peers,
        swarm_secret_file=args.swarm_secret_file, max_connections=args.max_connections,
    )
    anyio.run(_run_until_signal, config, key_pair, backend="trio")
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    from node.identity import load_or_create_identity, peer_id_of

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
        from scripts.bench_heterogeneous import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "id":
            return cmd_id(args)
        from node.demo import run_demo

        return run_demo(args)
    finally:
        # The work is done and the process is exiting: a stop request now has nothing
        # left to stop. Python resets handlers to the default while tearing down, which
        # would let a late SIGTERM kill the process (-15); ignored signals stay ignored.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
