"""Where a peer's time and blocking work come from: the real ones, or a simulation's.

The training loop and the averager read clocks and hand torch work to worker threads
through a `Runtime`, so the simulator swaps in simulated time and inline calls by
passing `Runtime.simulated()` instead of patching modules.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


async def run_inline(func: Callable[..., T], *args: Any) -> T:
    """Run `func(*args)` on the event loop's thread: no simulated time passes meanwhile."""
    return func(*args)


@dataclass(frozen=True)
class Runtime:
    """`monotonic` for durations and deadlines, `wall` for Unix timestamps, `run_sync` for blocking work,
    `cpu_time` for the CPU seconds the calling thread has used.

    `run_sync(func, *args)` runs `func` off the event loop (by default on a worker
    thread; a caller cancelled meanwhile waits for the thread to finish, then raises).
    """

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    run_sync: Callable[..., Awaitable[Any]] = anyio.to_thread.run_sync
    cpu_time: Callable[[], float] = time.thread_time

    @classmethod
    def simulated(cls) -> Runtime:
        """The event loop's (mock) clock for every clock, and blocking work run inline.

        Under Trio's autojumping `MockClock` a worker thread in flight would let time
        jump ahead while it computes; inline, torch work takes no simulated time. Every
        simulated second counts as computing (`cpu_time`), as a simulated transfer models its cost.
        """
        return cls(monotonic=anyio.current_time, wall=anyio.current_time, run_sync=run_inline, cpu_time=anyio.current_time)
