"""Progress bars (rich) that can be switched off for tests and notebooks."""

from __future__ import annotations

from contextlib import contextmanager

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


@contextmanager
def progress_bar(enabled: bool = True):
    """A rich `Progress` (or a silent stand-in) for long loops over modules, tasks and matrices."""
    if not enabled:
        yield _Silent()
        return
    columns = (SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns) as progress:
        yield progress
