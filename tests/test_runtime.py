"""Where a peer's clocks and blocking work come from: real ones, or the event loop's (mock) clock and inline calls."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import trio.testing

from murmur.node.learn.runtime import Runtime

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


async def _with_a_timer_due_at(deadline: float, runtime: Runtime, func, *args):
    """Run `func` through `runtime` while another task sleeps until `deadline`; return the clock after."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.sleep, deadline)
        await runtime.run_sync(func, *args)
        after = anyio.current_time()
        tg.cancel_scope.cancel()
    return after


async def test_simulated_time_is_the_event_loops_clock_for_both_clocks() -> None:
    runtime = Runtime.simulated()
    start = runtime.monotonic()
    await anyio.sleep(100)  # jumps: the mock clock costs no real time
    assert runtime.monotonic() - start == 100 and runtime.wall() == runtime.monotonic()


async def test_simulated_blocking_work_runs_inline_and_takes_no_simulated_time() -> None:
    runtime = Runtime.simulated()
    assert await runtime.run_sync(threading.get_ident) == threading.get_ident()
    start = anyio.current_time()
    assert await _with_a_timer_due_at(start + 10, runtime, time.sleep, 0.05) == start


async def test_the_real_runtime_runs_blocking_work_on_a_worker_thread() -> None:
    runtime = Runtime()
    assert await runtime.run_sync(threading.get_ident) != threading.get_ident()
    assert abs(runtime.wall() - time.time()) < 1 and abs(runtime.monotonic() - time.monotonic()) < 1
    # Why simulations run inline: while a worker thread computes, the autojumping mock clock
    # sees every task waiting and jumps to the next timer.
    start = anyio.current_time()
    assert await _with_a_timer_due_at(start + 10, runtime, time.sleep, 0.05) == start + 10
