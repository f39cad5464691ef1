"""tuning.layout: batch-innermost outputs between `direct` "batch" layers, and NCHW outputs handed on
in channels_last before layers reading channels_last (CPU, Triton interpreter)."""
import pytest
import torch
import torch.nn.functional as F
from helpers.common import needs_cuda, needs_interpreter
from torch import nn

from sparsecnn.core.reference import relative_error
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.tuning.layout import (
    batch_inner_candidates,
    channels_last_candidates,
    keep_batch_inner_outputs,
    keep_channels_last_outputs,
    set_tuning_layout,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


class Chain(nn.Module):
    """a -> b -> c (+ b's output as c's residual) -> d -> global pool: b feeds only c (input and
    residual), c feeds d, d feeds the pool."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.d = nn.Conv2d(8, 5, 1)

    def forward(self, x):
        b = torch.relu(self.b(torch.relu(self.a(x))))
        return self.d(torch.relu(self.c(b) + b)).mean((2, 3))


class ScriptedTimer:
    """measure: `ms[label]` for the two layouts; runs fn once (the model must work)."""

    def __init__(self, ms):
        self.ms, self.seen = ms, []

    def measure(self, candidate, fn):
        fn()
        self.seen.append(candidate.label())
        return self.ms[candidate.label()]


class PooledChain(nn.Module):
    """a -> max pool -> b -> global average pool; with `flat_pool`, b also feeds a max pool whose
    output is flattened (a consumer that does not take a batch-innermost input)."""

    def __init__(self, flat_pool=False):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.flat_pool = flat_pool

    def forward(self, x):
        b = self.b(self.pool(torch.relu(self.a(x))))
        out = torch.flatten(self.avg(b), 1)
        return out + torch.flatten(F.max_pool2d(b, 2), 1).sum(1, keepdim=True) if self.flat_pool else out


class Branches(nn.Module):
    """a and b read x in parallel; their outputs are concatenated and feed c (a GoogLeNet inception
    in miniature), then a global average pool."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.avg = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        return torch.flatten(self.avg(self.c(y)), 1)


def _batch_model(batch_layers, model=None):
    from sparsecnn.backends.direct.kernel import DirectConfig

    torch.manual_seed(0)
    model = (model or Chain()).eval()
    convs = [name for name, module in model.named_children() if isinstance(module, nn.Conv2d)]
    with torch.no_grad():
        for name in convs:
            getattr(model, name).weight.mul_(torch.rand_like(getattr(model, name).weight) > 0.5)
    gm = prepare_for_inference(model, example_inputs=(torch.randn(4, 3, 9, 9),))
    layers = dict(gm.named_modules())
    for name in batch_layers:
        layers[name].set_backend("direct", DirectConfig(128, 1, 4, 1, 1, "batch", 16))
    return model, gm, {name: layers[name] for name in convs}


@needs_interpreter
def test_candidates_are_batch_layers_feeding_only_batch_layers():
    _, gm, tuned = _batch_model("abcd")
    assert batch_inner_candidates(gm, tuned) == ["a", "b", "c"]  # d feeds the pool
    _, gm, tuned = _batch_model("abd")
    assert batch_inner_candidates(gm, tuned) == ["a"]  # b feeds c, which is dense
    assert batch_inner_candidates(nn.Sequential(), tuned) == []  # no graph: nothing known


@needs_interpreter
def test_candidates_look_through_concatenations_of_batch_layers_only():
    _, gm, tuned = _batch_model("abc", Branches())
    assert batch_inner_candidates(gm, tuned) == ["a", "b", "c"]
    _, gm, tuned = _batch_model("ac", Branches())
    assert batch_inner_candidates(gm, tuned) == ["c"]   # b writes NCHW, so the concatenation would too
    _, gm, tuned = _batch_model("ab", Branches())
    assert batch_inner_candidates(gm, tuned) == []       # c is dense


@needs_interpreter
def test_staged_layers_are_batch_layers_and_keep_their_backend():
    from sparsecnn.backends.staged.kernel import StagedConfig

    _, gm, tuned = _batch_model("abd")
    tuned["c"].set_backend("staged", StagedConfig(2, 4, 4, 2, 2))
    assert batch_inner_candidates(gm, tuned) == ["a", "b", "c"]  # c (staged) reads b's output and writes d's input
    timer = ScriptedTimer({"model:nchw outputs": 2.0, "model:batch-innermost outputs": 1.0})
    assert keep_batch_inner_outputs(gm, lambda: None, tuned, timer)[0] == ["a", "b", "c"]
    assert (tuned["c"].backend, tuned["c"].config.out_layout) == ("staged", "batch_inner")
    assert tuned["c"].config.tile_h == 2


@needs_interpreter
def test_unrolled_layers_always_write_batch_innermost():
    """Their NCHW stores are slow, and any consumer takes a strided input: they keep batch-innermost
    outputs whether the other "batch" layers do or not, and are not among the timed candidates."""
    from sparsecnn.backends.unrolled.kernel import UnrolledConfig

    _, gm, tuned = _batch_model("abc")
    tuned["d"].set_backend("unrolled", UnrolledConfig(8, 64, "nchw"))
    tuned["b"].set_backend("unrolled", UnrolledConfig(8, 64, "nchw"))
    for faster, kept in (("nchw", []), ("batch-innermost", ["a", "c"])):
        timer = ScriptedTimer({"model:nchw outputs": 2.0, "model:batch-innermost outputs": 1.0})
        timer.ms[f"model:{faster} outputs"] = 0.5
        assert keep_batch_inner_outputs(gm, lambda: None, tuned, timer)[0] == kept
        assert tuned["b"].config.out_layout == tuned["d"].config.out_layout == "batch_inner"
        assert (tuned["b"].backend, tuned["b"].config.bk) == ("unrolled", 8)


@needs_interpreter
def test_candidates_look_through_max_pools_and_end_at_average_pools():
    _, gm, tuned = _batch_model("ab", PooledChain())
    assert batch_inner_candidates(gm, tuned) == ["a", "b"]  # a feeds b through a max pool; b the average pool
    _, gm, tuned = _batch_model("ab", PooledChain(flat_pool=True))
    assert batch_inner_candidates(gm, tuned) == ["a"]  # b's max pool output is flattened
    _, gm, tuned = _batch_model("b", PooledChain())
    assert batch_inner_candidates(gm, tuned) == ["b"]


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("model_class, layers", [(PooledChain, "ab"), (Branches, "abc")],
                         ids=["through-a-max-pool", "through-a-concatenation"])
def test_batch_innermost_outputs_leave_the_outputs_unchanged(model_class, layers):
    model, gm, tuned = _batch_model(layers, model_class())
    x = torch.randn(4, 3, 9, 9)
    with torch.no_grad():
        timer = ScriptedTimer({"model:nchw outputs": 2.0, "model:batch-innermost outputs": 1.0})
        assert keep_batch_inner_outputs(gm, lambda: gm(x), tuned, timer)[0] == list(layers)
        assert relative_error(gm(x), model(x)) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("inner_faster", [True, False])
@pytest.mark.slow
def test_kept_only_when_faster_and_outputs_unchanged(inner_faster):
    model, gm, tuned = _batch_model("abcd")
    x = torch.randn(4, 3, 9, 9)
    with torch.no_grad():
        want = model(x)
        timer = ScriptedTimer({"model:nchw outputs": 2.0, "model:batch-innermost outputs": 1.0 if inner_faster else 3.0})
        set_tuning_layout(tuned["d"])  # as while tuning: d writes batch-innermost, and is reset
        assert tuned["d"].config.out_layout == "batch_inner"
        changed, times = keep_batch_inner_outputs(gm, lambda: gm(x), tuned, timer)
        assert timer.seen == ["model:nchw outputs", "model:batch-innermost outputs"]
        assert times == {"nchw": 2.0, "batch_inner": 1.0 if inner_faster else 3.0}
        assert changed == (["a", "b", "c"] if inner_faster else [])
        layouts = [tuned[name].config.out_layout for name in "abcd"]
        assert layouts == (["batch_inner"] * 3 + ["nchw"] if inner_faster else ["nchw"] * 4)
        assert relative_error(gm(x), want) < 1e-5


class Inception(nn.Module):
    """1x1 siblings a and b read x (merged into one layer); b feeds a 3x3 conv c; a's output and c's
    are concatenated and feed d, then a global average pool."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 6, 1)
        self.c = nn.Conv2d(6, 5, 3, padding=1)
        self.d = nn.Conv2d(9, 8, 1)
        self.avg = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), torch.relu(self.c(torch.relu(self.b(x))))], 1)
        return torch.flatten(self.avg(self.d(y)), 1)


@needs_interpreter
@pytest.mark.slow
def test_candidates_look_through_a_merged_layers_channel_slices():
    from sparsecnn.backends.direct.kernel import DirectConfig

    torch.manual_seed(0)
    model = Inception().eval()
    x = torch.randn(4, 3, 9, 9)
    gm = prepare_for_inference(model, example_inputs=(x,))
    layers = dict(gm.named_modules())
    names = ["merged__a__b", "c", "d"]
    for name in names:
        layers[name].set_backend("direct", DirectConfig(128, 1, 4, 1, 1, "batch", 16))
    tuned = {name: layers[name] for name in names}
    assert batch_inner_candidates(gm, tuned) == names
    with torch.no_grad():
        timer = ScriptedTimer({"model:nchw outputs": 2.0, "model:batch-innermost outputs": 1.0})
        assert keep_batch_inner_outputs(gm, lambda: gm(x), tuned, timer)[0] == names
        assert relative_error(gm(x), model(x)) < 1e-5
    layers["c"].set_backend("dense", None)
    assert batch_inner_candidates(gm, {n: layers[n] for n in names}) == ["d"]  # b's slice feeds a dense c


class Stem(nn.Module):
    """a -> ReLU -> max pool -> b -> ReLU -> c: ResNet's stem and first conv in miniature."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.b = nn.Conv2d(16, 16, 3, padding=1)
        self.c = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.pool(torch.relu(self.a(x))))))


