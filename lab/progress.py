"""Progress of long jobs made of runs (`murmur bench`, `python -m lab.simulation.cli`): a rich progress bar.

    with Progress(total=len(runs), label="bench") as progress:
        for run in runs:
            progress.start(run.name)   # the run now in progress
            ...
            progress.advance()         # one more run done

It shows runs done of total, the current run, elapsed and estimated remaining time. It
is quiet when its console is not a terminal (output piped to a file or a CI log): the
job's own result lines are then the whole output. Lines printed while the bar is shown
appear above it.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    """A bar over `total` runs, labelled `label`; a context manager. Does nothing when not on a terminal.

    `console` defaults to standard output; `enabled` overrides the terminal check.
    """

    def __init__(self, total: int, label: str, *, console: Console | None = None, enabled: bool | None = None) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.done = 0
        self.current = ""
        console = console or Console()
        self.enabled = console.is_terminal if enabled is None else enabled
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
            TextColumn("{task.fields[current]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=console, transient=False, disable=not self.enabled,
        )  # fmt: skip
        self._task = self._bar.add_task(label, total=total, current="")

    def __enter__(self) -> Progress:
        self._bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._bar.stop()

    def start(self, name: str) -> None:
        """Show `name` as the run now in progress."""
        self.current = name
        self._bar.update(self._task, current=name)

    def advance(self, runs: int = 1) -> None:
        """Count `runs` more runs as done (the current one, usually)."""
        self.done += runs
        self._bar.update(self._task, advance=runs, current="" if self.done >= self.total else self.current)
