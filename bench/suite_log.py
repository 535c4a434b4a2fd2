"""pytest plugin for long runs that may hit a time limit: writes each test's result
as it comes in, so what ran, how long it took and why it failed survive a run that
is killed before pytest's own summary.

    python -m pytest -p suite_log ...        (bench/ on PYTHONPATH; files in $SUITE_LOG_DIR or .)

`suite_times.txt`: seconds since the start, the test's duration, phase, outcome, test id;
`suite_failures.txt`: the report of every failed phase.
"""

import os
import time

_start = time.monotonic()
_files = {}


def _file(name):
    if name not in _files:
        path = os.path.join(os.environ.get("SUITE_LOG_DIR", "."), name)
        _files[name] = open(path, "a", buffering=1)
    return _files[name]


def pytest_runtest_logreport(report):
    # Under pytest-xdist, workers and the controller both see the reports: the
    # controller alone writes.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or report.outcome != "passed":
        _file("suite_times.txt").write(f"{time.monotonic() - _start:7.1f} {report.duration:8.2f} "
                                       f"{report.when} {report.outcome} {report.nodeid}\n")
    if report.failed:
        _file("suite_failures.txt").write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