def _stem(b_backend, device="cpu", dtype=torch.float32):
    """The traced `Stem` on NCHW input of 2 x 3 x 10 x 10, every conv on `dense` (NCHW in, NCHW out)
    but b on `b_backend`; returns (model, input, tuned layers)."""
    torch.manual_seed(0)
    model = Stem().eval()
    with torch.no_grad():
        for conv in (model.a, model.b, model.c):
            conv.weight.mul_(torch.rand_like(conv.weight) > 0.5)
    model = model.to(device, dtype)
    x = torch.randn(2, 3, 10, 10, device=device, dtype=dtype)
    gm = prepare_for_inference(model, example_inputs=(x,))
    tuned = {name: gm.get_submodule(name) for name in "abc"}
    tuned["b"].set_backend(b_backend, None)
    return gm, x, tuned


@needs_interpreter
@pytest.mark.parametrize("b_backend, candidates", [("tensorcore", ["a"]), ("dense", [])])
def test_channels_last_candidates_write_nchw_before_a_channels_last_reader(b_backend, candidates):
    gm, x, tuned = _stem(b_backend)
    with torch.no_grad():
        assert channels_last_candidates(gm, lambda: gm(x), tuned) == candidates
        assert channels_last_candidates(gm, lambda: gm(x), {"b": tuned["b"]}) == []  # a is not tuning's


