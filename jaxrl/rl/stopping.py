"""Stopping a run on a signal: at the next safe point, with a checkpoint when the grace allows.

SIGTERM (a cloud preemption notice: the platform kills the machine some seconds later) and
SIGINT (Ctrl-C) are handled alike; only the exit code differs (143, 130):

  - while the RL steps run (`deferred()`), the first signal asks for a stop at the next safe
    point: the end of the step being trained, or at once while the trainer waits for a batch.
    The loop finishes the batches the generator began from older weights (the lead; the
    checkpoint saves them, jaxrl/rl/in_flight.py); one begun from the newest weights (`sync`)
    is abandoned and drawn again on resume, with the same result. There the run writes a
    checkpoint at the last finished step if `preemption_grace_s` has time left, then unwinds
    as Ctrl-C does (threads, sandboxes, checkpointer closed);
  - no safe point within the grace period (a step or an evaluation that does not end): the stop
    goes on without a checkpoint, keeping the last one written;
  - outside the steps (start-up, SFT, the first evaluation) or with `preemption_grace_s=0`, the
    run stops at once, keeping the last checkpoint;
  - a second signal exits at once (`os._exit`).

Several processes agree on the stop step: at the end of every step each says whether it was
signalled (a gather through `Processes`, like the metrics), and any one's request stops them
all after the same step, each saving its part of the same checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from jaxrl.rl.loop import StopRequested

log = logging.getLogger("jaxrl")


class Terminated(KeyboardInterrupt):
    """SIGTERM: the run stops the way Ctrl-C stops it (exit 143)."""


class Stopping:
    def __init__(self, grace_s: float, processes=None):
        self.grace_s = grace_s
        multi = processes is not None and processes.multi  # any process's request stops all
        self.agree = (lambda mine: any(processes.gather(mine))) if multi else None
        self.signum: int | None = None
        self._t0 = 0.0
        self._deferring = False
        self._overdue = False
        self._timer: threading.Timer | None = None

    def _stop(self, detail: str) -> KeyboardInterrupt:
        kind = Terminated if self.signum == signal.SIGTERM else KeyboardInterrupt
        return kind(detail)

    def _handle(self, signum, frame) -> None:
        if self._overdue:  # the watchdog: no safe point within the grace period
            self._overdue = False
            raise self._stop("no safe point within the grace period; the last checkpoint kept")
        if self.signum is not None:  # a second signal
            os._exit(128 + signum)
        self.signum, self._t0 = signum, time.monotonic()
        if not self._deferring or self.grace_s <= 0:
            raise self._stop("")
        log.warning("%s: stopping after this step with a checkpoint (preemption_grace_s=%gs); "
                    "a second signal exits at once", signal.Signals(signum).name, self.grace_s)
        self._timer = threading.Timer(self.grace_s, self._watchdog)
        self._timer.daemon = True
        self._timer.start()

    def _watchdog(self) -> None:
        if self._deferring:
            self._overdue = True  # a real signal: it also ends a blocking call (EINTR)
            signal.pthread_kill(threading.main_thread().ident, self.signum)

    def install(self) -> Callable[[], None]:
        """SIGTERM and SIGINT go to this object (main thread only); returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

        def undo() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

        return undo

    @contextlib.contextmanager
    def deferred(self, save: Callable[[int], None]):
        """Around the RL steps: a signal waits for the next safe point (`requested`), where
        `save(steps_done)` writes the checkpoint if the grace period has time left."""
        self._deferring = True
        try:
            yield self
        except StopRequested as stop:
            self.stop_here(stop.steps_done, save)
        finally:
            self._deferring = False
            if self._timer is not None:
                self._timer.cancel()

    def requested(self, waiting: bool = False) -> bool:
        """At a safe point: whether to stop here. Several processes agree (a collective) at the
        end of each step only; `waiting` (the trainer waiting for a batch, polled any number of
        times) is a safe point of a single process."""
        mine = self.signum is not None
        if self.agree is None:
            return mine
        return False if waiting else self.agree(mine)

    def stop_here(self, steps_done: int, save: Callable[[int], None]) -> None:
        """At the safe point after `steps_done` steps: checkpoint them if the grace period has
        time left, then raise the stop (Terminated or KeyboardInterrupt)."""
        self._deferring = False
        if self._timer is not None:
            self._timer.cancel()  # the save is bounded by the platform, not cut off by us
        if self.signum is None:  # another process was signalled
            self.signum = signal.SIGTERM
            self._t0 = time.monotonic()
        if self.grace_s > 0 and time.monotonic() - self._t0 < self.grace_s:
            save(steps_done)
            raise self._stop(f"checkpoint at step {steps_done} (the last finished step)")
        raise self._stop("the grace period was over; the last checkpoint kept")
