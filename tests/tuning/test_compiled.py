"""sparsecnn under torch.compile: a sparsified model traces as one graph (no graph break, our convs
as custom ops in it) and compiles to the eager result; `sparsecnn.compile` keeps the faster of the
sparsified and the given model compiled alike, and leaves to inductor the convs it runs faster.
On the CPU the compiler is aot_eager and the timings are scripted (`FakeTimer`), so which model wins
is decided by the test; the `gpu` tests run inductor itself."""
import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.common import needs_interpreter, sparse_weight
from test_tuner import FakeTimer
from torch import nn

import sparsecnn
from sparsecnn import CompileConfig, SparseConv2d, sparsify_
from sparsecnn.core.reference import relative_error
from sparsecnn.passes import prepare_for_inference
from sparsecnn.tuning.inductor import ATEN_BACKENDS

# Per layer im2col-cusparse (an op of ours) wins; the model checks keep what tuning chose.
CUSPARSE_WINS = {"im2col-cusparse": 0.5}


class Net(nn.Module):
    """What prepare_for_inference fuses into the convs (BatchNorm, ReLU, residual add, max pool)
    and what it leaves around them (a depthwise conv, SiLU, a squeeze-excite gate), then a linear."""

    def __init__(self):
        super().__init__()
        self.stem, self.stem_bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.conv, self.conv_bn = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.squeeze, self.expand = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = self.pool(F.relu(self.stem_bn(self.stem(x))))
        y = F.relu(self.conv_bn(self.conv(y)) + y)
        z = F.silu(self.depthwise(y))
        gate = torch.sigmoid(self.expand(F.relu(self.squeeze(z.mean((2, 3), keepdim=True)))))
        return self.head((z * gate).mean((2, 3)))


def _net(device="cpu"):
    model = Net()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d) and module.groups == 1:
                module.weight.copy_(sparse_weight(module.weight.shape, 0.7))
            if isinstance(module, nn.BatchNorm2d):  # statistics a trained model would have
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model.eval().to(device)


def _op_layers(model):
    """SparseConv2d layers whose bound call is one op of ours (not aten convs, not a dense fallback)."""
    return [m for m in model.modules() if isinstance(m, SparseConv2d) and m.backend not in ATEN_BACKENDS
            and m._binding is not None and m._binding.call is not None]


def _explain_and_compile(model, x, compiler="aot_eager"):
    """(explanation, compiled output, eager output) under no_grad, dynamo reset first."""
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        compiled = torch.compile(model, backend=compiler, fullgraph=True)(x)
    return explanation, compiled, eager


def _sparsecnn_ops(explanation):
    return [node for graph in explanation.graphs for node in graph.graph.nodes
            if node.op == "call_function" and "sparsecnn" in str(node.target)]


