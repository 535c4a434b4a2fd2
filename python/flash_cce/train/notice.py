"""One line when a run's first piece of work is slow.

MLX compiles many of its kernels the first time a machine runs them (on CUDA
through NVRTC: a model's first training step can take minutes) and keeps them
in a cache, so later processes start in seconds. A user who sees nothing for
minutes cannot tell that from a hang; this says what is happening.
"""

import threading
import time

AFTER_SECONDS = 5.0


class SlowStart:
    """Between `start()` and `stop()` (or as a context manager): if the work is
    still running after `after` seconds (default `AFTER_SECONDS`), logs one line
    saying so from a timer thread, and at `stop()` one line with its time.
    `log` None: says nothing."""

    def __init__(self, what, log, after=None):
        self.what, self.log = what, log
        self.after = AFTER_SECONDS if after is None else after
        self.timer, self.said, self.tic = None, threading.Event(), 0.0

    def start(self):
        if self.log is not None and self.timer is None:
            self.timer = threading.Timer(self.after, self._say)
            self.timer.daemon = True
            self.tic = time.perf_counter()
            self.timer.start()
        return self

    def stop(self):
        if self.timer is None:
            return
        self.timer.cancel()
        self.timer = None
        if self.said.is_set():
            self.log(f"{self.what} took {time.perf_counter() - self.tic:.1f} s")

    def _say(self):
        self.said.set()
        self.log(f"{self.what} is still running after {self.after:g} s: MLX compiles its kernels the first "
                 "time a machine runs them (this can take minutes) and caches them for later runs")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
