"""Progress of long transfers (push, pull, bundle): bytes done, rate and what is left, on stderr.

A transfer reports to a Meter: `start` with the bytes of content it will move, `moved` as a large write or read
goes (a pack's share of content for the bytes on the wire so far), `advance` after each object is sent or
checked (counting only what `moved` had not already counted), `finish` at the end. The base Meter reports
nothing; `meter_for` gives a rich progress bar on stderr when stderr is a terminal (or when asked, `--progress`),
else the silent one."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any


class Meter:
    """Reports nothing; the interface a transfer reports to (tests subclass it to act mid-transfer)."""

    def start(self, what: str, total_bytes: int) -> None:
        """A transfer of `total_bytes` bytes of content begins."""

    def moved(self, nbytes: int) -> None:
        """`nbytes` more bytes of content are on their way (in a pack being written or read); the `advance` of
        the objects they belong to follows."""

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
        self._ahead = 0  # bytes `moved` counted that no `advance` has yet

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
        self._progress.advance(self._task, 0)  # the rate counts from here (rich leaves out its first sample)
        self._ahead = 0

    def moved(self, nbytes: int) -> None:
        if self._task is not None:
            self._ahead += nbytes
            self._progress.advance(self._task, nbytes)

    def advance(self, digest: str, nbytes: int) -> None:
        counted = min(self._ahead, nbytes)
        self._ahead -= counted
        if self._task is not None and nbytes > counted:
            self._progress.advance(self._task, nbytes - counted)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = self._task = None


def share(meter: Meter, content: int, wire: int) -> Callable[[int], None]:
    """A callback told of bytes on the wire (of `wire` in all) that tells `meter` of the content they carry
    (`content` in all), in proportion: a pack's bytes are compressed, the bar counts content."""
    done = [0, 0]  # wire bytes so far, content bytes reported so far

    def step(nbytes: int) -> None:
        done[0] += nbytes
        now = content * min(done[0], wire) // max(wire, 1)
        if now > done[1]:
            meter.moved(now - done[1])
            done[1] = now

    return step


def meter_for(asked: bool | None = None) -> Meter:
    """A bar when `asked` (True), none when refused (False); by default a bar only when stderr is a terminal."""
    if asked is False or (asked is None and not sys.stderr.isatty()):
        return Meter()
    return BarMeter(force=bool(asked))
