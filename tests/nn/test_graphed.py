"""CUDA graphs for eager callers (nn/graphed.py).

On CPU: installing and removing the wrapper, the eager paths (CPU inputs, training, autograd,
unhashable arguments), deepcopy/state_dict/pickling, the input signature, and the capture/replay logic
through `FakeSteps`, a stand-in for `CudaGraphSteps` that graphs CPU tensors: its capture returns
outputs full of NaN (a real capture runs no kernel) and its replay recomputes into them in place. The
`gpu` tests check the real thing: replay equal to eager, new shapes, torch.compile, fallbacks, aliasing.
"""
import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

from sparsecnn.core.reference import relative_error
from sparsecnn.nn.graphed import (CudaGraphForward, CudaGraphWarning, cuda_graph_forward, disable_cuda_graphs,
                                  enable_cuda_graphs, input_signature)
from sparsecnn.nn.graphed import _mode_key


def _leaves(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _leaves(value)]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _leaves(item)]
    return []


class FakeGraph:
    def __init__(self, steps, run, outputs):
        self.steps, self.run, self.outputs = steps, run, outputs

    def replay(self):
        self.steps.log.append("replay")
        with torch.no_grad():
            for static, fresh in zip(_leaves(self.outputs), _leaves(self.run())):
                static.copy_(fresh)


class FakeSteps:
    """Graphs of CPU tensors; records every step in `log` ("warm_up", "run", "capture", "replay")."""

    def __init__(self, fail=None):
        self.log, self.pools, self.fail, self.capturing = [], [], fail, False

    def accepts(self, tensor):
        return tensor.device.type == "cpu"

    def is_capturing(self, device):
        return self.capturing

    def new_pool(self):
        self.pools.append(object())
        return self.pools[-1]

    def warm_up(self, run, device, runs=2):
        self.log.append("warm_up")
        for _ in range(runs):
            run()

    def capture(self, run, device, pool):
        self.log.append("capture")
        assert pool is self.pools[-1]
        if self.fail is not None and self.fail():
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = run()
        with torch.no_grad():
            for tensor in _leaves(outputs):
                tensor.fill_(float("nan"))  # a capture runs no kernel: values come from replay
        return FakeGraph(self, run, outputs), outputs


class Net(nn.Module):
    def __init__(self, frozen=True):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3)
        self.runs = 0
        if frozen:
            self.requires_grad_(False)

    def forward(self, x, scale=1.0):
        self.runs += 1
        return self.conv2(torch.relu(self.conv1(x))) * scale


