"""benchmarks/stack_sampler.py: every thread's wall time, attributed to the frames it was in."""
import threading
import time

import pytest
from helpers.scripts import script_module

stack_sampler = script_module("stack_sampler")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sleep_in_a_thread(seconds: float) -> None:
    time.sleep(seconds)


def test_wall_time_goes_to_the_frames_each_thread_was_in():
    with stack_sampler.StackSampler(interval_s=0.002) as sampler:
        helper = threading.Thread(target=_sleep_in_a_thread, args=(0.4,), name="Helper-7")
        helper.start()
        _spin(0.3)
        helper.join()
    groups = sampler.groups()
    assert set(groups) >= {"MainThread", "Helper-_"}  # digits folded, the sampler itself left out
    assert "stack-sampler" not in groups
    assert 0.3 <= groups["MainThread"] <= 3 and 0.3 <= groups["Helper-_"] <= 3  # wall seconds, on a busy CI too
    main = sampler.inclusive("MainThread")
    spin = next(seconds for frame, seconds in main.items() if frame.endswith(":_spin"))
    assert spin >= 0.2  # of the 0.3 s spinning
    helper_at = sampler.innermost("Helper-_")
    sleeping = sum(s for frame, s in helper_at.items() if frame.endswith(":_sleep_in_a_thread"))
    assert sleeping >= 0.25  # time.sleep is C: the innermost Python frame is the caller
    report = sampler.report(top=5)
    assert report.startswith("== ") and "-- inclusive" in report and "-- innermost" in report
    assert "innermost sparsecnn frame <- innermost frame" in report and "_spin" in report


def test_frames_are_named_from_the_package_root():
    import sparsecnn.settings as settings

    code = settings.describe.__code__
    frame = type("F", (), {"f_code": code})()
    assert stack_sampler.frame_name(frame) == "sparsecnn/settings.py:describe"


def test_a_sampling_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        stack_sampler.StackSampler(interval_s=0)
