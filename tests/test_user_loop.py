"""StepGate: other threads' model work runs on the owner thread at its `serve()`, or directly while parked."""

from __future__ import annotations

import threading

import pytest

from murmur.node.learn.user_loop import ForeignOptimizer, StepGate, check_optimizer


def _wait_queued(gate: StepGate, n: int) -> None:
    for _ in range(500):  # at most 5 s
        if gate.pending() == n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{gate.pending()} calls queued, expected {n}")


def _call_in_thread(gate: StepGate, func, *args) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(gate.call(func, *args)), daemon=True)
    thread.start()
    return thread, result


def test_a_parked_gate_runs_calls_directly() -> None:
    gate = StepGate()
    assert gate.call(lambda x: x + 1, 1) == 2


def test_an_open_gate_runs_calls_on_the_owner_thread_at_serve() -> None:
    gate = StepGate()
    gate.open()
    ran_on: list[str] = []
    thread, result = _call_in_thread(gate, lambda: ran_on.append(threading.current_thread().name) or "done")
    _wait_queued(gate, 1)
    assert thread.is_alive() and not result  # waits for the owner's step boundary
    assert gate.serve() == 1
    thread.join(5)
    assert result == ["done"] and ran_on == [threading.current_thread().name]


def test_an_error_reaches_the_caller_and_park_drains_the_queue() -> None:
    gate = StepGate()
    gate.open()
    errors: list[BaseException] = []

    def fail() -> None:
        raise KeyError("boom")

    def call() -> None:
        try:
            gate.call(fail)
        except KeyError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    _wait_queued(gate, 1)
    gate.park()  # runs whatever is queued; later calls run directly
    thread.join(5)
    assert [str(e) for e in errors] == ["'boom'"]
    assert gate.call(lambda: 3) == 3


def test_an_optimizer_of_another_model_is_refused() -> None:
    import torch

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ForeignOptimizer, match="2 of 2 parameters that are not this model's"):
        check_optimizer(model, torch.optim.SGD(other.parameters(), lr=0.1))
    check_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
