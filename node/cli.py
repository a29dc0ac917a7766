"""The `murmur` command: `run` a peer, show a node's `status`, `export` its model, print its `id`; and, from a
source checkout, `demo` a local swarm and `bench` against all-reduce.

It sits above `murmur.node.ops` (the running node), which knows nothing of it; each subcommand
imports what it needs when it runs, so `murmur status` stays free of torch, and the module
itself imports little, so a Ctrl-C however early ends in exit status 130, not a traceback. `demo` and `bench`
belong to the lab (`lab/` beside the package), which is not installed: an editable install
finds it in its checkout, any other install says in one line where to get it.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from murmur.node.ops import process
from murmur.node.ops.parsing import Parser


def build_parser() -> argparse.ArgumentParser:
    from murmur import __version__
    from murmur.node.ops.status import default_data_dir

    parser = Parser(prog="murmur", description="Decentralized gossip training of PyTorch models.")
    parser.add_argument("--version", action="version", version=f"murmur {__version__}", help="print murmur's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("run", help="run a peer (the daemon; see --help)", add_help=False)  # parsed by murmur.node.ops.run
    demo = sub.add_parser("demo", help="run a local swarm of emulated heterogeneous peers (from a checkout)")
    demo.add_argument("--peers", type=int, default=4, help="how many peers")
    demo.add_argument("--slowdowns", default="1,1,2,4", help="comma-separated slowdown per peer (cycled)")
    demo.add_argument("--duration", type=float, default=60.0, help="seconds of training")
    demo.add_argument("--task", default="digits", help="what to train (as murmur run --task)")
    demo.add_argument("--weighting", default="work", help="how to weight a merge (as murmur run --weighting)")
    demo.add_argument("--step-time", type=float, default=20.0, metavar="MS", help="emulated ms per 32 samples at slowdown 1")
    demo.add_argument("--no-sync", action="store_true", help="skip the synchronous baseline run")
    demo.add_argument("--out", type=Path, default=Path("murmur-demo"), help="folder for peer data, summary and plot")
    sub.add_parser("bench", help="heterogeneous-swarm benchmark vs synchronous all-reduce (from a checkout; see --help)",
                   add_help=False)
    sub.add_parser("status", help="show a running node's state, or check its health (see --help)", add_help=False)
    sub.add_parser("export", help="write a node's model as a safetensors file or a Hugging Face folder (see --help)", add_help=False)
    ident = sub.add_parser("id", help="print this node's peer ID (creating its key if needed)")
    ident.add_argument("--data-dir", type=Path, default=default_data_dir(),
                       help="the node's data dir (default $MURMUR_DATA_DIR or ~/.murmur)")
    return parser


def _find_lab(command: str) -> bool:
    """Put the checkout's `lab/` on the import path; False (having said why) if this install has none."""
    checkout = Path(__file__).resolve().parents[1]  # node/cli.py in a checkout; murmur/node/cli.py in a wheel
    if not (checkout / "lab" / "__init__.py").is_file():
        print(f"murmur {command}: this needs the lab, which runs from a source checkout: clone Murmur and run "
              f"scripts/setup.sh there (it installs the lab's extra, '.[lab]')", file=sys.stderr)  # fmt: skip
        return False
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    return True


def cmd_id(args: argparse.Namespace) -> int:
    from murmur.node.net.identity import load_or_create_identity, peer_id_of

    print(peer_id_of(load_or_create_identity(args.data_dir)))
    return 0


# The commands that import torch; `status` and `id` stay free of it.
TORCH_COMMANDS = ("run", "bench", "export", "demo")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with process.quiet_stop_signals():
        if argv and argv[0] in TORCH_COMMANDS:
            with process.stop_signals_held():  # a Ctrl-C during torch's import would be lost
                import torch  # noqa: F401
        if argv[:1] == ["run"]:
            from murmur.node.ops import run

            return run.main(argv[1:])
        if argv[:1] == ["bench"]:
            if not _find_lab("bench"):
                return 2
            from lab.bench_cli import main as bench_main

            return bench_main(argv[1:])
        if argv[:1] == ["export"]:
            from murmur.node.ops.export import main as export_main

            return export_main(argv[1:])
        if argv[:1] == ["status"]:  # no torch import: cheap enough for a container's HEALTHCHECK
            from murmur.node.ops.status import main as status_main

            return status_main(argv[1:])
        args = build_parser().parse_args(argv)
        if args.command == "id":
            return cmd_id(args)
        if not _find_lab("demo"):
            return 2
        from lab.demo import run_demo

        return run_demo(args)


def entry() -> None:
    """The `murmur` console script; `murmur run` exits without interpreter teardown (see `process.exit_now`).

    Ctrl-C exits 130 and a closed stdout 1, without a traceback (`process.run_command`)."""
    argv = sys.argv[1:]

    def command() -> int:
        # Inside `run_command`, so that a Ctrl-C the moment the handler is set is an exit status too.
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with Ctrl-C ignored (`murmur run &`)
        return main(argv)

    code = process.run_command(command)
    if argv[:1] == ["run"] or code in (process.INTERRUPTED, process.BROKEN_PIPE):
        process.exit_now(code)  # nothing left worth tearing down, and teardown could still print
    sys.exit(code)


if __name__ == "__main__":
    entry()
