"""Progress of a long CLI operation: a bar in a terminal, plain lines otherwise.

In a terminal an operator wants to see it move; in a log (cron, CI, `kubectl logs`)
a redrawn bar is noise, so there a line is printed at every tenth of the way.

    with Progress("reconcile", total=len(queues)) as progress:
        for queue in queues:
            ...
            progress.advance()
            progress.note(f"re-created {queue}")   # a line that stays, in both modes
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

_PLAIN_STEPS = 10


class Progress:
    def __init__(
        self,
        description: str,
        total: int,
        *,
        file: TextIO | None = None,
        interactive: bool | None = None,
    ) -> None:
        self.description = description
        self.total = max(total, 0)
        self.done = 0
        self._file = file or sys.stdout
        self.interactive = self._file.isatty() if interactive is None else interactive
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._last_step = -1

    def __enter__(self) -> Progress:
        if self.interactive:
            console = Console(file=self._file, force_terminal=True)
            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        else:
            self._line(f"{self.description}: 0/{self.total}")
            self._last_step = 0
        return self

    def advance(self, step: int = 1) -> None:
        self.done += step
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done)
            return
        # One line per tenth of the way (every item when there are fewer than ten).
        current = self.done * _PLAIN_STEPS // self.total if self.total else _PLAIN_STEPS
        if current > self._last_step or self.done == self.total:
            self._last_step = current
            percent = 100 * self.done // self.total if self.total else 100
            self._line(f"{self.description}: {self.done}/{self.total} ({percent}%)")

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            self._line(message)

    def _line(self, text: str) -> None:
        self._file.write(text + "\n")
        self._file.flush()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()


class Phases:
    """Progress for job runs, which report `(phase, done, total)`: one Progress per phase.

    The previous phase is closed when the next one starts, since a terminal shows one
    live bar at a time.
    """

    def __init__(self, *, file: TextIO | None = None, interactive: bool | None = None) -> None:
        self._file = file
        self._interactive = interactive
        self._current: Progress | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self._current is None or self._current.description != phase:
            self.close()
            self._current = Progress(
                phase, total, file=self._file, interactive=self._interactive
            ).__enter__()
        self._current.advance(done - self._current.done)

    def close(self) -> None:
        if self._current is not None:
            self._current.__exit__(None, None, None)
            self._current = None

    def __enter__(self) -> Phases:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
