"""Progress bars (rich) that can be switched off for tests and notebooks; in a redirected log, timestamped lines."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich import get_console
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _Silent:
    def add_task(self, *args, **kwargs):
        return 0

    def advance(self, *args, **kwargs):
        pass

    def update(self, *args, **kwargs):
        pass

    def remove_task(self, *args, **kwargs):
        pass


class LoggedProgress:
    """`Progress`'s calls for a console that is not a terminal (output redirected to a file, where a live bar shows
    nothing until it ends): one timestamped line when a task starts, when its description changes (compare's
    "subset · seed · method · candidate"), every `interval` seconds while it advances, and when it completes; while
    a task with a total is under way, the line ends with the time left at its mean rate so far."""

    def __init__(self, console: Console, interval: float = 60.0):
        self.console, self.interval, self.tasks = console, interval, {}

    def add_task(self, description: str, start: bool = True, total: float | None = 100.0, completed: float = 0,
                 **fields) -> int:
        task_id = len(self.tasks)
        now = time.monotonic()
        self.tasks[task_id] = {"description": description, "total": total, "completed": completed, "start": now}
        self._line(task_id)
        return task_id

    def update(self, task_id: int, *, total: float | None = None, completed: float | None = None,
               advance: float | None = None, description: str | None = None, **fields) -> None:
        task = self.tasks.get(task_id)
        if task is None:
            return
        done_before = task["total"] is not None and task["completed"] >= task["total"]
        task["total"] = task["total"] if total is None else total
        task["completed"] = completed if completed is not None else task["completed"] + (advance or 0)
        done = task["total"] is not None and task["completed"] >= task["total"]
        renamed = description is not None and description != task["description"]
        task["description"] = description if description is not None else task["description"]
        if renamed or (done and not done_before) or time.monotonic() - task["printed"] >= self.interval:
            self._line(task_id)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def remove_task(self, task_id: int) -> None:
        self.tasks.pop(task_id, None)

    def _line(self, task_id: int) -> None:
        task = self.tasks[task_id]
        task["printed"] = time.monotonic()
        total = "" if task["total"] is None else f"/{task['total']:g}"
        elapsed = task["printed"] - task["start"]
        left = ""
        if task["total"] is not None and 0 < task["completed"] < task["total"]:  # at the mean rate so far
            left = f" · about {_duration(elapsed * (task['total'] - task['completed']) / task['completed'])} left"
        self.console.print(f"{time.strftime('%H:%M:%S')} {task['description']} · {task['completed']:g}{total} · "
                           f"{elapsed:.0f} s{left}", highlight=False, markup=False, soft_wrap=True)


def _duration(seconds: float) -> str:
    """A time left, as a log line says it: seconds under 2 minutes, minutes under 2 hours, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@contextmanager
def progress_bar(enabled: bool = True):
    """A rich `Progress` (or a silent stand-in) for long loops over modules, tasks and matrices; when the console
    is neither a terminal nor a notebook (a redirected log), `LoggedProgress`'s timestamped lines instead."""
    if not enabled:
        yield _Silent()
        return
    console = get_console()
    if not console.is_terminal and not console.is_jupyter:
        yield LoggedProgress(console)
        return
    columns = (SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns) as progress:
        yield progress
