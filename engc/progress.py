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

    @contextmanager
    def step(self, what: str):
        started = time.monotonic()
        self._line(f"{what} ...", final=False)
        yield
        self._line(f"{what}: done in {time.monotonic() - started:.1f}s", final=True)

    def bar(self, what: str, total: int) -> "Bar":
        return Bar(self, what, total)

    def _line(self, text: str, final: bool):
        if not self.enabled:
            return
        if self.live:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        elif final:
            self.stream.write(text + "\n")
        self.stream.flush()


class Bar:
    def __init__(self, progress: Progress, what: str, total: int):
        self.p, self.what, self.total, self.done = progress, what, max(total, 1), 0

    def advance(self, n: int = 1):
        self.done += n
        if self.p.live:
            width = 30
            fill = width * self.done // self.total
            self.p._line(f"{self.what} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}",
                         final=False)

    def close(self):
        self.p._line(f"{self.what}: {self.done}/{self.total}", final=True)
