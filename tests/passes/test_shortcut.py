"""Folding a projection shortcut into the conv that takes it as residual (`passes.shortcut`,
`nn.shortcut`): which pairs fold, the same outputs folded and unfolded on every backend, the fused
kernel where the backend has one (`tensorcore`, under Triton's interpreter on the CPU), and tuning
keeping a fold only where the whole model gets faster, recorded for a reload."""
import re

import pytest
import torch
from helpers.blocks import block_inputs, block_model
from helpers.common import INTERPRET, needs_cuda, needs_interpreter, sparse_weight

from sparsecnn.core.reference import relative_error
from sparsecnn.nn import SparseConv2d
from sparsecnn.nn.graphed import disable_cuda_graphs, enable_cuda_graphs
from sparsecnn.nn.shortcut import fold_blocker
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.passes.shortcut import fold_shortcut, shortcut_pairs, unfold_shortcut
from sparsecnn.tuning.sparsify import autotune_model

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

if INTERPRET or torch.cuda.is_available():
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig


def _unnumbered(code: str) -> str:
    """fx code without the numbers fx appends to node names (a node made again gets a new one)."""
    return re.sub(r"_\d+\b", "", code)


def test_the_pass_finds_the_downsample_and_folds_it_with_the_same_outputs():
    model, x = block_model(), block_inputs()
    gm = prepare_for_inference(model, example_inputs=x)
    before = gm.code
    assert shortcut_pairs(gm) == [("0.conv2", "0.downsample.0")]
    with torch.no_grad():
        expected = gm(x)
        fold_shortcut(gm, "0.conv2", "0.downsample.0")
        assert "downsample" not in gm.code and shortcut_pairs(gm) == []
        assert isinstance(gm.get_submodule("0.conv2").shortcut, SparseConv2d)
        assert relative_error(gm(x), expected) < 1e-6
        unfold_shortcut(gm, "0.conv2", "0.downsample.0")
        assert _unnumbered(gm.code) == _unnumbered(before) and gm.get_submodule("0.conv2").shortcut is None
        assert relative_error(gm(x), expected) < 1e-6


def test_what_does_not_fold():
    layer = SparseConv2d(sparse_weight((32, 16, 1, 1), 0.5))
    good = SparseConv2d(sparse_weight((32, 8, 1, 1), 0.5), stride=2)
    assert fold_blocker(layer, good) is None
    assert "1x1, pad 0" in fold_blocker(layer, SparseConv2d(sparse_weight((32, 8, 3, 3), 0.5), padding=1))
    assert "no activation" in fold_blocker(layer, SparseConv2d(sparse_weight((32, 8, 1, 1), 0.5), activation="relu"))
    assert "output channels" in fold_blocker(layer, SparseConv2d(sparse_weight((16, 8, 1, 1), 0.5)))


def test_a_folded_layer_takes_the_shortcut_input_and_nothing_else():
    gm = prepare_for_inference(block_model(), example_inputs=block_inputs())
    fold_shortcut(gm, "0.conv2", "0.downsample.0")
    layer, y = gm.get_submodule("0.conv2"), torch.randn(2, 16, 5, 5)
    with pytest.raises(ValueError, match="shortcut_input="):
        layer(y, residual=torch.randn(2, 32, 5, 5))
    with pytest.raises(ValueError, match="shortcut_input="):
        layer(y)
    with pytest.raises(ValueError, match="has none"):
        gm.get_submodule("0.conv1")(torch.randn(2, 8, 9, 9), shortcut_input=torch.randn(2, 8, 9, 9))


@needs_interpreter
@pytest.mark.parametrize("c,mid,k,stride,h", [(8, 16, 32, 2, 9), (24, 16, 33, 1, 7), (8, 32, 48, 3, 10)])
def test_tensorcore_runs_a_folded_pair_in_one_kernel(c, mid, k, stride, h):
    """C of the main conv a multiple of the chunk; shortcut channels and K off the tiles."""
    model, x = block_model(c, mid, k, stride), block_inputs(c, h)
    with torch.no_grad():
        reference = model.double()(x.double())
    model.float()
    gm = prepare_for_inference(model, example_inputs=x)
    config = TensorCoreConfig(group=16, chunk=16, block_m=32, order="index")
    gm.get_submodule("0.conv2").set_backend("tensorcore", config)
    fold_shortcut(gm, "0.conv2", "0.downsample.0")
    with torch.no_grad():
        out = gm(x)
    assert gm.get_submodule("0.conv2").shortcut_binding.call is not None  # one kernel, not the fallback
    assert relative_error(out, reference) < 1e-5
    with torch.no_grad():
        gm.get_submodule("0.conv2").weight.mul_(2)  # an edited weight is packed again
        doubled = gm(x)
    assert relative_error(doubled, out) > 1e-3