def _sparsified(tmp_path, backend):
    model, x = prepare_for_inference(_net()), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        if backend == "auto":
            model.sparsecnn_report = sparsecnn.autotune_model(model, x, cache_dir=tmp_path, progress=False,
                                                              timer=FakeTimer(measure_ms=CUSPARSE_WINS))
        else:
            sparsify_(model, x, backend=backend)
    return model, x


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("backend", ["auto", pytest.param("direct", marks=needs_interpreter)])
def test_a_sparsified_model_is_one_graph_with_our_ops_and_compiles_to_the_eager_result(tmp_path, backend):
    model, x = _sparsified(tmp_path, backend)
    explanation, compiled, eager = _explain_and_compile(model, x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    ops = _op_layers(model)
    assert ops and len(_sparsecnn_ops(explanation)) == len(ops)  # one node per conv run by an op of ours
    assert relative_error(compiled, eager) < 1e-6


def test_shapes_bound_beforehand_compile_without_graph_breaks(tmp_path):
    model, x = _sparsified(tmp_path, "auto")
    other = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        model(other)  # binds every layer at batch 3 too, keeping batch 2's bindings
        for inputs in (x, other):
            explanation = torch._dynamo.explain(model)(inputs)
            assert explanation.graph_break_count == 0 and len(_sparsecnn_ops(explanation)) == len(_op_layers(model))


def _compile(model, x, tmp_path, measure_ms, inductor_layers=False, progress=False):
    config = CompileConfig(tuning={"cache_dir": tmp_path}, compiler="aot_eager", inductor_layers=inductor_layers,
                           progress=progress, timer=FakeTimer(measure_ms={**CUSPARSE_WINS, **measure_ms}))
    torch._dynamo.reset()
    return sparsecnn.compile(model, x, mode="max-autotune", config=config)


@pytest.mark.parametrize("sparse_ms, given_ms, kept", [(1.0, 2.5, "sparse"), (3.0, 2.0, "dense"), (2.0, 2.0, "dense")])
def test_compile_keeps_the_faster_of_the_sparsified_and_the_given_model_compiled(tmp_path, sparse_ms, given_ms,
                                                                                kept):
    model, x = _net(), torch.randn(2, 3, 16, 16)
    given_state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        want = model(x)
    compiled = _compile(model, x, tmp_path, {"model:compiled sparse": sparse_ms, "model:compiled given": given_ms})
    check = compiled.sparsecnn_report.compiled
    assert (compiled.kept, check.kept, check.sparse_ms, check.dense_ms) == (kept, kept, sparse_ms, given_ms)
    assert check.speedup == pytest.approx(max(sparse_ms, given_ms) / min(sparse_ms, given_ms))
    kept_text = "kept the sparsified model" if kept == "sparse" else "kept the model as given, compiled"
    assert f"{kept_text}, {check.speedup:.2f}x faster" in compiled.sparsecnn_report.format()
    assert (compiled.module is model) == (kept == "dense")
    assert any(isinstance(m, SparseConv2d) for m in compiled.module.modules()) == (kept == "sparse")
    assert all(type(m) is not SparseConv2d for m in model.modules())  # the model itself is left as it was
    assert all(torch.equal(t, given_state[k]) for k, t in model.state_dict().items())
    assert relative_error(compiled(x), want) < 1e-5


@pytest.mark.slow
def test_compiled_sparse_model_binds_new_shapes_before_the_compiled_call(tmp_path):
    model, x = _net(), torch.randn(2, 3, 16, 16)
    compiled = _compile(model, x, tmp_path, {"model:compiled sparse": 1.0, "model:compiled given": 2.0})
    assert compiled.kept == "sparse"
    torch._dynamo.utils.counters.clear()
    for batch in (3, 1, 3):
        other = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            assert relative_error(compiled(other), model(other)) < 1e-5
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_convs_faster_as_aten_convs_inside_the_graph_are_left_to_inductor(tmp_path):
    model, x = _net(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = model(x)
    # conv: the aten form faster by more than the noise margin; stem: slower; squeeze: faster by too little
    times = {"layer conv: im2col-cusparse": 2.0, "layer conv: inductor": 1.0, "layer stem: im2col-cusparse": 1.0,
             "layer stem: inductor": 2.0, "layer squeeze: im2col-cusparse": 1.0, "layer squeeze: inductor": 0.999,
             "model:compiled sparse": 1.0, "model:compiled given": 2.0}
    compiled = _compile(model, x, tmp_path, times, inductor_layers=True)
    check = compiled.sparsecnn_report.compiled
    on_ops = {name for name, m in compiled.module.named_modules() if isinstance(m, SparseConv2d)
              and m.backend not in ATEN_BACKENDS}
    assert check.to_inductor == ["conv"] and {"stem", "squeeze"} <= set(check.layers) <= on_ops | {"conv"}
    assert check.layers["conv"] == {"op_ms": 2.0, "inductor_ms": 1.0}
    assert compiled.module.get_submodule("conv").backend == "dense" and "stem" in on_ops
    assert "1 of" in check.format() and "(conv)" in check.format()
    assert relative_error(compiled(x), want) < 1e-5


def test_each_phase_of_compile_has_a_progress_bar_and_its_time_in_the_report(tmp_path, capsys):
    model, x = _net(), torch.randn(2, 3, 16, 16)
    compiled = _compile(model, x, tmp_path, {}, inductor_layers=True, progress=True)
    phases = compiled.sparsecnn_report.compiled.phase_s
    names = ["tuning", "inductor layers", "compile sparsified", "compile as given", "timing compiled"]
    assert list(phases) == [*names, "total"] and sum(phases[name] for name in names) <= phases["total"]
    bars = capsys.readouterr().err
    assert all(f"{name}: 100%" in bars for name in names[1:]) and "layers: 100%" in bars  # tuning's own bars
    assert "compile time: tuning" in compiled.sparsecnn_report.format()


def test_compile_refuses_bad_arguments_by_name():
    model, x = _net(), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="mode must be one of"):
        sparsecnn.compile(model, x, mode="fastest")
    with pytest.raises(TypeError, match="config must be a CompileConfig"):
        sparsecnn.compile(model, x, config={"compiler": "aot_eager"})
    with pytest.raises(ValueError, match=r"unknown options \['backend'\]"):
        CompileConfig(tuning={"backend": "direct"})
    with pytest.raises(TypeError, match="compiler must be"):
        CompileConfig(compiler=3)


# --- GPU ------------------------------------------------------------------------------------------


@pytest.fixture
def exact_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.gpu
@pytest.mark.timing
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_gpu_sparsified_model_has_no_graph_break_under_inductor(tmp_path, dtype, exact_fp32):
    """sparsify_ with its defaults (every backend, CUDA graphs for plain calls): one graph under
    dynamo, and inductor's compiled model gives the eager model's output."""
    model, x = prepare_for_inference(_net("cuda")), torch.randn(8, 3, 32, 32, device="cuda")
    x = x.half() if dtype == "fp16" else x
    with torch.no_grad():
        sparsify_(model, x, dtype=dtype, cache_dir=tmp_path, progress=False)
    explanation, compiled, eager = _explain_and_compile(model, x, compiler="inductor")
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert len(_sparsecnn_ops(explanation)) >= len(_op_layers(model))  # dense-fused is an op of ours too
    assert relative_error(compiled, eager) < (1e-5 if dtype == "fp32" else 1e-2)


@pytest.mark.gpu
@pytest.mark.timing
def test_gpu_compile_with_inductor_matches_eager_and_reports_the_winner(tmp_path, exact_fp32):
    model, x = _net("cuda"), torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        want = model(x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = CompileConfig(tuning={"cache_dir": tmp_path, "dtype": "fp32"}, progress=False)
    compiled = sparsecnn.compile(model, x, mode="default", config=config)
    check = compiled.sparsecnn_report.compiled
    assert compiled.kept in ("sparse", "dense") and check.compiler == "inductor"
    assert min(check.sparse_ms, check.dense_ms) == (check.sparse_ms if compiled.kept == "sparse" else check.dense_ms)
    assert relative_error(compiled(x), want) < 1e-5
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
