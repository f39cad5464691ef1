"""Max pooling without indices (kernels/triton/pool.py, nn.pool, the fx swap).

A max involves no rounding, so every output must equal F.max_pool2d's bitwise, in every layout
and dtype; the output must keep the input's memory layout. CPU runs of the kernel need Triton's
interpreter; the `gpu` tests repeat them on CUDA and add torch.compile and CUDA graphs.
"""
import pytest
import torch
import torch.nn.functional as F
from helpers.common import needs_interpreter
from torch import nn

from sparsecnn.core.pool_args import PoolArgs, memory_order
from sparsecnn.nn.pool import MaxPool2d, max_pool2d
from sparsecnn.passes.fuse import prepare_for_inference

gpu = pytest.mark.gpu
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# (kernel_size, stride, padding, dilation, ceil_mode): GoogLeNet's and ResNet's pools, VGG's 2x2,
# rectangular and dilated windows, and ceil_mode windows that start in the right padding.
POOLS = [(3, 2, 0, 1, True), (3, 1, 1, 1, True), (2, 2, 0, 1, False), (3, 2, 1, 1, False),
         ((3, 2), (2, 1), (1, 0), (1, 2), True), (2, 2, 1, 1, True), (5, 3, 2, 1, False)]
LAYOUTS = ["nchw", "channels_last", "batch_inner", "sliced"]


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "batch_inner":
        return x.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)
    if layout == "sliced":  # not dense in any order: the kernel reads a contiguous copy
        return torch.cat([x, x], dim=3)[..., ::2]
    return x.contiguous()


def activation(shape=(3, 5, 13, 11), dtype=torch.float32, device="cpu", seed=0):
    """Random values with ties, negatives and an all-negative region (never all zeros)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).round(decimals=1)
    x[:, :, :4, :4] -= 10.0
    return x.to(device=device, dtype=dtype)


def expected_order(layout: str, x: torch.Tensor):
    return (0, 1, 2, 3) if layout in ("nchw", "sliced") else memory_order(x)


def check_pool(device, dtype, pool, layout, config=None):
    from sparsecnn.core.max_pool import DEFAULT
    from sparsecnn.core.max_pool import max_pool2d as triton_max_pool2d

    x = laid_out(activation(dtype=dtype, device=device), layout)
    y = triton_max_pool2d(x, PoolArgs.of(*pool), config or DEFAULT)
    want = F.max_pool2d(x.float(), *pool[:4], ceil_mode=pool[4]).to(dtype)
    assert y.shape == want.shape and torch.equal(y, want)
    assert memory_order(y) == expected_order(layout, x) and y.permute(memory_order(y)).is_contiguous()


@pytest.mark.quick_sample(8)
@needs_interpreter
@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_equals_torch_in_every_layout(pool, layout):
    check_pool("cpu", torch.float32, pool, layout)


@pytest.mark.quick_sample(2)
@needs_interpreter
@pytest.mark.parametrize("config_index", range(4))
def test_every_config(config_index):
    from sparsecnn.core.max_pool import CONFIGS

    for layout in ("nchw", "batch_inner"):
        check_pool("cpu", torch.float32, POOLS[0], layout, CONFIGS[config_index])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    check_pool("cpu", dtype, POOLS[1], "channels_last")


@needs_interpreter
def test_nan_and_infinity_propagate_as_in_torch():
    from sparsecnn.core.max_pool import max_pool2d as triton_max_pool2d

    x = activation()
    x[0, 0, 5, 5] = float("nan")
    x[1, 2, 0, 0] = float("inf")
    x[2, 1, :, :] = float("-inf")
    y = triton_max_pool2d(x, PoolArgs.of(3, 1, 1, 1, True))
    assert torch.equal(y.isnan(), F.max_pool2d(x, 3, 1, 1, ceil_mode=True).isnan()) and y.isnan().sum() == 9
    finite = ~y.isnan()
    assert torch.equal(y[finite], F.max_pool2d(x, 3, 1, 1, ceil_mode=True)[finite])


@needs_interpreter
def test_kernel_rejects_bad_input():
    from sparsecnn.core.max_pool import PoolConfig
    from sparsecnn.core.max_pool import max_pool2d as triton_max_pool2d

    args = PoolArgs.of(3, 2)
    with pytest.raises(TypeError, match="dtype"):
        triton_max_pool2d(torch.ones(1, 2, 5, 5, dtype=torch.int32), args)
    with pytest.raises(ValueError, match="4-D"):
        triton_max_pool2d(torch.ones(2, 5, 5), args)
    with pytest.raises(ValueError, match="too small"):
        triton_max_pool2d(torch.ones(1, 2, 2, 2), args)
    with pytest.raises(ValueError, match="grid y"):
        triton_max_pool2d(torch.empty(1, 1, 6000, 6000), PoolArgs.of(1))  # refused before any launch
    with pytest.raises(ValueError, match="block"):
        PoolConfig(100, 4)
    with pytest.raises(ValueError, match="32 \\* num_warps"):
        PoolConfig(128, 8)


def test_pool_args_are_checked_as_torch_checks_them():
    assert PoolArgs.of(3) == PoolArgs((3, 3), (3, 3), (0, 0), (1, 1), False)  # stride defaults to the kernel
    assert PoolArgs.of(3, []).stride == (3, 3)
    with pytest.raises(ValueError, match="padding"):
        PoolArgs.of(3, 1, 2)
    with pytest.raises(ValueError, match="stride"):
        PoolArgs.of(3, 0)
    with pytest.raises(ValueError, match="kernel_size"):
        PoolArgs.of((3, 3, 3))
    for pool in POOLS:  # torch's output sizes, ceil_mode's dropped last window included
        for h, w in [(13, 11), (14, 7), (5, 6)]:
            x = torch.empty(1, 1, h, w)
            assert PoolArgs.of(*pool).output_hw(h, w) == F.max_pool2d(x, *pool[:4], ceil_mode=pool[4]).shape[2:]


class Pools(nn.Module):
    """Module pools, a functional pool, and two pools that must stay torch's (they return indices)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.indexed = nn.MaxPool2d(2, return_indices=True)

    def forward(self, x):
        x = F.max_pool2d(self.pool(torch.relu(self.conv(x))), 2, 1, 1)
        values, indices = self.indexed(x)
        values2, _ = F.max_pool2d(x, 2, return_indices=True)
        return values + values2 + indices.float()


