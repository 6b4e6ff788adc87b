"""Progress on stderr for long steps: a live line on a terminal, one line per step otherwise."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.timings: dict[str, float] = {}   # step -> seconds, shown or not (`engc build --json` reports them)

    @contextmanager
    def step(self, what: str):
        started = time.monotonic()
        self._line(f"{what} ...", final=False)
        yield
        self.timings[what] = round(time.monotonic() - started, 2)
        self._line(f"{what}: done in {self.timings[what]:.1f}s", final=True)

    def bar(self, what: str, total: int, unit: str = "", eta: bool = False) -> "Bar":
        return Bar(self, what, total, unit, eta)

    def _line(self, text: str, final: bool):
        if not self.enabled:
            return
        if self.live:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        elif final:
            self.stream.write(text + "\n")
        self.stream.flush()


class Bar:
    """A count towards a total. With eta, the live line also says how long the rest should take at the
    rate so far, and the final line how long it all took; a note (advance) follows the count."""

    def __init__(self, progress: Progress, what: str, total: int, unit: str = "", eta: bool = False):
        self.p, self.what, self.total, self.done = progress, what, max(total, 1), 0
        self.unit, self.eta, self.note = unit, eta, ""
        self.started = time.monotonic()

    def advance(self, n: int = 1, note: str | None = None):
        self.done += n
        if note is not None:
            self.note = note
        if self.p.live:
            width = 30
            fill = width * self.done // self.total
            left = self._seconds_left()
            self.p._line(f"{self.what} [{'#' * fill}{'.' * (width - fill)}] {self._count()}"
                         f"{'' if left is None else ', ETA ' + clock(left)}", final=False)

    def close(self):
        took = f" in {time.monotonic() - self.started:.1f}s" if self.eta else ""
        self.p._line(f"{self.what}: {self._count()}{took}", final=True)

    def _count(self) -> str:
        return f"{self.done}/{self.total}{self.unit}" + (f", {self.note}" if self.note else "")

    def _seconds_left(self) -> float | None:
        if not self.eta or not self.done:
            return None
        return (time.monotonic() - self.started) * max(self.total - self.done, 0) / self.done


def clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
