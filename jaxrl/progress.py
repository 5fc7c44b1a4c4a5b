"""One progress display for every phase of a run: SFT steps, evaluation samples, RL steps.

    bar = Progress("SFT", total=100, unit="step")
    bar.update(10, step=10, loss=1.23)        # "SFT 10/100 | step 10 | loss 1.23 | ETA 45s"
    bar.close()

On a terminal it is a tqdm bar (tqdm comes with huggingface_hub, which `tokenizers` needs); in a
log file or pipe, one plain line per update (at most one per `min_interval` seconds, and always
the last). The ETA leaves out compilation: it starts counting at the phase's first update (the
first step includes the jit compile) and is "-" until a second update gives a rate.

With `announce=True` a plain log gets a line when the phase starts, so a phase that compiles
first is not silent. `set_enabled(False)` (the launcher's `--quiet`) silences every display.
"""

from __future__ import annotations

import sys
import time
from typing import Any

_ENABLED = [True]


def set_enabled(on: bool) -> None:
    _ENABLED[0] = bool(on)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    def __init__(self, label: str, total: int, *, unit: str = "step", initial: int = 0,
                 stream=None, enabled: bool = True, min_interval: float = 0.0,
                 announce: bool = False):
        self.label, self.total, self.unit = label, int(total), unit
        self.done = int(initial)
        self.stream = stream or sys.stderr
        self.enabled = enabled and _ENABLED[0]
        self.min_interval = min_interval
        self._base: tuple[float, int] | None = None  # (time, done) at the first update
        self._printed = -float("inf")
        self._bar = None
        if self.enabled and _isatty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=self.done, desc=label, unit=unit,
                             file=self.stream, bar_format="{desc} {n_fmt}/{total_fmt} "
                             "|{bar:20}| {postfix}", dynamic_ncols=True, leave=True)
        elif self.enabled and announce:  # a plain log says at once that the phase started
            print(f"{label} {self.done}/{self.total} | started (the first {unit} includes "
                  "compilation)", file=self.stream, flush=True)

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the rate since the first update (None before there is a rate)."""
        if self._base is None:
            return None
        t0, d0 = self._base
        if self.done <= d0:
            return None
        now = time.perf_counter() if now is None else now
        return (now - t0) / (self.done - d0) * max(self.total - self.done, 0)

    def text(self, fields: dict[str, Any]) -> str:
        """What the display shows after the counts: the fields, then the ETA."""
        parts = [f"{k} {_fmt(v)}" for k, v in fields.items()]
        eta = self.eta()
        parts.append("ETA " + ("-" if eta is None else _duration(eta)))
        return " | ".join(parts)

    def update(self, n: int = 1, **fields: Any) -> str:
        """`n` more units done; `fields` (e.g. step=4, loss=0.5) are shown with the ETA."""
        now = time.perf_counter()
        self.done += n
        if self._base is None:
            self._base = (now, self.done)
        text = self.text(fields)
        if not self.enabled:
            return text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(n)
        elif now - self._printed >= self.min_interval or self.done >= self.total:
            self._printed = now
            print(f"{self.label} {self.done}/{self.total} | {text}", file=self.stream,
                  flush=True)
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
