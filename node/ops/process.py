"""How a `murmur` command process starts and ends: stop signals, exit codes, a closed stdout.

Torch-free and import-light, so `murmur status` and the first moments of every command
(before torch is imported) are covered too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
BROKEN_PIPE = 1  # what Python's own docs suggest when the reader of stdout went away


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


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while the context runs; one that arrived meanwhile is handled as it exits.

    For importing C extensions that clear any Python error raised while they initialise: torch's
    imports numpy that way, so a KeyboardInterrupt raised inside numpy's import would be lost and
    the command would carry on. Threads started inside the context inherit the held mask, so the
    signal reaches this thread. Where the platform has no signal masks, a no-op.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    stop = {signal.SIGINT, signal.SIGTERM}
    held_before = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held_before)


def run_command(main: Callable[[], int]) -> int:
    """Run `main` and return its exit status, turning the two ways a user ends a command early into
    a status instead of a traceback: Ctrl-C (KeyboardInterrupt, alone or in an exception group,
    at any moment, imports included) returns `INTERRUPTED`; a reader that closed stdout
    (`murmur status --json | head`) returns `BROKEN_PIPE`, with stdout sent to /dev/null so the
    interpreter's final flush cannot complain either. Other errors propagate."""
    code: int = INTERRUPTED
    try:
        code = main()
        sys.stdout.flush()  # here, so a closed pipe is seen while it can still be handled
    except* KeyboardInterrupt:
        code = INTERRUPTED
    except* BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = BROKEN_PIPE
    return code


def exit_now(code: int) -> NoReturn:
    """Exit at once after `murmur run` stopped cleanly (checkpoint and status on disk): the
    interpreter's teardown of torch and libp2p would take another 1-3 s, which every restart,
    benchmark run and supervisor waits for."""
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    with contextlib.suppress(BrokenPipeError):
        sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