@needs_interpreter
def test_a_config_that_cannot_fold_runs_the_shortcut_first():
    model, x = block_model(c=8, mid=24, k=32), block_inputs()
    gm = prepare_for_inference(model, example_inputs=x)
    with torch.no_grad():
        expected = gm(x)
    gm.get_submodule("0.conv2").set_backend("tensorcore", TensorCoreConfig(16, 16, 32, order="index"))  # C=24
    fold_shortcut(gm, "0.conv2", "0.downsample.0")
    with torch.no_grad():
        out = gm(x)
    assert gm.get_submodule("0.conv2").shortcut_binding.call is None
    assert relative_error(out, expected) < 1e-5


class FoldTimer:
    """Scripted ms: tensorcore layers fast (index order fastest), whole models by label; runs each
    candidate once."""

    def __init__(self, fold_ms):
        self.fold_ms, self.timed = fold_ms, []

    def measure(self, candidate, fn):
        self.timed.append(candidate.backend)
        fn()
        if candidate.backend.startswith("model:fold"):
            return self.fold_ms
        if candidate.backend == "tensorcore":  # index order fastest: a support-order packing cannot fold
            return 0.5 if candidate.config.order == "index" else 1.0
        return 100.0 if candidate.backend == "model:given" else 2.0

    probe = measure


@needs_interpreter
@pytest.mark.parametrize("fold_ms, folded", [(1.0, True), (2.0, False)])
def test_tuning_folds_where_the_model_gets_faster_and_a_reload_folds_again(tmp_path, fold_ms, folded):
    model, x = block_model(), block_inputs()
    gm = prepare_for_inference(model, example_inputs=x)
    with torch.no_grad():
        expected = gm(x)
    timer = FoldTimer(fold_ms)
    report = autotune_model(gm, x, backends=["tensorcore"], cache_dir=tmp_path, timer=timer, progress=False)
    assert "model:fold 0.conv2" in timer.timed
    assert report.model_check.shortcuts == ([["0.conv2", "0.downsample.0"]] if folded else [])
    assert (gm.get_submodule("0.conv2").shortcut is not None) == folded
    assert ("projection shortcuts folded" in report.format()) == folded
    with torch.no_grad():
        assert relative_error(gm(x), expected) < 1e-5
    if folded:
        assert gm.get_submodule("0.conv2").shortcut_binding.call is not None  # one tensorcore kernel
    again, timer = prepare_for_inference(block_model(), example_inputs=x), FoldTimer(fold_ms)
    report = autotune_model(again, x, backends=["tensorcore"], cache_dir=tmp_path, timer=timer, progress=False)
    assert timer.timed == [] and report.model_check.cached
    assert (again.get_submodule("0.conv2").shortcut is not None) == folded
    with torch.no_grad():
        assert relative_error(again(x), expected) < 1e-5


@needs_interpreter
def test_a_folded_layer_is_one_op_in_one_graph_under_torch_compile():
    import torch._dynamo

    model, x = block_model(), block_inputs()
    gm = prepare_for_inference(model, example_inputs=x)
    gm.get_submodule("0.conv2").set_backend("tensorcore", TensorCoreConfig(16, 16, 32, order="index"))
    fold_shortcut(gm, "0.conv2", "0.downsample.0")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = gm(x)
        explanation = torch._dynamo.explain(gm)(x)
        compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)(x)
    ops = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes
           if node.op == "call_function" and "sparsecnn" in str(node.target)]
    assert explanation.graph_break_count == 0 and any("tensorcore_shortcut_conv2d" in op for op in ops)
    assert relative_error(compiled, eager) < 1e-6


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stride", [1, 2])
def test_gpu_a_folded_pair_matches_fp64_eagerly_and_under_cuda_graphs(dtype, stride):
    """ResNet's block end at its widths (64 -> 256, the shortcut from 64 channels), the tuner's
    default tensorcore config; the error within 2x that of the same model all on cuDNN."""
    model, x = block_model(64, 64, 256, stride), block_inputs(64, 14)
    with torch.no_grad():
        reference = model.double()(x.double())
    model, x = model.to("cuda", dtype), x.to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    reference = reference.cuda()
    with torch.no_grad():
        limit = 2 * relative_error(model(x), reference) + 1e-5
    gm = prepare_for_inference(model, example_inputs=x)
    gm.get_submodule("0.conv2").set_backend("tensorcore", TensorCoreConfig(order="index"))
    fold_shortcut(gm, "0.conv2", "0.downsample.0")
    with torch.no_grad():
        eager = gm(x)
        assert gm.get_submodule("0.conv2").shortcut_binding.call is not None
        assert relative_error(eager, reference) <= limit
        enable_cuda_graphs(gm)
        try:
            for _ in range(3):
                torch.empty(eager.numel() * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)  # poison
                assert torch.equal(gm(x), eager)
        finally:
            disable_cuda_graphs(gm)


