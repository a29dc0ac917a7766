"""`python -m lab.peer [lab flags] run [murmur run flags]`: a `murmur run` peer with the lab's hooks around it.

The node is `murmur run`'s own (`murmur.node.ops.run.main`, same flags and settings); the lab
adds what only experiments need, through the node's public seams, never through the operator's
configuration:

  --step-time MS       pace: pad every step to S x MS ms per 32 samples (S: `--slowdown`)
  --start-at T         start training at Unix time T (after joining and syncing)
  --start-file FILE    start training at the Unix time FILE holds, once written (status phase "waiting")
  --record-params      keep copies of the parameters at the first --params-kept evaluations, and save
                       them to params.pt in the data dir on exit
  --params-kept N      the most copies --record-params keeps (default 256)
  --lr-scale X         multiply the task's learning rate by X (not again on a resumed optimizer)
  --trace FILE         pace by peer --trace-peer's slowdowns in this speed trace (`lab.traces`), in seconds
                       since training started (the start time, with --start-at/--start-file); needs --step-time
  --trace-peer I       which peer of --trace this is (default 0)
  --outer-lr LR        outer learning rate of --merge outer (default 0.7; 1 with momentum 0 is averaging)
  --outer-momentum MU  Nesterov momentum of --merge outer (default 0.9)

Lab flags may also follow `run` (the swarm launchers append them to `murmur run`'s). The lab's
plugins (`lab.plugins`: `--partners link-speed`, `--optimizer-state average`, `--merge outer`) are registered
first, so they are choices of `run`. `python -m lab.peer id --data-dir DIR` prints a peer ID.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import torch

from lab.plugins import register
from lab.traces import PeerTrace, Trace, TracedPacing, TraceError
from lab.traces import load as load_trace
from murmur.node.learn.loop import Evaluation
from murmur.node.learn.replica import Replica
from murmur.node.learn.step import Pacing, scale_learning_rate
from murmur.node.ops import process, run
from murmur.node.ops.node import Node

PARAMS_FILE = "params.pt"
START_FILE_POLL_S = 0.02
DEFAULT_PARAMS_KEPT = 256


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused unless positive."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{value} is not positive")
        return value

    return parse


def _trace(path: str) -> Trace:
    """An argparse type: the speed trace in file `path`."""
    try:
        return load_trace(Path(path))
    except TraceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_lab_parser() -> argparse.ArgumentParser:
    """The lab's own flags (see the module docstring); everything else is left for `murmur run`.

    Abbreviations are off, so that no `murmur run` flag is taken for a lab flag it starts.
    """
    parser = argparse.ArgumentParser(prog="python -m lab.peer", add_help=False, allow_abbrev=False)
    parser.add_argument("--step-time", type=_positive(float), default=None, metavar="MS")
    parser.add_argument("--start-at", type=float, default=None, metavar="UNIX_TIME")
    parser.add_argument("--start-file", type=Path, default=None, metavar="FILE")
    parser.add_argument("--record-params", action="store_true")
    parser.add_argument("--params-kept", type=_positive(int), default=DEFAULT_PARAMS_KEPT, metavar="N")
    parser.add_argument("--lr-scale", type=_positive(float), default=1.0, metavar="X")
    parser.add_argument("--trace", type=_trace, default=None, metavar="FILE")
    parser.add_argument("--trace-peer", type=int, default=0, metavar="I")
    parser.add_argument("--outer-lr", type=float, default=0.7, metavar="LR")
    parser.add_argument("--outer-momentum", type=float, default=0.9, metavar="MU")
    return parser


async def wait_for_start_time(path: Path) -> float:
    """The Unix time written to `path`, once the file exists and holds one (polled; waits until cancelled).

    Write it atomically (rename a finished file into place) so that no half-written time is read.
    """
    while True:
        try:
            return float(path.read_text())
        except (OSError, ValueError):
            await anyio.sleep(START_FILE_POLL_S)


async def wait_to_start(start_at: float | None, start_file: Path | None) -> float:
    """Return at `start_at`, or at the time `start_file` holds once written (which wins when both are given);
    return the start time (now, given neither)."""
    if start_file is not None:
        start_at = await wait_for_start_time(start_file)
    if start_at is not None:
        await anyio.sleep(max(0.0, start_at - time.time()))
    return time.time() if start_at is None else start_at


def traced_pacing(trace: PeerTrace, step_time_ms: float) -> tuple[TracedPacing, Callable[[float], None]]:
    """A pacing that follows `trace`, and the function that sets its origin (the Unix time training starts)."""
    origin = [time.time()]
    pacing = TracedPacing(trace, step_time_ms, clock=lambda: time.time() - origin[0])
    return pacing, lambda start: origin.__setitem__(0, start)


class ParamsRecorder:
    """Flat copies of a replica's parameters at its first `limit` evaluations, and when each was taken.

    Bounded so that a long run cannot fill memory. The copies are the first ones rather than
    a thinned sample of the run: the benchmark lines up peers' copies by their index.
    """

    def __init__(self, replica: Replica, limit: int = DEFAULT_PARAMS_KEPT) -> None:
        """Raises `ValueError` for a `limit` below 1."""
        if limit < 1:
            raise ValueError(f"keep at least one parameter copy, got {limit}")
        self.replica = replica
        self.limit = limit
        self.history: list[tuple[float, torch.Tensor]] = []  # (Unix time, flat parameters)

    def __call__(self, evaluation: Evaluation) -> None:
        if len(self.history) >= self.limit:
            return
        state = self.replica.snapshot().state
        self.history.append((time.time(), torch.cat([t.flatten() for t in state.values()])))

    def save(self, path: Path) -> None:
        """Write the copies with `torch.save`, if any were kept."""
        if self.history:
            torch.save(self.history, path)


def hooks(args: argparse.Namespace) -> run.Around:
    """The lab's hooks for `args` (from `build_lab_parser`), to enter around a `murmur run` node (see `run.main`).

    On exit (the node stopped) the recorded parameters, if any, are saved to the data dir.
    """

    @asynccontextmanager
    async def around(node: Node) -> AsyncIterator[None]:
        set_origin: Callable[[float], object] = lambda start: None
        if args.trace is not None:
            node.pacing, set_origin = traced_pacing(args.trace.peers[args.trace_peer], args.step_time)
        elif args.step_time is not None:
            node.pacing = Pacing(node.pacing.slowdown, args.step_time)

        async def start_gate() -> None:
            set_origin(await wait_to_start(args.start_at, args.start_file))

        if args.start_at is not None or args.start_file is not None or args.trace is not None:
            node.start_gate = start_gate
        assert node.loop is not None, "murmur run trains in its own loop"
        if args.lr_scale != 1.0 and node.resumed_from is None:  # a resumed optimizer carries its scaled rate
            scale_learning_rate(node.loop.replica.optimizer, args.lr_scale)
        recorder = ParamsRecorder(node.replica, args.params_kept) if args.record_params else None
        if recorder is not None:
            node.on_evaluation = recorder
        try:
            yield
        finally:
            if recorder is not None:
                recorder.save(node.config.data_dir / PARAMS_FILE)

    return around


def main(argv: list[str]) -> int:
    """Run `argv` (lab flags, then `run` and `murmur run`'s flags; or `id --data-dir DIR`); return the exit status."""
    parser = build_lab_parser()
    args, rest = parser.parse_known_args(argv)
    if args.trace is not None and args.step_time is None:
        parser.error("--trace needs --step-time (a trace's slowdowns multiply the step time)")
    if args.trace is not None and not 0 <= args.trace_peer < len(args.trace.peers):
        parser.error(f"--trace-peer {args.trace_peer}: the trace has peers 0..{len(args.trace.peers) - 1}")
    if rest[:1] == ["id"]:
        from murmur.node.net.identity import load_or_create_identity, peer_id_of

        ident = argparse.ArgumentParser(prog="python -m lab.peer id")
        ident.add_argument("--data-dir", type=Path, required=True)
        print(peer_id_of(load_or_create_identity(ident.parse_args(rest[1:]).data_dir)))
        return 0
    if rest[:1] != ["run"]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        register(args.outer_lr, args.outer_momentum)  # before `murmur run`'s parser is built: the plugins are among its choices
    except ValueError as e:
        parser.error(str(e))
    return run.main(rest[1:], around=hooks(args))


if __name__ == "__main__":
    with process.quiet_stop_signals():
        code = main(sys.argv[1:])
    process.exit_now(code)  # as `murmur run`: no interpreter teardown once the node has stopped
