"""pytest plugin: under `--dist loadgroup`, each process holds one test or group
beside the one it runs, not two: long tests then do not wait behind each other on
one process while others idle at the end of a run.

    python -m pytest -p suite_schedule -n 15 --dist loadgroup ...   (bench/ on PYTHONPATH)

pytest-xdist's group scheduler hands a process more work while at most two of its
tests are pending; a process needs two (the one it runs and the next) to keep
running.
"""

import pytest
from xdist.scheduler import LoadGroupScheduling


class OneAheadScheduling(LoadGroupScheduling):
    def _reschedule(self, node):
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return OneAheadScheduling(config, log)
    return None