@needs_interpreter
@pytest.mark.parametrize("faster", [True, False])
def test_channels_last_outputs_kept_only_when_faster_and_outputs_unchanged(faster):
    gm, x, tuned = _stem("tensorcore")
    tuned["c"].channels_last_output = True  # left from before: tuning decides anew
    with torch.no_grad():
        before = gm(x)
        timer = ScriptedTimer({"model:channels_last a": 0.9 if faster else 0.999})
        kept, ms = keep_channels_last_outputs(gm, lambda: gm(x), tuned, timer, 1.0, 0.005)
        assert timer.seen == ["model:channels_last a"]
        assert (kept, ms) == ((["a"], 0.9) if faster else ([], 1.0))
        assert [tuned[name].channels_last_output for name in "abc"] == [faster, False, False]
        pooled = tuned["a"](x)
        assert pooled.is_contiguous(memory_format=torch.channels_last) == faster
        assert relative_error(gm(x), before) < 1e-6


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_half_precision_channels_last_output_feeds_tensorcore_unchanged():
    gm, x, tuned = _stem("tensorcore", "cuda", torch.float16)
    with torch.no_grad():
        before = gm(x)
        assert channels_last_candidates(gm, lambda: gm(x), tuned) == ["a"]
        kept, _ = keep_channels_last_outputs(gm, lambda: gm(x), tuned, ScriptedTimer({"model:channels_last a": 0.5}),
                                             1.0, 0.005)
        assert kept == ["a"] and tuned["a"](x).is_contiguous(memory_format=torch.channels_last)
        assert relative_error(gm(x), before) < 1e-3  # fp16: the same kernels on the same values
