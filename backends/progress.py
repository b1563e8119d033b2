"""How far a long start-up step has got, for whoever is waiting on it.

On a terminal a step shows a tqdm bar; anywhere else (a container's log, a CI
job, a file) it writes a log line every few seconds saying what is being
loaded or built and how far it is, so a slow start is never silent. Steps
that finish before the first interval write nothing extra. Heartbeats nest:
while a step opened inside another runs (the model's compile inside the
backend's preparation), only the inner one writes, so one line at a time says
what start-up is doing.

``BATON_PROGRESS_INTERVAL`` (seconds, default 5) sets the interval.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("baton.progress")

DEFAULT_INTERVAL = 5.0

# The heartbeats open on each thread, innermost last: only the innermost of a
# thread writes its lines.
_open_lock = threading.Lock()
_open: dict[int, list[object]] = {}


def interval_seconds() -> float:
    try:
        return max(0.1, float(os.environ.get("BATON_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def on_terminal() -> bool:
    stream = sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 2**20:,.0f} MiB"
    return f"{value:,.0f}{' ' + unit if unit else ''}"


class Progress:
    """Counts the units of one step (tensors, bytes, layers) towards ``total``.

    ``enabled`` False makes every call a no-op (tests, library use). Use as a
    context manager, or call ``close()``; neither raises.
    """

    def __init__(self, what: str, total: float | None = None, unit: str = "",
                 enabled: bool = True, interval: float | None = None) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.enabled = enabled
        self.done = 0.0
        self.interval = interval_seconds() if interval is None else interval
        self._start = self._last = time.monotonic()
        self._bar = None
        if enabled and on_terminal():
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=what, unit=unit or "it", unit_scale=unit == "B",
                             unit_divisor=1024, leave=False, file=sys.stderr)

    def update(self, n: float = 1) -> None:
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            log.info("%s: %s, %.0fs", self.what, self.describe(), now - self._start)

    def describe(self) -> str:
        """'120 of 272 tensors (44%)', or '340 MiB' when the total is unknown."""
        if not self.total:
            return _amount(self.done, self.unit)
        return (f"{_amount(self.done, self.unit)} of {_amount(self.total, self.unit)} "
                f"({100 * self.done / self.total:.0f}%)")

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elapsed = time.monotonic() - self._start
        if elapsed >= self.interval:  # lines were written: say it is over
            log.info("%s: done, %s in %.1fs", self.what, _amount(self.done, self.unit), elapsed)
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def heartbeat(what: str, status: Callable[[], str] | None = None, enabled: bool = True,
              interval: float | None = None, done_line: bool = True) -> Iterator[None]:
    """While the body runs, log '<what>: <status()>, <seconds>s' every
    interval, for steps that cannot count their own progress (a compiler
    run, a download by another library), unless a heartbeat opened later on
    the same thread is running: then that one speaks. Logs nothing for a
    short body. Once it has written a line it ends with '<what>: done in
    <seconds>s', unless ``done_line`` is False (the caller logs its own
    result line)."""
    if not enabled:
        yield
        return
    every = interval_seconds() if interval is None else interval
    stop = threading.Event()
    start = time.monotonic()
    owner, token = threading.get_ident(), object()
    with _open_lock:
        _open.setdefault(owner, []).append(token)
    beats = 0

    def innermost() -> bool:
        with _open_lock:
            return _open[owner][-1] is token

    def beat() -> None:
        nonlocal beats
        while not stop.wait(every):
            if not innermost():
                continue
            beats += 1
            detail = ""
            if status is not None:
                try:
                    detail = status()
                except Exception as exc:  # noqa: BLE001 - a status probe never kills the step
                    detail = f"status unavailable ({type(exc).__name__})"
            log.info("%s: %s%.0fs", what, f"{detail}, " if detail else "still working, ",
                     time.monotonic() - start)

    thread = threading.Thread(target=beat, name="baton-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with _open_lock:
            _open[owner].remove(token)
            if not _open[owner]:
                del _open[owner]
        if done_line and beats:
            log.info("%s: done in %.1fs", what, time.monotonic() - start)
