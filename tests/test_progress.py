"""`lab.progress`: runs done of total, the current run and the times on a terminal; silence elsewhere."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lab.progress import Progress


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=100, color_system=None), out


def test_a_terminal_shows_runs_done_of_total_the_current_run_and_times() -> None:
    console, out = _console(terminal=True)
    with Progress(total=3, label="simulate", console=console) as progress:
        progress.start("100 peers, gossip")
        progress.advance()
        progress.start("300 peers, ring")
    shown = out.getvalue()  # the last frame, drawn when the bar stops
    assert "simulate" in shown and "1/3" in shown and "300 peers, ring" in shown
    assert "0:00:0" in shown and "eta" in shown  # elapsed and the estimate
    assert (progress.done, progress.current) == (1, "300 peers, ring")


def test_lines_printed_during_progress_stay_above_the_bar() -> None:
    console, out = _console(terminal=True)
    with Progress(total=2, label="bench", console=console) as progress:
        progress.start("run a")
        console.print("run a: 812 samples/s")
        progress.advance()
        progress.start("run b")
        progress.advance()
    final = out.getvalue()
    assert "run a: 812 samples/s" in final and "2/2" in final[final.index("run a: 812 samples/s"):]


def test_quiet_when_not_a_terminal() -> None:
    console, out = _console(terminal=False)
    with Progress(total=2, label="bench", console=console) as progress:
        progress.start("run a")
        progress.advance(2)
    assert out.getvalue() == "" and progress.done == 2


def test_enabled_overrides_the_terminal_check() -> None:
    console, out = _console(terminal=True)
    with Progress(total=1, label="bench", console=console, enabled=False) as progress:
        progress.start("x")
        progress.advance()
    assert out.getvalue() == ""


def test_negative_total_is_refused() -> None:
    with pytest.raises(ValueError, match="total must be >= 0"):
        Progress(total=-1, label="x")
