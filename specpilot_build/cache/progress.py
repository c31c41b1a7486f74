"""Progress of long transfers (push, pull, bundle): bytes done, rate and what is left, on stderr.

A transfer reports to a Meter: `start` with the bytes it will move, `advance` after each object is sent or
checked, `finish` at the end. The base Meter reports nothing; `meter_for` gives a rich progress bar on stderr
when stderr is a terminal (or when asked, `--progress`), else the silent one."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class Meter:
    """Reports nothing; the interface a transfer reports to (tests subclass it to act mid-transfer)."""

    def start(self, what: str, total_bytes: int) -> None:
        """A transfer of `total_bytes` bytes of content begins."""

    def advance(self, digest: str, nbytes: int) -> None:
        """The object `digest` (`nbytes` bytes of content) was sent, or received and checked."""

    def finish(self) -> None:
        """The transfer ended (done or failed)."""

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.finish()


class BarMeter(Meter):
    """A rich bar per transfer on stderr: what, bytes done of the total, rate, time left."""

    def __init__(self, force: bool = False) -> None:
        self.force = force
        self._progress: Any = None  # a rich Progress while a transfer runs
        self._task: Any = None

    def start(self, what: str, total_bytes: int) -> None:
        if self._progress is None:
            from rich.console import Console  # rich takes ~0.4 s to import: only when a bar is shown
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True, force_terminal=self.force or None),
            )
            self._progress.start()
        elif self._task is not None:
            self._progress.stop_task(self._task)
        self._task = self._progress.add_task(what, total=total_bytes)

    def advance(self, digest: str, nbytes: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, nbytes)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = self._task = None


def meter_for(asked: bool | None = None) -> Meter:
    """A bar when `asked` (True), none when refused (False); by default a bar only when stderr is a terminal."""
    if asked is False or (asked is None and not sys.stderr.isatty()):
        return Meter()
    return BarMeter(force=bool(asked))
