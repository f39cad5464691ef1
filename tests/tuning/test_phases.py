"""Tuning time: a progress bar per phase of tuning, ending with the phase's seconds, which the report
also lists. Timings are fake (`FakeTimer`); the bars are tqdm's on stderr."""
import time

import torch
from test_tuner import FakeTimer, _model

from sparsecnn.tuning import Candidate, PhaseClock
from sparsecnn.tuning.phases import TickingTimer
from sparsecnn.tuning.sparsify import autotune_model

TOP_LEVEL_PHASES = ["reference pass", "model as given", "prefetch", "layers", "linears", "layouts", "model check"]


def test_a_bar_phase_counts_its_steps_and_ends_with_its_seconds(capsys):
    clock = PhaseClock(progress=True)
    with clock.bar("compiling", total=3, unit="layer") as bar:
        for _ in range(3):
            time.sleep(0.01)
            bar.update(1)
    err = capsys.readouterr().err
    assert clock.seconds["compiling"] >= 0.03
    assert "compiling: 100%" in err and "3/3" in err and f"{clock.seconds['compiling']:.1f} s" in err


def test_bars_stay_hidden_without_progress_but_the_phase_is_timed(capsys):
    clock = PhaseClock()
    with clock.bar("quiet", total=1) as bar:
        bar.update(1)
    assert "quiet" not in capsys.readouterr().err and "quiet" in clock.seconds


def test_a_ticking_timer_advances_its_bar_once_per_timing_and_passes_the_times_on(capsys):
    clock = PhaseClock(progress=True)  # a hidden bar counts nothing
    timer = FakeTimer(probe_ms={"a": 2.0}, measure_ms={"a": 3.0})
    with clock.bar("model check") as bar:
        ticking = TickingTimer(timer, bar)
        assert ticking.probe(Candidate("a"), lambda: None) == 2.0
        assert ticking.measure(Candidate("a"), lambda: None) == 3.0
        assert bar.n == 2
    assert timer.probed == ["a"] and timer.measured == ["a"]


def test_autotune_model_shows_a_bar_per_phase_and_reports_each_phases_time(tmp_path, capsys):
    model, x = _model(), torch.randn(2, 3, 12, 12)
    report = autotune_model(model, x, cache_dir=tmp_path, timer=FakeTimer(measure_ms={"im2col-cusparse": 0.5}),
                            progress=True)
    err = capsys.readouterr().err
    for phase in TOP_LEVEL_PHASES:
        assert f"{phase}:" in err and f"{phase} {report.phase_s[phase]:.1f} s" in report.format()
    assert "layers: 100%" in err and "2/2" in err  # one step per conv
    assert "model check: 4timing" in err  # tuned, all dense, then one switch per conv tuned sparse
    quiet = autotune_model(_model(), x, cache_dir=tmp_path, timer=FakeTimer(), progress=False)
    assert capsys.readouterr().err == "" and set(TOP_LEVEL_PHASES) <= set(quiet.phase_s)
