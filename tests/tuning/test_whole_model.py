"""`tuning.whole_model.fold_shortcuts`: a fold stays only where the whole model gets faster and its
output stays within twice the unfolded model's error; one that fails or errs is undone with a
warning, and a model kept as given is left alone. Timings are fake."""
import logging

import pytest
import torch
from helpers.blocks import block_inputs, block_model
from helpers.common import needs_interpreter

from sparsecnn.nn import shortcut as shortcut_fold
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.tuning.report import ModelCheck
from sparsecnn.tuning.whole_model import fold_shortcuts

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


class ConstantTimer:
    def __init__(self, ms):
        self.ms, self.timed = ms, []

    def measure(self, candidate, fn):
        self.timed.append(candidate.backend)
        fn()
        return self.ms

    def probe(self, candidate, fn):
        return self.measure(candidate, fn)


def _tensorcore_block():
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig

    x = block_inputs()
    gm = prepare_for_inference(block_model(), example_inputs=x)
    gm.get_submodule("0.conv2").set_backend("tensorcore", TensorCoreConfig(16, 16, 32, order="index"))
    with torch.no_grad():
        reference = gm(x)
    return gm, x, reference


def _check(kept="tuned"):
    return ModelCheck(tuned_ms=2.0, dense_ms=3.0, dense_backend="dense", kept=kept, final_ms=2.0)


def _error_of(reference):
    return lambda out: float((out - reference).norm() / reference.norm())


@needs_interpreter
@pytest.mark.parametrize("fold_ms, kept", [(1.0, True), (1.995, False)])
def test_a_fold_stays_only_where_the_model_gets_faster(fold_ms, kept):
    gm, x, reference = _tensorcore_block()
    with torch.no_grad():
        check = fold_shortcuts(gm, lambda: gm(x), ConstantTimer(fold_ms), _check(), _error_of(reference))
    assert (check.shortcuts == [["0.conv2", "0.downsample.0"]]) == kept
    assert check.final_ms == (fold_ms if kept else 2.0)
    assert (gm.get_submodule("0.conv2").shortcut is not None) == kept


@needs_interpreter
def test_a_fold_that_fails_or_errs_is_undone_and_said(monkeypatch, caplog):
    gm, x, reference = _tensorcore_block()

    def broken(layer, x, shortcut_input):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(shortcut_fold, "forward", broken)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        check = fold_shortcuts(gm, lambda: gm(x), ConstantTimer(1.0), _check(), _error_of(reference))
    assert check.shortcuts == [] and "failed, left as two convs: RuntimeError: no kernel" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    wrong = {"calls": 0}

    def drifting(out):  # the unfolded model matches, the folded one is off
        wrong["calls"] += 1
        return 0.0 if wrong["calls"] == 1 else 0.5

    with torch.no_grad(), caplog.at_level(logging.WARNING):
        check = fold_shortcuts(gm, lambda: gm(x), ConstantTimer(1.0), _check(), drifting)
    assert check.shortcuts == [] and "gave an error of 0.5" in caplog.text
    assert gm.get_submodule("0.conv2").shortcut is None
    with torch.no_grad():
        assert torch.allclose(gm(x), reference)


def test_a_model_kept_as_given_is_left_alone():
    gm, x = prepare_for_inference(block_model(), example_inputs=block_inputs()), block_inputs()
    timer = ConstantTimer(1.0)
    check = fold_shortcuts(gm, lambda: gm(x), timer, _check("given"), lambda out: 0.0)
    assert check.shortcuts == [] and timer.timed == []


def test_a_half_precision_model_is_tuned_on_channels_last_activations(monkeypatch):
    """While a bf16/fp16 model is tuned, an NCHW layer output goes on in channels_last, so the next
    layer is timed on the layout the model's half-precision kernels use (fp32: left as it is)."""
    from torch import nn

    from sparsecnn.tuning import sparsify as tuning_pass
    from sparsecnn.tuning.sparsify import autotune_model

    for dtype, expected in (("bf16", True), ("fp32", False)):
        seen = {}
        tune = tuning_pass._LayerTuning._tune

        def record(self, name, layer, x, residual, tune=tune, seen=seen):
            seen[name] = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            return tune(self, name, layer, x, residual)

        monkeypatch.setattr(tuning_pass._LayerTuning, "_tune", record)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
        autotune_model(model, torch.randn(2, 3, 9, 9), dtype=dtype, timer=ConstantTimer(1.0), progress=False)
        assert seen["2"] is expected
