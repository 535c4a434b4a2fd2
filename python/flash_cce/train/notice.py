"""One line when a run's first piece of work is slow.

MLX compiles many of its kernels the first time a machine runs them (on CUDA
through NVRTC: a model's first training step can take minutes) and keeps them
in a cache, so later processes start in seconds. A user who sees nothing for
minutes cannot tell that from a hang; this says what may be happening.
"""

import threading
import time

AFTER_SECONDS = 5.0


class SlowStart:
    """Between `start()` and `stop()` (or as a context manager): if the work is
    still running after `after` seconds (default `AFTER_SECONDS`), logs one line
    saying so from a timer thread, and at `stop()` one line with its time (not
    when it ends by an exception: it did not finish). `log` None: says nothing.
    The two lines come in that order or not at all; a failing `log` is ignored
    (a notice never stops a run)."""

    def __init__(self, what, log, after=None):
        self.what, self.log = what, log
        self.after = AFTER_SECONDS if after is None else after
        self.timer, self.said, self.tic = None, False, 0.0
        self.lock = threading.Lock()

    def start(self):
        if self.log is not None and self.timer is None:
            self.said = False
            self.timer = threading.Timer(self.after, self._say)
            self.timer.args = (self.timer,)
            self.timer.daemon = True
            self.tic = time.perf_counter()
            self.timer.start()
        return self

    def stop(self, report=True):
        with self.lock:
            if self.timer is None:
                return
            self.timer.cancel()
            self.timer = None
            if self.said and report:
                self._log(f"{self.what} took {time.perf_counter() - self.tic:.1f} s")

    def _say(self, timer):
        with self.lock:
            if self.timer is not timer:  # stopped while this thread waited for the lock
                return
            self.said = True
            self._log(f"{self.what} is still running after {self.after:g} s: this may be MLX compiling its "
                      "kernels, which it does the first time a machine runs them (it can take minutes) and "
                      "caches for later runs")

    def _log(self, line):
        try:
            self.log(line)
        except Exception:  # noqa: BLE001 - a notice never stops a run
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, kind, *exc):
        self.stop(report=kind is None)