@needs_interpreter
def test_sparsecnn_compile_keeps_a_folded_layer_as_our_op_and_compiles_it():
    """Under `sparsecnn.compile` (aot_eager here) the fold made in tuning stays: the per-conv
    inductor comparison leaves the folded layer to our op, and the compiled model matches eager."""
    import torch._dynamo

    import sparsecnn
    from sparsecnn import CompileConfig

    model, x = block_model(), block_inputs()
    with torch.no_grad():
        expected = model(x)
    class CompiledFaster(FoldTimer):
        def measure(self, candidate, fn):
            ms = super().measure(candidate, fn)
            return 0.5 if candidate.backend == "model:compiled sparse" else ms

    timer = CompiledFaster(1.0)
    config = CompileConfig(tuning={"backends": ["tensorcore"]}, compiler="aot_eager", inductor_layers=True,
                           progress=False, timer=timer)
    torch._dynamo.reset()
    compiled = sparsecnn.compile(model, x, mode="max-autotune", config=config)
    assert compiled.kept == "sparse"
    layer = compiled.module.get_submodule("0.conv2")
    assert layer.shortcut is not None and layer.backend == "tensorcore"
    assert "0.conv2" not in compiled.sparsecnn_report.compiled.layers  # not timed against inductor
    with torch.no_grad():
        assert relative_error(compiled(x), expected) < 1e-5


class Im2colAloneFasterTimer(FoldTimer):
    """im2col-cublas wins every layer alone; the folded model (on tensorcore) is faster as a whole."""

    def measure(self, candidate, fn):
        ms = super().measure(candidate, fn)
        return 0.25 if candidate.backend == "im2col-cublas" else ms

    def probe(self, candidate, fn):
        return self.measure(candidate, fn)


@needs_interpreter
@pytest.mark.parametrize("fold_ms, folded", [(1.0, True), (2.0, False)])
def test_a_fold_may_move_its_conv_to_the_backend_that_folds(tmp_path, fold_ms, folded):
    """The conv tuned to im2col-cublas is tried on its fastest timed tensorcore config with the shortcut
    folded: kept (and recorded, reloaded) where the model gets faster, else put back on im2col."""
    model, x = block_model(), block_inputs()
    gm = prepare_for_inference(model, example_inputs=x)
    with torch.no_grad():
        expected = gm(x)
    timer = Im2colAloneFasterTimer(fold_ms)
    report = autotune_model(gm, x, backends=["tensorcore", "im2col-cublas"], cache_dir=tmp_path, timer=timer,
                            progress=False)
    layer = gm.get_submodule("0.conv2")
    assert next(r for r in report.layers if r.name == "0.conv2").backend == "im2col-cublas"
    assert "model:fold 0.conv2" in timer.timed
    assert layer.backend == ("tensorcore" if folded else "im2col-cublas")
    assert (layer.shortcut is not None) == folded and (layer.config.order == "index" if folded else True)
    with torch.no_grad():
        assert relative_error(gm(x), expected) < 1e-5
    again, timer = prepare_for_inference(block_model(), example_inputs=x), Im2colAloneFasterTimer(fold_ms)
    autotune_model(again, x, backends=["tensorcore", "im2col-cublas"], cache_dir=tmp_path, timer=timer, progress=False)
    assert timer.timed == []
    assert again.get_submodule("0.conv2").backend == layer.backend
    assert (again.get_submodule("0.conv2").shortcut is not None) == folded
