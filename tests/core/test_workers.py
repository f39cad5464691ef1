"""Worker processes (core/workers.py): a script without an `if __name__ == "__main__":` guard that
hands jobs to workers runs its body once, and the jobs' results come back; pools sharing one process
pool (`SharedProcessPool`, with a stand-in executor)."""
import logging
import math
import subprocess
import sys
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest

from helpers.common import SRC
from sparsecnn.core.workers import NOTHING, SharedProcessPool, WorkerPool

SCRIPT = """
import logging
import math
import sys

sys.path.insert(0, {src!r})
from sparsecnn.core.workers import WorkerPool

print("body ran", flush=True)
pool = WorkerPool("test jobs", lambda: 2, logging.getLogger("test"))
for n in (5, 6):
    pool.submit(n, math.factorial, n)
print("results", pool.take(5), pool.take(6), flush=True)
pool.shutdown()
"""


def _run(tmp_path, *args):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.format(src=SRC))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_an_unguarded_script_runs_its_body_once_and_gets_the_workers_results(tmp_path):
    result = _run(tmp_path, "unguarded.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("body ran") == 1, result.stdout + result.stderr
    assert "results 120 720" in result.stdout and "in-process" not in result.stderr


@pytest.mark.slow
def test_an_unguarded_module_run_with_dash_m_runs_its_body_once(tmp_path):
    result = _run(tmp_path, "-m", "unguarded")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("body ran") == 1 and "results 120 720" in result.stdout


class _RecordingExecutor:
    """A process pool stand-in: runs jobs at submission, records them in order and its shutdown."""

    def __init__(self, workers, log):
        self.workers, self.log, self.shut = workers, log, False

    def submit(self, fn, *args):
        self.log.append(args[-1])
        future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        self.shut = True


def _shared(workers=3):
    started, log = [], []

    def new_executor(count):
        started.append(_RecordingExecutor(count, log))
        return started[-1]

    shared = SharedProcessPool(lambda: workers, new_executor)
    pools = [WorkerPool(what, lambda: 1, logging.getLogger("test"), shared) for what in ("a compile", "b compile")]
    return shared, pools, started, log


def test_pools_sharing_a_process_pool_queue_their_jobs_in_one_line():
    shared, (first, second), started, log = _shared(workers=3)
    first.submit("a5", math.factorial, 5)
    second.submit("b3", math.factorial, 3)
    first.submit("a4", math.factorial, 4)
    assert len(started) == 1 and started[0].workers == 3  # the shared count, not a pool's own (1)
    assert log == [5, 3, 4]  # submission order across the pools
    assert (first.take("a5"), second.take("b3"), first.take("a4")) == (120, 6, 24)
    assert first.times.jobs == 2 and second.times.jobs == 1  # each pool reports its own jobs


def test_a_shared_process_pool_stops_when_its_last_holder_shuts_down():
    shared, (first, second), started, _ = _shared()
    first.submit(1, math.factorial, 1)
    second.submit(2, math.factorial, 2)
    first.shutdown()
    assert not started[0].shut and second.take(2) == 2
    second.shutdown()
    assert started[0].shut and shared.executor is None
    first.submit(3, math.factorial, 3)  # a later job starts a new one
    assert len(started) == 2 and first.take(3) == 6


def test_a_broken_shared_process_pool_fails_every_holder_over_to_in_process(caplog):
    shared, (first, second), started, _ = _shared()
    first.submit(1, abs, -1)
    second.submit(2, abs, -2)

    def broken(*args):
        raise BrokenProcessPool("a worker died")

    started[0].submit = broken
    with caplog.at_level(logging.WARNING, logger="test"):
        first.submit(3, abs, -3)
        second.submit(4, abs, -4)
    assert first.failed and second.failed and started[0].shut and shared.executor is None
    assert first.take(1) is NOTHING and second.take(4) is NOTHING  # the callers do the work themselves
    assert caplog.text.count("doing it in-process") == 2
