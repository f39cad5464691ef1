"""tests/conftest.py itself, run on a small suite of its own in a fresh pytest process: the summary
counts skips by kind, and with CI=true an "other" skip (at run time or at collection) fails the run,
serially and under xdist (whose workers' reports reach the controller's hooks); each xdist worker
tunes into a cache directory of its own."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_SUITE = '''
import os
from pathlib import Path

import pytest
from helpers.common import GPU_SKIP, OPTIONAL_PREFIX


@pytest.mark.parametrize("i", range(4))
def test_passes(i):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(os.environ["INNER_NOTES"]) / f"{i}").write_text(f"{worker} {os.environ['SPARSECNN_CACHE_DIR']}")


@pytest.mark.gpu
def test_on_the_gpu():
    pass


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("i", range(4))
def test_sampled(i):
    pass


def test_optional():
    pytest.skip(OPTIONAL_PREFIX + "needs a package CI does not install")


def test_other():
    if os.environ.get("INNER_OTHER"):
        pytest.skip("a reason CI does not allow")
'''

_SKIPPED_MODULE = '''
import os

import pytest

if os.environ.get("INNER_OTHER"):
    pytest.skip("a module CI does not allow to skip", allow_module_level=True)


def test_in_the_module():
    pass
'''


def _run_suite(tmp_path, *options, other):
    suite = tmp_path / "suite"
    shutil.copytree(TESTS / "helpers", suite / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    slow: long\n"
                                      "    quick_sample(every): every every-th case is quick\n")
    (suite / "test_inner.py").write_text(_SUITE)
    (suite / "test_skipped_module.py").write_text(_SKIPPED_MODULE)
    notes = tmp_path / "notes"
    notes.mkdir()
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTEST_", "INNER_")) and name != "CI"}
    env.update(CI="true", INNER_NOTES=str(notes), CUDA_VISIBLE_DEVICES="")  # no GPU: the gpu test skips as such
    if other:
        env["INNER_OTHER"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *options],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    caches = {}
    for note in notes.iterdir():
        worker, cache = note.read_text().split(" ", 1)
        caches.setdefault(worker, set()).add(cache)
    return done, caches


@pytest.mark.slow
def test_ci_passes_with_gpu_and_optional_skips_only(tmp_path):
    done, caches = _run_suite(tmp_path, other=False)
    output = done.stdout + done.stderr
    assert "skips: 1 GPU-only, 1 optional extras, 0 other (CI=true)" in output, output
    assert done.returncode == pytest.ExitCode.OK, output
    assert len(set(caches["main"])) == 4  # a fresh tuning cache directory for each test


@pytest.mark.slow
def test_under_xdist_ci_fails_on_other_skips_and_workers_tune_apart(tmp_path):
    """Run-time and collection skips reach the controller from the workers (the collection one from
    both, counted once); each worker's tests tune under a cache directory of that worker's own."""
    done, caches = _run_suite(tmp_path, "-n", "2", other=True)
    output = done.stdout + done.stderr
    assert "skips: 1 GPU-only, 1 optional extras, 2 other (CI=true)" in output, output
    assert "test_inner.py::test_other: a reason CI does not allow" in output
    assert "test_skipped_module.py: a module CI does not allow to skip" in output
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert set(caches) == {"gw0", "gw1"}, caches  # both workers ran tests
    per_test = [cache for worker in caches.values() for cache in worker]
    assert len(set(per_test)) == len(per_test) == 4, caches
    roots = {worker: {str(Path(cache).parent) for cache in worker_caches} for worker, worker_caches in caches.items()}
    assert all(len(root) == 1 for root in roots.values()) and roots["gw0"] != roots["gw1"], roots


def test_quick_sample_leaves_every_nth_case_out_of_the_slow_ones(tmp_path):
    done, _ = _run_suite(tmp_path, "--co", "-q", "-m", "not slow", "-k", "sampled", other=False)
    kept = [line for line in done.stdout.splitlines() if "test_sampled" in line]
    assert kept == ["test_inner.py::test_sampled[0]", "test_inner.py::test_sampled[2]"], done.stdout + done.stderr