def test_prepare_for_inference_swaps_pools_without_indices():
    model = Pools().eval()
    x = activation((2, 3, 17, 15))
    gm = prepare_for_inference(model)
    assert gm.fuse_report.swapped_pools == ["pool", "max_pool2d"]
    assert gm.fuse_report.fused_pools == ["conv"]   # the first pool is the conv's only use; a conv ends in one pool
    assert gm.conv.pool == PoolArgs.of(3, 2, ceil_mode=True) and type(gm.indexed) is nn.MaxPool2d
    assert [node.target for node in gm.graph.nodes if node.op == "call_function"].count(max_pool2d) == 1
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    with pytest.raises(ValueError, match="return_indices"):
        MaxPool2d.from_module(model.indexed)


def test_a_layers_pool_survives_its_state_dict_and_shows_in_its_repr():
    gm = prepare_for_inference(Pools().eval())
    copy = prepare_for_inference(Pools().eval())
    copy.conv.pool = None
    copy.load_state_dict(gm.state_dict())
    assert copy.conv.pool == gm.conv.pool and "max_pool(kernel_size=(3, 3), stride=(2, 2))" in repr(copy.conv)
    with pytest.raises(ValueError, match="residual"):
        gm.conv(activation((2, 3, 17, 15)), torch.zeros(2, 4, 15, 13))


def test_functional_pool_falls_back_off_cuda():
    x = activation()
    assert torch.equal(max_pool2d(x, 3, 2, ceil_mode=True), F.max_pool2d(x, 3, 2, ceil_mode=True))
    values, indices = max_pool2d(x, 2, return_indices=True)
    assert torch.equal(indices, F.max_pool2d(x, 2, return_indices=True)[1])


# --- GPU ------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_kernel_equals_torch(dtype, layout):
    for pool in POOLS:
        check_pool("cuda", dtype, pool, layout)


@gpu
def test_gpu_every_config_on_a_googlenet_shape():
    from sparsecnn.core.max_pool import CONFIGS
    from sparsecnn.core.max_pool import max_pool2d as triton_max_pool2d

    x = activation((32, 192, 28, 28), device="cuda")
    for config in CONFIGS:
        assert torch.equal(triton_max_pool2d(laid_out(x, "batch_inner"), PoolArgs.of(3, 1, 1, 1, True), config),
                           F.max_pool2d(x, 3, 1, 1, ceil_mode=True))


@gpu
def test_gpu_module_under_compile_and_cuda_graphs():
    pool = MaxPool2d(3, 2, ceil_mode=True)
    x = laid_out(activation((4, 8, 13, 11), device="cuda"), "batch_inner")
    want = F.max_pool2d(x, 3, 2, ceil_mode=True)
    assert torch.equal(pool(x), want) and memory_order(pool(x)) == memory_order(x)
    assert torch.equal(torch.compile(pool, fullgraph=True)(x), want)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    pool(static)  # binds the launch before capture
    with torch.cuda.graph(graph):
        out = pool(static)
    static.copy_(x * 2)
    graph.replay()
    assert torch.equal(out, F.max_pool2d(x * 2, 3, 2, ceil_mode=True))
