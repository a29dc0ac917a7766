"""A loop on a thread of its own for the duration of a `with` block, as a user's training loop runs beside a test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def looping(step: Callable[[int], None], limit: int, join_s: float = 60.0) -> Iterator[None]:
    """Call `step(0)`, `step(1)`, … on another thread until the block ends (at most `limit` calls).

    Fails the test if a step raised (its error is reported) or the thread did not stop within `join_s`.
    """
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            for i in range(limit):  # bounded; stopped when the block ends
                if stop.is_set():
                    return
                step(i)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(join_s)
    assert not thread.is_alive() and not errors, errors
