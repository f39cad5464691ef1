"""torch.library ops (backends/*/op.py), fused epilogues (bias, residual, ReLU), and SparseConv2d under
torch.compile and CUDA graphs.

The Triton kernels run on CPU in Triton's interpreter (TRITON_INTERPRET=1, tiny odd shapes); the
`gpu` tests repeat the checks on CUDA, codegen included, and add CUDA-graph capture.
"""
import copy
import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F
from helpers.common import needs_interpreter, run_python, sparse_weight
from torch import nn

from sparsecnn.backends import get_backend
from sparsecnn.backends.blocks.op import blocks_conv2d_eager
from sparsecnn.backends.direct.op import direct_conv2d_eager
from sparsecnn.core.op_support import codegen_kernel, register_codegen
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.registry import KernelCall
from sparsecnn.core.spec import ConvSpec
from sparsecnn.nn import SparseConv2d

gpu = pytest.mark.gpu

# Triton's interpreter converts a tensor loop bound with int() on a 1-element array (numpy warns).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# Odd sizes and a rectangular stride. blocks gets 64 channels: with fewer, Algorithm 1's row groups
# (K / 8 rows) are too small to hold a block, and its dense (tl.dot) part would not run.
SPEC = ConvSpec(3, 5, 17, 7, 9, 3, 3, (2, 1), 1)
BLOCKS_SPEC = ConvSpec(2, 3, 64, 5, 7, 3, 3, (2, 1), 1)
TINY = ConvSpec(2, 3, 5, 5, 6, 3, 3, 1, 1)  # for opcheck, which runs each op several times
TRITON = [pytest.param(name, marks=needs_interpreter) for name in ("direct", "blocks", "tensorcore")]
CPU_BACKENDS = ["dense", "im2col-cublas", "im2col-cusparse", *TRITON]
EPILOGUES = [(False, False), (True, False), (False, True), (True, True)]  # (relu, residual)


def spec_of(backend):
    return BLOCKS_SPEC if backend == "blocks" else SPEC


def config_of(backend, spec, dtype=torch.float32):
    return blocks_config(spec, dtype) if backend == "blocks" else None


def planted_weight(spec=SPEC, seed=0, device="cpu"):
    """90% sparse except for 24 dense columns of the K x C*R*S matrix (with K = 64, blocks' Algorithm 1
    finds blocks there at t2 = 4)."""
    gen = torch.Generator().manual_seed(seed)
    weight = sparse_weight(spec.weight_shape, 0.9, gen).reshape(spec.K, -1)
    weight[:, :24] = torch.randn(spec.K, 24, generator=gen)
    return weight.reshape(spec.weight_shape).to(device)


def inputs(shape, seed=1, device="cpu", dtype=torch.float32):
    """Random, never all zeros, shifted so that ReLU keeps some outputs and zeroes others."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) + 0.1).to(device=device, dtype=dtype)


def expected(x, weight, bias, spec, relu, residual):
    """act(conv(x) + bias + residual) in float64."""
    y = reference_conv(x, weight, bias, stride=spec.stride, padding=spec.padding, fp64=True)
    y = y if residual is None else y + residual.double()
    return y.clamp(min=0) if relu else y


def blocks_config(spec=BLOCKS_SPEC, dtype=torch.float32):
    """The default blocks config with t2 = 4 (so that the planted block is found) and small tiles."""
    return dataclasses.replace(get_backend("blocks").configs(spec, dtype)[0], t2=4, block_n=32)


def op_args(backend_name, config, x, bias, residual, relu, spec=SPEC, weight=None):
    """(op, args) of the torch.library op behind `backend_name` bound for x's shape."""
    backend = get_backend(backend_name)
    weight = planted_weight(spec, device=x.device) if weight is None else weight
    call = backend.bind(backend.prepare(weight, config), spec, config, x.dtype, bias is not None)
    if backend_name == "im2col-cusparse":  # the op is the SpMM; residual and ReLU follow it
        return torch.ops.sparsecnn.im2col_csr_conv2d.default, (x, *call.tensors, bias, *call.static)
    return call.fn, (x, *call.tensors, bias, residual, *call.static, relu)


