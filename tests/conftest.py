"""Fixtures every test gets: a throwaway tuning cache and blocks cache, a seeded RNG, no blocks left
provided to backend `blocks` by an earlier test, the `gpu` marker's skip without a GPU, and the `requires` marker (`helpers.common.needs`: skipped locally, failed in CI
when the machine lacks a tool, package or data set). The summary counts the skips by kind; with
CI=true a skip that is neither GPU-only nor of an optional extra fails the run. Helpers shared by
test files live in `helpers/`."""
import os
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.common import GPU_SKIP, IN_CI, OPTIONAL_PREFIX, missing, require
from helpers.subprocess_site.interpreter_speedups import apply as apply_interpreter_speedups

from sparsecnn.backends.blocks import extraction as block_extraction

# Autotune decisions of test runs go to throwaway directories, never the user's cache: one per process
# (what module and session fixtures tune), and a fresh one per test (`_own_tuning_cache`), so no test
# reads what another one tuned, whatever the order. Set here, not inherited: xdist's workers start
# with the environment of the controller, which imported this file first.
_CACHE_ROOT = tempfile.mkdtemp(prefix="sparsecnn-test-cache-")
os.environ["SPARSECNN_CACHE_DIR"] = _CACHE_ROOT

# xdist: one worker per core, so each worker computes on its share of the cores (its subprocesses
# too, through OMP_NUM_THREADS). PyTorch's default, a thread per core in every worker, runs a CPU
# suite several times slower there.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

apply_interpreter_speedups()  # under TRITON_INTERPRET=1 only

_SKIPS = {"gpu": [], "optional": [], "other": []}  # (test id, reason) of each skip, by kind


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*names): needs these tools, packages or data sets "
                                       "(helpers.common.REQUIREMENTS); skipped without them, failed in CI")


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    _mark_unsampled_slow(items)
    gpu_skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if gpu_skip is not None and "gpu" in item.keywords:
            item.add_marker(gpu_skip)  # first: a GPU test without a GPU is skipped as such
        for marker in item.iter_markers("requires"):
            verdict = missing(*marker.args)
            if verdict is not None and verdict[0] == "skip":
                item.add_marker(pytest.mark.skip(reason=verdict[1]))


def _mark_unsampled_slow(items):
    """`@pytest.mark.quick_sample(every)` on a parametrized test: all but every `every`-th of its
    cases (by test id, so the same on every xdist worker whatever the order) are marked `slow`."""
    groups = {}
    for item in items:
        marker = item.get_closest_marker("quick_sample")
        if marker is not None:
            groups.setdefault((item.path, item.originalname), (marker.args[0], []))[1].append(item)
    for every, group in groups.values():
        for index, item in enumerate(sorted(group, key=lambda item: item.nodeid)):
            if index % every:
                item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    # After the skipping plugin's setup (tryfirst): only tests not skipped get here, to fail in CI.
    for marker in item.iter_markers("requires"):
        require(*marker.args)


def _record_skip(report):
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    kind = "gpu" if GPU_SKIP in reason else "optional" if reason.startswith(OPTIONAL_PREFIX) else "other"
    _SKIPS[kind].append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if IN_CI and _SKIPS["other"] and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    counts = {kind: len(skips) for kind, skips in _SKIPS.items()}
    terminalreporter.write_line(f"skips: {counts['gpu']} GPU-only, {counts['optional']} optional extras, "
                                f"{counts['other']} other{' (CI=true)' if IN_CI else ''}")
    if IN_CI and counts["other"]:
        terminalreporter.write_line(f"FAILED: CI=true allows only GPU-only and optional skips; {counts['other']} "
                                    "others:", red=True, bold=True)
        for nodeid, reason in _SKIPS["other"]:
            terminalreporter.write_line(f"  {nodeid}: {reason}", red=True)


@pytest.fixture(autouse=True)
def _own_tuning_cache(monkeypatch):
    monkeypatch.setenv("SPARSECNN_CACHE_DIR", tempfile.mkdtemp(dir=_CACHE_ROOT))
    blocks_dir = Path(tempfile.mkdtemp(dir=_CACHE_ROOT))  # blocks found by Algorithm 1, kept on disk
    monkeypatch.setattr(block_extraction, "disk_cache_dir", lambda: blocks_dir)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _forget_provided_blocks():
    """Blocks a re-pruning handed to backend `blocks` stay with the test that made them."""
    yield
    from sparsecnn.backends.blocks.extraction import clear_provided_blocks

    clear_provided_blocks()


@pytest.fixture
def generated_backends_ready(monkeypatch):
    """The generated backends' machine checks pass (their compilers and kernel loader count as
    present): for tests of what the tuner offers, not of what this machine has."""
    from sparsecnn.core import cubin_loader, toolchain

    monkeypatch.setattr(toolchain, "missing_tools", lambda *names: None)
    monkeypatch.setattr(cubin_loader, "missing_loader", lambda: None)
