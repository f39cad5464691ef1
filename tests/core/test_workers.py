"""Worker processes (core/workers.py): a script without an `if __name__ == "__main__":` guard that
hands jobs to workers runs its body once, and the jobs' results come back."""
import subprocess
import sys

import pytest

from helpers.common import SRC

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