class Nested(nn.Module):
    """Inputs in a list and a keyword dict; outputs in a dict of a tuple and a list, and a non-tensor."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, xs, extra=None):
        a, b = xs
        return {"pair": (a * self.weight, b + extra["c"]), "list": [a.sum(dim=0)], "tag": "ok"}


def graphed(module, **kwargs):
    steps = FakeSteps(kwargs.pop("fail", None))
    wrapper = enable_cuda_graphs(module.eval(), steps=steps, **kwargs)
    return wrapper, steps


def x_of(*shape, **kwargs):
    return torch.randn(*(shape or (2, 3, 8, 8)), **kwargs)


# -------------------------------------------------------------------------------------- install/remove

def test_enable_installs_once_and_disable_restores_the_class_forward():
    net = Net().eval()
    x = x_of()
    want = net(x)
    wrapper = enable_cuda_graphs(net)
    assert isinstance(wrapper, CudaGraphForward) and net.forward is wrapper and cuda_graph_forward(net) is wrapper
    assert enable_cuda_graphs(net, static_outputs=True, max_graphs=3) is wrapper  # no wrapper of a wrapper
    assert wrapper.static_outputs and wrapper.max_graphs == 3 and wrapper.original_forward.__self__ is wrapper
    assert torch.equal(net(x), want)
    disable_cuda_graphs(net)
    assert "forward" not in net.__dict__ and cuda_graph_forward(net) is None
    assert net.forward.__func__ is Net.forward and torch.equal(net(x), want)
    disable_cuda_graphs(net)  # no-op
    assert dict(net.named_children()).keys() == {"conv1", "conv2"}


def test_an_instance_forward_is_wrapped_and_restored():
    net = Net().eval()
    def doubled(x):
        return 2 * Net.forward(net, x)
    net.forward = doubled
    x = x_of()
    enable_cuda_graphs(net)
    assert torch.equal(net(x), doubled(x))
    disable_cuda_graphs(net)
    assert net.forward is doubled


# ------------------------------------------------------------------------------------------ eager paths

def test_cpu_inputs_run_eagerly_with_identical_outputs():
    net = Net().eval()
    x = x_of()
    want = net(x)
    wrapper = enable_cuda_graphs(net)
    for _ in range(2):
        assert torch.equal(net(x), want)
    assert wrapper.counts == {"eager:not-cuda": 2} and wrapper.num_graphs == 0


def test_training_mode_and_disabled_run_eagerly():
    net = Net()
    wrapper, steps = graphed(net)
    net.train()
    net(x_of())
    net.eval()
    wrapper.enabled = False
    net(x_of())
    assert steps.log == [] and wrapper.counts == {"eager:training": 1, "eager:disabled": 1}
    wrapper.enabled = True
    net(x_of())
    assert wrapper.counts["capture"] == 1


def test_autograd_runs_eagerly():
    net = Net(frozen=False)
    wrapper, steps = graphed(net)
    x = x_of()
    out = net(x)  # grad enabled and the parameters require grad
    assert out.grad_fn is not None and wrapper.counts == {"eager:autograd": 1}
    net.requires_grad_(False)
    x_grad = x_of(requires_grad=True)
    out = net(x_grad)  # an input requires grad
    assert out.grad_fn is not None and wrapper.counts["eager:autograd"] == 2
    with torch.no_grad():
        net(x_grad)  # nothing records: graphed
    net(x)  # grad enabled, nothing requires grad: graphed
    assert steps.log.count("capture") == 2 and wrapper.counts["eager:autograd"] == 2
    with torch.inference_mode():
        net(x)
    assert wrapper.counts["replay"] == 1


def test_unhashable_arguments_and_a_capture_under_way_run_eagerly():
    net = Nested()
    wrapper, steps = graphed(net)
    a, b = x_of(3, 4), x_of(3, 4)
    net([a, b], extra={"c": torch.ones(4), "d": {1, 2}})  # a set: unhashable
    steps.capturing = True
    net([a, b], extra={"c": torch.ones(4)})
    assert steps.log == [] and wrapper.counts == {"eager:unhashable": 1, "eager:capturing": 1}


def test_no_tensor_argument_or_mixed_devices_run_eagerly():
    net = Net()
    wrapper, steps = graphed(net)
    with pytest.raises(TypeError):
        net(scale=2.0)  # no tensor: eager, so the forward's own error
    assert wrapper.counts == {"eager:not-cuda": 1}
    net = Nested()
    wrapper, steps = graphed(net)
    steps.accepts = lambda tensor: True
    net([x_of(3, 4), x_of(3, 4, device="meta")], extra={"c": torch.ones(4, device="meta")})
    assert steps.log == [] and wrapper.counts == {"eager:devices": 1}


# ----------------------------------------------------------------------------------------- signatures

def test_signature_distinguishes_shape_dtype_stride_grad_and_values():
    x = x_of()
    base = input_signature((x,), {"scale": 2.0})
    assert base == input_signature((x_of(),), {"scale": 2.0}) and hash(base) == hash(input_signature((x_of(),), {"scale": 2.0}))
    different = [
        ((x_of(3, 3, 8, 8),), {"scale": 2.0}),
        ((x.double(),), {"scale": 2.0}),
        ((x.contiguous(memory_format=torch.channels_last),), {"scale": 2.0}),
        ((x.transpose(2, 3).contiguous().transpose(2, 3),), {"scale": 2.0}),
        ((x.clone().requires_grad_(),), {"scale": 2.0}),
        ((x,), {"scale": 3.0}),
        ((x,), {"scale": 2}),  # 2 == 2.0, but another type
        ((x,), {}),
        ((x, 2.0), {}),
        ((x.to("meta"),), {"scale": 2.0}),
    ]
    signatures = [input_signature(args, kwargs) for args, kwargs in different]
    assert all(s is not None and s != base for s in signatures)
    assert len(set(signatures)) == len(signatures)
    assert input_signature(([x, x],), {}) != input_signature(((x, x),), {})


def test_signature_ignores_values_and_rejects_unhashable_arguments():
    x = x_of()
    assert input_signature((x,)) == input_signature((torch.zeros_like(x),))
    assert input_signature(([x, {"k": x}],)) is not None
    assert input_signature((x, {1, 2})) is None
    assert input_signature((x,), {"d": {"inner": [x, {3}]}}) is None
    assert input_signature((x, {frozenset(): 1})) is not None and input_signature((x, {(): {1}})) is None


def test_mode_key_follows_tf32_flags():
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        off = _mode_key()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        on = _mode_key()
    assert off != on


# ------------------------------------------------------------------------------- capture and replay logic

def test_same_signature_captures_once_then_replays():
    net = Net()
    wrapper, steps = graphed(net)
    x1, x2 = x_of(), x_of()
    want1, want2 = Net.forward(net, x1), Net.forward(net, x2)
    runs = net.runs
    out1 = net(x1)
    assert steps.log == ["warm_up", "capture", "replay"] and net.runs == runs + 4  # 2 warm-up, capture, replay
    assert torch.allclose(out1, want1)
    out2 = net(x2)
    assert steps.log == ["warm_up", "capture", "replay", "replay"] and torch.allclose(out2, want2)
    assert torch.allclose(out1, want1)  # not overwritten by the second call
    assert wrapper.counts == {"capture": 1, "replay": 1} and wrapper.num_graphs == 1 and len(steps.pools) == 1


def test_new_shape_or_argument_captures_a_new_graph_in_the_same_pool():
    net = Net()
    wrapper, steps = graphed(net)
    x, y = x_of(), x_of(4, 3, 10, 10)
    net(x)
    out = net(y)
    out_scaled = net(x, scale=0.5)
    net(x)
    assert steps.log.count("capture") == 3 and steps.log.count("warm_up") == 3 and wrapper.num_graphs == 3
    assert len(steps.pools) == 1 and wrapper.counts["replay"] == 1
    assert torch.allclose(out, Net.forward(net, y)) and torch.allclose(out_scaled, Net.forward(net, x, 0.5))


def test_failed_capture_warns_once_runs_eagerly_and_never_retries():
    net = Net()
    wrapper, steps = graphed(net, fail=lambda: True)
    x = x_of()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = net(x)
        net(x)
        net(x_of(1, 3, 9, 9))  # another signature fails too: no second warning
    assert [str(w.message) for w in caught if w.category is CudaGraphWarning] == [
        "Net: CUDA graph capture failed (RuntimeError: operation not permitted when stream is capturing); "
        "calls with this input signature run eagerly"]
    assert torch.equal(out, Net.forward(net, x))
    assert steps.log == ["warm_up", "capture", "warm_up", "capture"]
    assert wrapper.counts == {"eager:failed": 3} and wrapper.num_graphs == 0
    steps.fail = None
    wrapper.reset()  # forgets the failures
    net(x)
    assert wrapper.counts["capture"] == 1


def test_a_failure_keeps_other_graphs():
    net = Net()
    failing = iter([False, True])
    wrapper, steps = graphed(net, fail=lambda: next(failing))
    x = x_of()
    net(x)
    with pytest.warns(CudaGraphWarning):
        net(x_of(1, 3, 8, 8))
    net(x)
    assert wrapper.counts == {"capture": 1, "eager:failed": 1, "replay": 1}


def test_errors_of_the_forward_itself_propagate():
    net = Net()
    wrapper, steps = graphed(net)
    with pytest.raises(RuntimeError):
        net(x_of(2, 5, 8, 8))  # wrong channel count: the warm-up raises, as eager would
    assert steps.log == ["warm_up"] and wrapper.num_graphs == 0


def test_an_input_without_a_static_buffer_runs_eagerly_with_a_warning():
    net = Net()
    wrapper, steps = graphed(net)
    x = x_of(1, 3, 8, 8).expand(2, 3, 8, 8)  # stride 0: no buffer of these strides can be written
    with pytest.warns(CudaGraphWarning, match="no static input buffer"):
        out = net(x)
    assert torch.equal(out, Net.forward(net, x)) and steps.log == [] and wrapper.counts == {"eager:failed": 1}


def test_a_forward_writing_into_its_input_gets_the_callers_values():
    class Doubles(nn.Module):
        def forward(self, x):
            return x.mul_(2) + 0

    net = Doubles()
    wrapper, steps = graphed(net)
    for _ in range(2):
        x = x_of(3)
        want = 2 * x
        assert torch.equal(net(x), want)  # the warm-up and capture ran on the static copy
    assert wrapper.counts == {"capture": 1, "replay": 1}


def test_more_signatures_than_max_graphs_run_eagerly_with_one_warning():
    net = Net()
    wrapper, steps = graphed(net, max_graphs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (1, 2, 3, 4, 1, 2, 3):
            out = net(x_of(n, 3, 8, 8))
    assert sum(w.category is CudaGraphWarning for w in caught) == 1 and "max_graphs=2" in str(caught[0].message)
    assert out.shape[0] == 3 and not out.isnan().any()
    assert wrapper.counts == {"capture": 2, "replay": 2, "eager:max-graphs": 3}


def test_outputs_are_new_tensors_unless_static_outputs():
    net = Net()
    graphed(net)
    x1, x2 = x_of(), x_of()
    first, second = net(x1), net(x2)
    assert first.data_ptr() != second.data_ptr() and torch.allclose(first, Net.forward(net, x1))

    static = Net()
    graphed(static, static_outputs=True)
    first = static(x1)
    assert torch.allclose(first, Net.forward(static, x1))
    second = static(x2)
    assert second is first and torch.allclose(first, Net.forward(static, x2))  # overwritten by the next call


def test_nested_inputs_and_outputs():
    net = Nested()
    wrapper, steps = graphed(net)
    for _ in range(2):
        a, b, c = x_of(3, 4), x_of(3, 4), x_of(4)
        out = net([a, b], extra={"c": c})
        assert out["tag"] == "ok" and torch.allclose(out["pair"][0], a * net.weight)
        assert torch.allclose(out["pair"][1], b + c) and torch.allclose(out["list"][0], a.sum(dim=0))
        assert isinstance(out["pair"], tuple) and isinstance(out["list"], list)
    assert wrapper.counts == {"capture": 1, "replay": 1}


def test_static_inputs_keep_strides_and_replays_copy_into_them():
    net = Net()
    wrapper, steps = graphed(net)
    x = x_of().contiguous(memory_format=torch.channels_last)
    net(x)
    (entry,) = wrapper._graphs.values()
    assert entry.inputs[0].stride() == x.stride() and entry.inputs[0].data_ptr() != x.data_ptr()
    y = x_of().contiguous(memory_format=torch.channels_last)
    assert torch.allclose(net(y), Net.forward(net, y)) and torch.equal(entry.inputs[0], y)


def test_graphs_under_torch_compile_tracing_run_the_plain_forward():
    net = Net()
    wrapper, steps = graphed(net)
    compiled = torch.compile(net, backend="eager", fullgraph=True)
    x = x_of()
    assert torch.allclose(compiled(x), Net.forward(net, x))
    assert steps.log == [] and not wrapper.counts


def test_torch_compile_of_a_graphed_fx_graph_module_traces_its_forward():
    # dynamo registers an fx.GraphModule's `forward.__code__` before tracing: the wrapper must have one
    net = torch.fx.symbolic_trace(Net())
    wrapper, steps = graphed(net)
    assert wrapper.__code__ is type(net).forward.__code__
    compiled = torch.compile(net, backend="eager", fullgraph=True)
    x = x_of()
    assert torch.allclose(compiled(x), wrapper.original_forward(x))
    assert steps.log == [] and not wrapper.counts


# ----------------------------------------------------------------------------- copies and serialisation

def test_deepcopy_gives_the_copy_its_own_wrapper_without_graphs():
    net = Net()
    wrapper, steps = graphed(net, static_outputs=True)
    x = x_of()
    net(x)
    twin = copy.deepcopy(net)
    twin_wrapper = cuda_graph_forward(twin)
    assert twin_wrapper is not wrapper and twin_wrapper.module is twin and wrapper.module is net
    assert twin_wrapper.num_graphs == 0 and twin_wrapper.static_outputs and wrapper.num_graphs == 1
    with torch.no_grad():
        twin.conv2.bias += 1
    assert torch.allclose(twin(x), Net.forward(net, x) + 1) and torch.allclose(net(x), Net.forward(net, x))
    disable_cuda_graphs(twin)
    assert cuda_graph_forward(net) is wrapper


def test_state_dict_and_torch_save_are_unaffected():
    net = Net()
    want = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    graphed(net)
    net(x_of())
    state = net.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    fresh = Net()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    x = x_of()
    assert torch.equal(fresh(x), Net.forward(net, x))


def test_pickling_the_module_keeps_the_settings_and_drops_the_graphs():
    net = Net()
    wrapper, _ = graphed(net, static_outputs=True, max_graphs=5)
    net(x_of())
    net.runs = 0
    loaded = pickle.loads(pickle.dumps(net))
    restored = cuda_graph_forward(loaded)
    assert restored.module is loaded and restored.static_outputs and restored.max_graphs == 5
    assert restored.num_graphs == 0
    x = x_of()
    assert torch.equal(loaded(x), Net.forward(net, x))  # CPU input with the real steps: eager


# ---------------------------------------------------------------------------------------------- on CUDA

def small_convnet():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, stride=2, padding=1, bias=False), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_replay_equals_eager_on_cuda(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = small_convnet()
    reference = copy.deepcopy(model).double().cuda()
    model = model.to(device="cuda", dtype=dtype)
    wrapper = enable_cuda_graphs(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 3, 16, 16, device="cuda")
            eager = wrapper.original_forward(x.to(dtype))
            out = model(x.to(dtype))
            want = reference(x.double())
            assert out.dtype == dtype and torch.allclose(out, eager, rtol=1e-6, atol=1e-6)
            assert relative_error(out, want) < (1e-5 if dtype == torch.float32 else 2 * relative_error(eager, want) + 1e-4)
    assert wrapper.counts == {"capture": 1, "replay": 2}


@pytest.mark.gpu
def test_a_new_shape_captures_a_new_graph_on_cuda():
    model = small_convnet().cuda()
    wrapper = enable_cuda_graphs(model)
    with torch.inference_mode():
        for shape in [(2, 3, 16, 16), (5, 3, 16, 16), (2, 3, 16, 16), (2, 3, 20, 20)]:
            x = torch.randn(shape, device="cuda")
            assert torch.allclose(model(x), wrapper.original_forward(x), rtol=1e-5, atol=1e-5)
    assert wrapper.num_graphs == 3 and wrapper.counts == {"capture": 3, "replay": 1}
    with torch.no_grad():  # graphs captured under inference mode replay outside it
        x = torch.randn(5, 3, 16, 16, device="cuda")
        assert torch.allclose(model(x), wrapper.original_forward(x), rtol=1e-5, atol=1e-5)
    assert wrapper.counts["replay"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("fx_traced", [False, True], ids=["module", "fx"])
def test_torch_compile_of_the_wrapped_module_matches_on_cuda(fx_traced):
    model = small_convnet().cuda()
    model = torch.fx.symbolic_trace(model).eval() if fx_traced else model
    wrapper = enable_cuda_graphs(model)
    compiled = torch.compile(model)
    x = torch.randn(4, 3, 16, 16, device="cuda")
    with torch.no_grad():
        out = compiled(x)
        assert torch.allclose(out, wrapper.original_forward(x), rtol=1e-3, atol=1e-3)
        assert torch.allclose(model(x), out, rtol=1e-3, atol=1e-3)  # the module itself still graphs
    assert wrapper.counts == {"capture": 1}


@pytest.mark.gpu
def test_autograd_and_training_fall_back_on_cuda():
    model = small_convnet().cuda()
    wrapper = enable_cuda_graphs(model)
    model.requires_grad_(False)
    x = torch.randn(2, 3, 16, 16, device="cuda", requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert x.grad is not None and wrapper.counts == {"eager:autograd": 1}
    model.train()
    model(x.detach())
    assert wrapper.counts["eager:training"] == 1 and wrapper.num_graphs == 0


@pytest.mark.gpu
def test_outputs_are_not_aliased_unless_static_on_cuda():
    model = small_convnet().cuda()
    wrapper = enable_cuda_graphs(model)
    x1, x2 = torch.randn(2, 2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        first = model(x1)
        kept = first.clone()
        second = model(x2)
        assert first.data_ptr() != second.data_ptr() and torch.equal(first, kept)
        enable_cuda_graphs(model, static_outputs=True)
        a = model(x1)
        b = model(x2)
        assert a is b and torch.allclose(b, second)


@pytest.mark.gpu
def test_failed_capture_leaves_no_capture_open_on_cuda():
    class Syncs(nn.Module):
        def forward(self, x):
            return x * float(x.sum().item() > 0)  # a host sync: not allowed while capturing

    model = Syncs().eval()
    wrapper = enable_cuda_graphs(model)
    x = torch.randn(8, device="cuda").abs()
    stream = torch.cuda.current_stream()
    with pytest.warns(CudaGraphWarning, match="capture failed"):
        out = model(x)
    assert torch.equal(out, x) and wrapper.counts == {"eager:failed": 1}
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    other = small_convnet().cuda()
    other_wrapper = enable_cuda_graphs(other)
    with torch.no_grad():
        y = torch.randn(2, 3, 16, 16, device="cuda")
        assert torch.allclose(other(y), other_wrapper.original_forward(y), rtol=1e-5, atol=1e-5)
    assert other_wrapper.counts == {"capture": 1}