# --- opcheck -------------------------------------------------------------------------------------


def direct_configs(spec=SPEC, dtype=torch.float32):
    configs = get_backend("direct").configs(spec, dtype)
    return [next(c for c in configs if c.variant == variant) for variant in ("chunk", "ell", "csr")]


@pytest.mark.quick_sample(2)
@needs_interpreter
@pytest.mark.parametrize("variant", [0, 1, 2], ids=["chunk", "ell", "csr"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias-residual-relu"])
def test_opcheck_direct(variant, epilogue):
    x = inputs(TINY.input_shape)
    bias, residual = (torch.randn(TINY.K), inputs(TINY.output_shape, 2)) if epilogue else (None, None)
    op, args = op_args("direct", direct_configs(TINY)[variant], x, bias, residual, epilogue, TINY)
    torch.library.opcheck(op, args)


@pytest.mark.quick_sample(2)
@needs_interpreter
@pytest.mark.parametrize("out_layout", ["nchw", "batch_inner"])
def test_opcheck_direct_batch(out_layout):
    """The fake output has the strides of the real one in both layouts of variant "batch"."""
    from sparsecnn.backends.direct.kernel import DirectConfig

    config = DirectConfig(64, 1, 2, 1, 1, "batch", 16, out_layout)
    x = inputs(TINY.input_shape)
    op, args = op_args("direct", config, x, torch.randn(TINY.K), inputs(TINY.output_shape, 2), True, TINY)
    assert op(*args).stride()[0] == (1 if out_layout == "batch_inner" else TINY.K * TINY.H * TINY.W)
    torch.library.opcheck(op, args)


@needs_interpreter
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias-residual-relu"])
def test_opcheck_blocks(epilogue):
    x = inputs(TINY.input_shape)
    bias, residual = (torch.randn(TINY.K), inputs(TINY.output_shape, 2)) if epilogue else (None, None)
    op, args = op_args("blocks", blocks_config(TINY), x, bias, residual, epilogue, TINY)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_im2col_csr(with_bias):
    x = inputs(TINY.input_shape)
    op, args = op_args("im2col-cusparse", None, x, torch.randn(TINY.K) if with_bias else None, None, False, TINY)
    torch.library.opcheck(op, args)


def fused_args(channels_last, epilogue, spec=TINY, dtype=torch.float32, device="cpu"):
    """Arguments of `sparsecnn::cudnn_fused_conv2d` for `spec` (bias, residual and ReLU iff `epilogue`)."""
    weight = planted_weight(spec, device=device).to(dtype)
    weight = weight.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    x = inputs(spec.input_shape, device=device, dtype=dtype)
    bias, residual = (torch.randn(spec.K, device=device, dtype=dtype),
                      inputs(spec.output_shape, 2, device=device, dtype=dtype)) if epilogue else (None, None)
    return (x, weight, bias, residual, list(spec.stride), list(spec.padding), [1, 1], 1, channels_last, epilogue)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias-residual-relu"])
def test_opcheck_cudnn_fused(channels_last, epilogue):
    """On CPU the op runs F.conv2d and the epilogue; its fake output has the real one's strides."""
    args = fused_args(channels_last, epilogue)
    y = torch.ops.sparsecnn.cudnn_fused_conv2d(*args)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=layout)
    x, weight, bias, residual = args[:4]
    assert relative_error(y, expected(x, weight, bias, TINY, epilogue, residual)) < 1e-6
    torch.library.opcheck(torch.ops.sparsecnn.cudnn_fused_conv2d.default, args)


def test_cudnn_fused_op_refuses_a_bad_residual():
    args = list(fused_args(False, True))
    args[3] = args[3][:, :-1]
    with pytest.raises(ValueError, match="output's shape"):
        torch.ops.sparsecnn.cudnn_fused_conv2d(*args)


@needs_interpreter
@pytest.mark.parametrize("backend", ["direct", "blocks"])
def test_ops_refuse_offsets_bound_for_another_input_size(backend):
    config = direct_configs(TINY)[0] if backend == "direct" else blocks_config(TINY)
    op, args = op_args(backend, config, inputs(TINY.input_shape), None, None, False, TINY)
    with pytest.raises(ValueError, match="offsets are for a padded"):
        op(inputs((2, 3, 5, 7)), *args[1:])


def test_codegen_registry_hands_out_stable_process_local_handles():
    class Kernel:  # stands in for a CompiledConv: the fake implementation reads plan.spec
        plan = type("Plan", (), {"spec": SPEC})()

    kernel = Kernel()
    handle = register_codegen(kernel)
    assert register_codegen(kernel) == handle and codegen_kernel(handle) is kernel
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.ops.sparsecnn.codegen_conv2d(torch.empty(5, SPEC.C, SPEC.H, SPEC.W), None, handle)
        with pytest.raises(ValueError, match="compiled for"):
            torch.ops.sparsecnn.codegen_conv2d(torch.empty(5, SPEC.C, SPEC.H, SPEC.W + 1), None, handle)
    assert y.shape == (5, SPEC.K, SPEC.P, SPEC.Q)
    del kernel
    gc.collect()
    with pytest.raises(ValueError, match="no codegen kernel"):
        codegen_kernel(handle)


# --- epilogue numerics ---------------------------------------------------------------------------


def layer_and_inputs(backend, relu, with_residual, with_bias, device="cpu", dtype=torch.float32):
    spec = spec_of(backend)
    weight = planted_weight(spec)
    bias = torch.randn(spec.K) if with_bias else None
    layer = SparseConv2d(weight, bias, stride=spec.stride, padding=spec.padding, backend=backend,
                         config=config_of(backend, spec, dtype), activation="relu" if relu else "none")
    layer.to(device, dtype)
    x = inputs(spec.input_shape, device=device, dtype=dtype)
    residual = inputs(spec.output_shape, 2, device=device, dtype=dtype) if with_residual else None
    return layer, x, residual


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("relu, with_residual", EPILOGUES, ids=["none", "relu", "residual", "residual-relu"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_epilogue_matches_fp64(backend, relu, with_residual, with_bias):
    layer, x, residual = layer_and_inputs(backend, relu, with_residual, with_bias)
    with torch.no_grad():
        y = layer(x, residual)
    ref = expected(x, layer.weight, layer.bias, spec_of(backend), relu, residual)
    assert layer.fallback_reason is None
    assert relative_error(y, ref) < 1e-5
    if relu:
        assert (y == 0).any() and (y > 0).any()


@needs_interpreter
@pytest.mark.parametrize("variant", [0, 1, 2], ids=["chunk", "ell", "csr"])
def test_direct_fuses_the_epilogue_in_every_variant(variant):
    config = direct_configs()[variant]
    backend, weight = get_backend("direct"), planted_weight()
    x, bias = inputs(SPEC.input_shape), torch.randn(SPEC.K)
    residual = inputs(SPEC.output_shape, 2).to(memory_format=torch.channels_last)  # read through a copy
    y = backend.run(x, backend.prepare(weight, config), bias, SPEC, config, relu=True, residual=residual)
    assert relative_error(y, expected(x, weight, bias, SPEC, True, residual)) < 1e-5


@needs_interpreter
def test_blocks_fuses_the_epilogue_with_dense_blocks():
    spec = BLOCKS_SPEC
    backend, weight, config = get_backend("blocks"), planted_weight(spec), blocks_config()
    packed = backend.prepare(weight, config)
    assert packed.decomposition.blocks  # the dense (tl.dot) part runs too
    x, bias = inputs(spec.input_shape), torch.randn(spec.K)
    residual = inputs(spec.output_shape, 2).to(memory_format=torch.channels_last)  # read through a copy
    for relu in (False, True):
        y = backend.run(x, packed, bias, spec, config, relu=relu, residual=residual)
        assert relative_error(y, expected(x, weight, bias, spec, relu, residual)) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_residual_errors_are_clear(backend):
    layer, x, residual = layer_and_inputs(backend, True, True, True)
    with pytest.raises(ValueError, match="output's shape"):
        layer(x, residual[:, :-1])
    with pytest.raises(TypeError, match="residual dtype"):
        layer(x, residual.double())
    with pytest.raises(ValueError, match="residual is on meta"):
        layer(x, residual.to("meta"))
    with pytest.raises(TypeError, match="residual must be a tensor"):
        layer(x, 1.0)
    spec = spec_of(backend)
    config = config_of(backend, spec)
    packed = get_backend(backend).prepare(planted_weight(spec), config)
    with pytest.raises(ValueError, match="output's shape"):
        get_backend(backend).run(x, packed, None, spec, config, residual=residual[:1])


def test_conv1d_and_empty_batch_take_a_residual():
    conv = nn.Conv1d(5, 7, 3, stride=2, padding=1)
    with torch.no_grad():
        conv.weight.mul_(torch.rand_like(conv.weight) > 0.6)
    layer = SparseConv2d.from_dense(conv, "im2col-cusparse", activation="relu")
    x, residual = inputs((2, 5, 19)), inputs((2, 7, 10), 2)
    assert relative_error(layer(x, residual), torch.relu(conv(x) + residual)) < 1e-6
    assert layer(x[:0], residual[:0]).shape == (0, 7, 10)
    with pytest.raises(ValueError, match="output's shape"):
        layer(x[:0], residual)


# --- SparseConv2d: activation, state -------------------------------------------------------------


def test_activation_is_validated_shown_and_saved():
    layer, _, _ = layer_and_inputs("dense", True, False, True)
    assert "activation=relu" in repr(layer)
    with pytest.raises(ValueError, match="activation must be one of"):
        layer.activation = "gelu"
    with pytest.raises(ValueError, match="activation must be one of"):
        SparseConv2d(planted_weight(), activation="tanh")
    other = SparseConv2d(planted_weight(seed=3), torch.zeros(SPEC.K), stride=SPEC.stride, padding=SPEC.padding)
    assert other.activation == "none"
    other.load_state_dict(layer.state_dict())
    assert other.activation == "relu" and "activation=relu" in repr(other)
    x = inputs(SPEC.input_shape)
    assert torch.equal(other(x), layer(x))
    state = layer.state_dict()
    del state["_extra_state"]["activation"]  # saved before activations existed
    other.load_state_dict(state)
    assert other.activation == "none"


def test_prepare_binds_once_and_forward_reuses_it():
    layer, x, _ = layer_and_inputs("im2col-cusparse", True, False, True)
    assert layer.prepare(x) is layer
    binding = layer._binding
    layer(x)
    assert layer._binding is binding
    with torch.no_grad():
        layer.weight.mul_(2)  # a weight edit repacks on the next eager call
    assert relative_error(layer(x), torch.relu(layer.to_dense()(x))) < 1e-6
    assert layer._binding is not binding
    with pytest.raises(ValueError, match="in_channels"):
        layer.prepare(inputs((1, 3, 9, 11)))


# --- torch.compile -------------------------------------------------------------------------------


class TwoConvs(nn.Module):
    """conv + ReLU, then conv + residual + ReLU: both epilogues inside SparseConv2d."""

    def __init__(self, backend, device="cpu", dtype=torch.float32):
        super().__init__()
        spec1 = spec_of(backend)
        spec2 = ConvSpec(spec1.N, spec1.K, spec1.K, spec1.P, spec1.Q, 3, 3, 1, 1)
        self.conv1 = SparseConv2d(planted_weight(spec1), torch.randn(spec1.K), stride=spec1.stride,
                                  padding=spec1.padding, backend=backend, config=config_of(backend, spec1, dtype),
                                  activation="relu")
        self.conv2 = SparseConv2d(planted_weight(spec2, seed=4), torch.randn(spec1.K), padding=1, backend=backend,
                                  config=config_of(backend, spec2, dtype), activation="relu")
        self.to(device, dtype)

    def forward(self, x):
        y = self.conv1(x)
        return self.conv2(y, residual=y)


@pytest.mark.quick_sample(6)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compile_fullgraph_equals_eager(backend):
    torch._dynamo.reset()
    model = TwoConvs(backend).eval()
    x = inputs(spec_of(backend).input_shape)
    with torch.no_grad():
        eager = model(x)  # binds both layers
        bindings = [model.conv1._binding, model.conv2._binding]
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(x), eager)
        x2 = inputs(spec_of(backend).input_shape, seed=7)
        assert torch.equal(compiled(x2), model(x2))
    assert [model.conv1._binding, model.conv2._binding] == bindings  # the compiled calls changed no state


@needs_interpreter
@pytest.mark.slow
def test_compile_explain_finds_one_graph_and_binds_unprepared_layers_outside_it():
    torch._dynamo.reset()
    x = inputs(SPEC.input_shape)
    model = TwoConvs("direct").eval()
    with torch.no_grad():
        unprepared = torch.compile(copy.deepcopy(model), backend="eager")(x)  # binds eagerly, outside the graph
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
    assert torch.equal(unprepared, eager)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    op_nodes = [node for graph in explanation.graphs for node in graph.graph.nodes
                if node.op == "call_function" and "sparsecnn" in str(node.target)]
    assert len(op_nodes) == 2  # one node per conv: the op with its fused epilogue


# --- GPU -------------------------------------------------------------------------------------------

GPU_BACKENDS = ["dense", "dense-fused", "direct", "blocks", "codegen"]


@pytest.fixture
def exact_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


GPU_CASES = [(backend, dtype) for backend in GPU_BACKENDS for dtype in (torch.float32, torch.float16)]
GPU_OPS = [case for case in GPU_CASES if case[0] != "dense"]  # dense is aten ops, not an op of ours


@gpu
@pytest.mark.parametrize("backend, dtype", GPU_OPS, ids=str)
def test_gpu_opcheck(backend, dtype):
    spec = spec_of(backend)
    x, bias = inputs(spec.input_shape, device="cuda", dtype=dtype), torch.randn(spec.K, device="cuda", dtype=dtype)
    weight = planted_weight(spec, device="cuda").to(dtype)
    if backend == "codegen":
        call = get_backend("codegen").bind(get_backend("codegen").prepare(weight, None), spec, None, dtype, True)
        torch.library.opcheck(torch.ops.sparsecnn.codegen_conv2d.default, (x, bias, call.static[0]))  # (handle, relu)
        return
    residual = inputs(spec.output_shape, 2, device="cuda", dtype=dtype)
    torch.library.opcheck(*op_args(backend, config_of(backend, spec, dtype), x, bias, residual, True, spec, weight))


@gpu
@pytest.mark.parametrize("backend, dtype", GPU_CASES, ids=str)
@pytest.mark.parametrize("relu, with_residual", EPILOGUES, ids=["none", "relu", "residual", "residual-relu"])
def test_gpu_epilogue_matches_fp64(backend, dtype, relu, with_residual, exact_fp32):
    layer, x, residual = layer_and_inputs(backend, relu, with_residual, True, "cuda", dtype)
    with torch.no_grad():
        y = layer(x, residual)
        spec = spec_of(backend)
        dense_error = relative_error(layer.to_dense()(x).float() + (0 if residual is None else residual.float()),
                                     expected(x, layer.weight, layer.bias, spec, False, residual))
    ref = expected(x, layer.weight, layer.bias, spec, relu, residual)
    assert layer.fallback_reason is None and y.dtype == dtype
    assert relative_error(y, ref) < (1e-5 if dtype == torch.float32 else 2 * dense_error + 1e-4)


@gpu
@pytest.mark.parametrize("backend, dtype", GPU_CASES, ids=str)
def test_gpu_cuda_graph_replay_equals_eager(backend, dtype, exact_fp32):
    model = TwoConvs(backend, "cuda", dtype).eval()
    static_x = inputs(spec_of(backend).input_shape, device="cuda", dtype=dtype)
    with torch.no_grad():
        side = torch.cuda.Stream()  # warm-up (bind, compile, load) outside capture, as capture requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(static_x)
        static_x.copy_(inputs(static_x.shape, seed=9, device="cuda", dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, model(static_x))


@gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compile_equals_eager(backend, mode, exact_fp32):
    torch._dynamo.reset()
    model = TwoConvs(backend, "cuda").eval()
    x = inputs(spec_of(backend).input_shape, device="cuda")
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
            y = compiled(x)
    # inductor may reorder the dense baseline's adds; the sparse ops' outputs are the kernels' own
    assert relative_error(y, eager) <= (1e-6 if backend == "dense" else 0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias-residual-relu"])
def test_gpu_cudnn_fused_matches_the_unfused_chain(dtype, epilogue, exact_fp32):
    """One cuDNN fusion graph computes what F.conv2d + bias + residual + ReLU compute, in the
    layout the backend picks per dtype (NHWC for fp16), within 2x cuDNN's own error."""
    spec = ConvSpec(4, 16, 33, 13, 13, 3, 3, 2, 1)
    backend = get_backend("dense-fused")
    x, weight, bias, residual = fused_args(dtype == torch.float16, epilogue, spec, dtype, "cuda")[:4]
    call = backend.bind(backend.prepare(weight, None), spec, None, dtype, epilogue)
    y = call(x, bias, residual, epilogue)
    ref = expected(x, weight, bias, spec, epilogue, residual)
    chain = F.conv2d(x, weight, bias, spec.stride, spec.padding) + (0 if residual is None else residual)
    chain_error = relative_error(chain.relu() if epilogue else chain, ref)
    assert y.is_contiguous(memory_format=torch.channels_last if dtype == torch.float16 else torch.contiguous_format)
    assert relative_error(y, ref) <= 2 * chain_error + (1e-6 if dtype == torch.float32 else 1e-4)


def test_kernel_call_skips_the_dispatcher_in_eager_runs_only(monkeypatch):
    calls = []
    call = KernelCall(lambda x, *rest: calls.append("op") or x + 1, (), (),
                      eager=lambda x, *rest: calls.append("eager") or x + 1)
    x = torch.ones(3)
    assert torch.equal(call(x), x + 1) and calls == ["eager"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(call(x), x + 1) and calls == ["eager", "op"]


@needs_interpreter
@pytest.mark.parametrize("backend", ["direct", "blocks"])
def test_triton_backends_bind_their_eager_implementation(backend):
    spec = ConvSpec(2, 3, 5, 7, 7, 3, 3, 1, 1)
    weight = sparse_weight(spec.weight_shape, 0.7)
    chosen = get_backend(backend)
    call = chosen.bind(chosen.prepare(weight, None), spec, None, torch.float32, False)
    if backend == "direct":  # the op's implementation behind a per-layer plan (BoundDirectCall)
        assert call.eager._checked is direct_conv2d_eager
    else:
        assert call.eager is blocks_conv2d_eager


_EAGER_RUNS_WITHOUT_DYNAMO = """
import sys, types, torch
from sparsecnn.backends import get_backend
from sparsecnn.core.spec import ConvSpec
spec = ConvSpec(2, 3, 4, 6, 6, 3, 3, 1, 1)
x, weight = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
cusparse = get_backend("im2col-cusparse")
y = cusparse.bind(cusparse.prepare(weight, None), spec, None, torch.float32, False)(x, None, None, True)
assert torch.allclose(y, torch.nn.functional.conv2d(x, weight, padding=1).relu(), atol=1e-5)
class Compiled:  # stands in for a compiled codegen kernel set (CUDA only)
    plan = types.SimpleNamespace(spec=spec)
    def __call__(self, x, bias):
        return torch.nn.functional.conv2d(x, weight, bias, padding=1)
kernels = Compiled()
packed = types.SimpleNamespace(compiled=lambda *args, **kwargs: kernels)
codegen = get_backend("codegen")
y = codegen.bind(packed, spec, None, torch.float32, False)(x, None, None, True)
assert torch.allclose(y, torch.nn.functional.conv2d(x, weight, padding=1).relu(), atol=1e-5)
assert "torch._dynamo" not in sys.modules, "an eager run imported torch._dynamo"
"""


def test_eager_runs_of_the_non_triton_ops_do_not_import_dynamo():
    # A custom op's first dispatch imports torch._dynamo (5-14 s on a cold machine): eager runs must
    # call the ops' plain implementations.
    result = run_python(_EAGER_RUNS_WITHOUT_DYNAMO)
    assert result.returncode == 0, result.stderr[-2000:]
