"""Backend `tensorcore`: the unit format, configs, the kernel against the fp64 reference, the op.

The kernel runs on CPU through Triton's interpreter (TRITON_INTERPRET=1, as `make test` sets) on tiny
odd shapes, and, marked `gpu`, on CUDA in every dtype with every config the tuner can pick.
"""
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers.common import INTERPRET, needs_cuda, needs_interpreter
from helpers.triton_compiles import run_compiling, specialization

from sparsecnn.backends import get_backend
from sparsecnn.backends.tensorcore.format import code_row, pack_units, padded_work, support_order
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_ahead import epilogues
from sparsecnn.nn import SparseConv2d

gpu = pytest.mark.gpu

if INTERPRET or torch.cuda.is_available():
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, auto_configs, candidate_configs, unit_conv

# Triton's interpreter converts a tensor loop bound with int() on a 1-element array (numpy warns).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def unit_weight(K, C, R, S, group, chunk, keep=0.3, seed=0, scatter=0.0):
    """A (K, C, R, S) weight whose rows, in groups of `group` (after a random channel shuffle),
    share kept units of `chunk` channels at one tap; `scatter`: extra unstructured non-zeros."""
    gen = torch.Generator().manual_seed(seed)
    groups, chunks = -(-K // group), -(-C // chunk)
    kept = torch.rand(groups, chunks, R, S, generator=gen) < keep
    mask = kept[:, None, :, None].expand(groups, group, chunks, chunk, R, S)
    mask = mask.reshape(groups * group, chunks * chunk, R, S)[:K, :C]
    mask = mask[torch.randperm(K, generator=gen)] | (torch.rand(K, C, R, S, generator=gen) < scatter)
    return torch.randn(K, C, R, S, generator=gen) * mask


def inputs(shape, seed=1, device="cpu", dtype=torch.float32):
    """Random, never all zeros, shifted so that ReLU keeps some outputs and zeroes others."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) + 0.1).to(device=device, dtype=dtype)


def unpack(packed):
    """The dense (K, C, R, S) weight a `UnitWeights` holds."""
    K, C, R, S = packed.kernel_shape
    chunks = -(-C // packed.chunk)
    dense = torch.zeros(packed.num_groups * packed.group, chunks * packed.chunk, R * S, dtype=packed.values.dtype)
    for g in range(packed.num_groups):
        for u in range(int(packed.group_start[g]), int(packed.group_start[g + 1])):
            c0 = int(packed.unit_chunk[u]) * packed.chunk
            rows = slice(g * packed.group, (g + 1) * packed.group)
            dense[rows, c0:c0 + packed.chunk, int(packed.unit_tap[u])] += packed.values[u].T
    out = torch.zeros(K, C, R * S, dtype=dense.dtype)
    channels = packed.out_channel.long()
    out[channels[channels >= 0]] = dense[channels >= 0][:, :C]
    return out.reshape(K, C, R, S)


def expected(x, weight, bias, stride, padding, relu=False, residual=None):
    y = reference_conv(x, weight, bias, stride=stride, padding=padding, fp64=True)
    y = y if residual is None else y + residual.double()
    return y.clamp(min=0) if relu else y


# --- format ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("K,C,R,group,chunk", [(33, 3, 3, 16, 8), (64, 20, 1, 32, 16), (17, 40, 5, 16, 32),
                                               (128, 64, 3, 64, 64)])
@pytest.mark.parametrize("order", ["index", "support", "shuffled"])
def test_pack_units_holds_the_weight_exactly(K, C, R, group, chunk, order):
    weight = unit_weight(K, C, R, R, group, chunk, scatter=0.02)
    if order == "shuffled":
        order = torch.randperm(K, generator=torch.Generator().manual_seed(1)).tolist()
    packed = pack_units(weight, group, chunk, order)
    assert torch.equal(unpack(packed), weight)
    assert packed.values.shape == (packed.num_units, chunk, group)
    assert packed.group_start[0] == 0 and packed.group_start[-1] == packed.num_units
    assert torch.all(packed.group_start[1:] >= packed.group_start[:-1])
    assert packed.permuted == (packed.out_channel[:K].tolist() != list(range(K)))
    assert packed.order == (order if isinstance(order, str) else "given")
    assert_unit_code_rows_list_the_units(packed)


def assert_unit_code_rows_list_the_units(packed):
    """Row g of the kernels' `unit_code` table holds group g's ranged units in order, then zeros."""
    assert packed.unit_code.shape == (packed.num_groups, code_row(packed.max_units))
    assert packed.unit_code.dtype == torch.int32
    for g in range(packed.num_groups):
        start, end = int(packed.group_start[g]), int(packed.group_start[g + 1])
        row = packed.unit_code[g]
        assert torch.equal(row[:end - start] & 0xFFFF, packed.unit_tap[start:end])
        assert torch.equal(row[:end - start] >> 16, packed.unit_chunk[start:end])
        assert not row[end - start:].any()


def test_support_order_keeps_whole_groups_after_a_split_tile():
    """A tile split in two (as re-pruning does to meet its count exactly) goes last, so the whole
    tiles still start at group boundaries."""
    weight = unit_weight(96, 64, 3, 3, 32, 16, keep=0.2, seed=5)
    channel = support_order(weight, 16, 32)[0]
    kept = weight[channel].reshape(4, 16, 9).ne(0).any(dim=1).nonzero()[0].tolist()  # one of its units
    free = (~weight[channel].reshape(4, 16, 9).ne(0).any(dim=1)).nonzero()[0].tolist()  # one it lacks
    weight[channel, kept[0] * 16:(kept[0] + 1) * 16, kept[1] // 3, kept[1] % 3] = 0.0
    weight[channel, free[0] * 16:(free[0] + 1) * 16, free[1] // 3, free[1] % 3] = 1.0
    packed = pack_units(weight, 32, 16, "support")
    wasted = packed.num_units * 32 * 16 - int(weight.ne(0).sum())
    assert wasted == 32 * 16  # one unit on every row of the split tile's group; the whole tiles waste nothing


def test_support_order_keeps_the_identity_for_tiles_in_channel_order():
    """Tiles that are runs of whole groups in channel order need no permutation (no scattered stores)."""
    gen = torch.Generator().manual_seed(6)
    kept = (torch.rand(3, 4, 3, 3, generator=gen) < 0.3).repeat_interleave(32, 0).repeat_interleave(16, 1)
    weight = torch.randn(96, 64, 3, 3, generator=gen) * kept
    assert support_order(weight, 16, 32) == list(range(96))
    assert not pack_units(weight, 32, 16, "support").permuted


def test_support_order_recovers_the_tiles_of_a_unit_pruning():
    """Rows that share their units (a re-pruning's tiles, shuffled) come out as whole groups: every
    kept unit is dense, no MMA work is spent on zeros."""
    weight = unit_weight(96, 64, 3, 3, 32, 16, keep=0.2, seed=4)
    packed = pack_units(weight, 32, 16, "support")
    assert packed.num_units * 32 * 16 == int(weight.ne(0).sum())
    unordered = pack_units(weight, 32, 16)
    assert unordered.num_units > packed.num_units


def test_all_zero_and_dense_weights():
    zero = pack_units(torch.zeros(33, 3, 3, 3), 16, 16)
    assert zero.num_units == 0 and zero.group_start.tolist() == [0, 0, 0, 0]
    assert zero.unit_code.tolist() == [[0], [0], [0]]
    dense = pack_units(torch.randn(33, 3, 3, 3) + 5, 16, 16)
    assert dense.num_units == 3 * 9  # three groups, one chunk, nine taps
    assert_unit_code_rows_list_the_units(dense)


def test_pack_units_rejects_bad_arguments():
    with pytest.raises(ValueError, match="permutation"):
        pack_units(torch.randn(4, 3, 3, 3), 16, 16, [0, 1, 1, 3])
    with pytest.raises(ValueError, match=r"\(K, C, R, S\)"):
        pack_units(torch.randn(4, 3, 3), 16, 16)
    with pytest.raises(ValueError, match="order must be one of"):
        pack_units(torch.randn(4, 3, 3, 3), 16, 16, "similar")
    with pytest.raises(ValueError, match="more than a unit code holds"):
        pack_units(torch.randn(1, 1, 182, 182), 16, 16)


# --- configs --------------------------------------------------------------------------------------

@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="imports triton")
def test_config_checks_and_candidates():
    config = TensorCoreConfig()
    assert TensorCoreConfig.from_dict(dataclasses.asdict(config)) == config
    for field, bad in [("order", "given"), ("group", 24), ("chunk", 8), ("block_m", 48), ("num_warps", 2), ("num_stages", 1),
                       ("precision", "tf32x2"), ("group", True), ("loads", "cp.async")]:
        with pytest.raises(ValueError, match=f"TensorCoreConfig.{field}"):
            TensorCoreConfig(**{field: bad})
    with pytest.raises(ValueError, match="block_m must be one of .64, 128. with loads='tma'"):
        TensorCoreConfig(block_m=32, loads="tma")
    with pytest.raises(ValueError, match="unknown keys"):
        TensorCoreConfig.from_dict({"group": 64, "tiles": 3})
    small = candidate_configs(ConvSpec(1, 3, 33, 13, 13, 3, 3), torch.float16)
    assert small and all(c.group <= 64 and c.chunk == 16 for c in small)
    assert len(set(small)) == len(small)
    large = candidate_configs(ConvSpec(1, 256, 256, 14, 14, 3, 3), torch.float16)
    assert {c.packing[:2] for c in large} == {(64, 32), (64, 64), (32, 32), (64, 16), (128, 32)}
    assert {c.order for c in large} == {"support", "index"}
    assert {(c.loads, c.order) for c in large if c.loads == "tma"} == {("tma", "index")}
    strided = candidate_configs(ConvSpec(1, 256, 256, 14, 14, 3, 3, 2, 1), torch.float16)
    assert {c.loads for c in strided} == {"pointer"}  # TMA boxes step one pixel
    fp32 = candidate_configs(ConvSpec(1, 256, 256, 14, 14, 3, 3), torch.float32)
    assert {c.packing[:2] for c in fp32 if c.loads == "tma"} == {(32, 32)}  # box rows of at most 128 bytes


def test_unit_slots_hold_a_group_in_a_power_of_two_up_to_64():
    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("imports triton")
    from sparsecnn.backends.tensorcore.tma_kernel import unit_slots

    assert [unit_slots(n) for n in (0, 1, 2, 3, 9, 64, 65, 300)] == [1, 1, 2, 4, 16, 64, 0, 0]

@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="imports triton")
def test_auto_configs_one_launch_per_packing_and_tf32_only_for_fp32():
    spec = ConvSpec(32, 256, 256, 56, 56, 3, 3, 1, 1)  # 1,568 pixel tiles of 64: more than any GPU has SMs
    half = auto_configs(spec, torch.float16)
    index_packings = {c.packing for c in candidate_configs(spec, torch.float16) if c.order == "index"}
    assert len(half) == 5 and {c.packing for c in half} == index_packings
    assert all(c.precision == "ieee" and c.loads == "pointer" and c.unroll == 1 for c in half)
    assert {c.precision for c in auto_configs(spec, torch.float32)} == {"tf32", "tf32x3"}


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="imports triton")
def test_few_pixel_tiles_add_the_unrolled_launch_per_packing():
    spec = ConvSpec(1, 256, 256, 14, 14, 3, 3, 1, 1)  # 4 pixel tiles of 64
    half = auto_configs(spec, torch.float16)
    unrolled = [c for c in half if c.unroll > 1]
    assert len(half) == 10 and {c.packing for c in unrolled} == {c.packing for c in half if c.unroll == 1}
    assert all(c.unroll == 4 and c.order == "index" for c in unrolled)
    assert set(unrolled) <= set(candidate_configs(spec, torch.float16))


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="imports triton")
def test_unrolled_launches_fit_shared_memory():
    """fp32 operands of the wide packings at 4 units x 3 stages pass shared memory (the 64 x 64
    packing failed to launch on an H200); they are not offered, the fp16 ones are."""
    from sparsecnn.core import device

    limit = device.resolve(None).max_shared_per_block_optin
    spec = ConvSpec(1, 256, 256, 14, 14, 3, 3, 1, 1)
    for dtype, itemsize in ((torch.float32, 4), (torch.float16, 2)):
        unrolled = [c for c in candidate_configs(spec, dtype) if c.unroll > 1]
        assert unrolled
        for c in unrolled:
            assert c.num_stages * c.unroll * (c.block_m * c.chunk + c.chunk * c.group) * itemsize <= limit
    def unrolled_packings(dtype):
        return {c.packing[:2] for c in candidate_configs(spec, dtype) if c.unroll > 1}

    assert (64, 64) not in unrolled_packings(torch.float32)  # 384 KB by the bound
    assert ((64, 64) in unrolled_packings(torch.float16)) == (limit >= 192 * 1024)  # Hopper: 227 KB


def test_tuner_offers_tensorcore_tf32_only_where_tf32_is_allowed_and_3xtf32_under_every_fp32_policy():
    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("imports triton")
    from sparsecnn.tuning.precision import POLICIES
    from sparsecnn.tuning.select import candidates_for

    spec = ConvSpec(32, 256, 256, 56, 56, 3, 3, 1, 1)
    def picked(policy):
        return [c.config for c in candidates_for(spec, POLICIES[policy], "cuda") if c.backend == "tensorcore"]
    assert {c.precision for c in picked("fp32")} == {"tf32x3"} and len(picked("fp32")) == 5
    assert {c.precision for c in picked("tf32")} == {"tf32", "tf32x3"} and len(picked("tf32")) == 10
    assert len(picked("fp16")) == 5


# --- kernel on the CPU (interpreter) -------------------------------------------------------------

ODD_SHAPES = [  # (N, C, K, H, W, R, stride, padding)
    (2, 3, 33, 13, 11, 3, 1, 1), (1, 3, 33, 13, 13, 3, 2, 0), (2, 20, 17, 9, 7, 1, 1, 0),
    (1, 8, 40, 13, 13, 5, 3, 2), (1, 16, 16, 7, 9, 7, 1, 3), (0, 8, 16, 5, 5, 3, 1, 1),
    (1, 12, 24, 6, 6, 3, 2, 3),
]


@needs_interpreter
@pytest.mark.parametrize("N,C,K,H,W,R,stride,padding", ODD_SHAPES)
def test_kernel_matches_fp64_on_odd_shapes(N, C, K, H, W, R, stride, padding):
    config = TensorCoreConfig(group=16, chunk=16, block_m=32)
    weight = unit_weight(K, C, R, R, 16, 16, keep=0.4, scatter=0.05)
    packed = pack_units(weight, 16, 16, "support")
    x, bias = inputs((N, C, H, W)), torch.randn(K)
    y = unit_conv(x, packed, (stride, stride), (padding, padding), config, bias=bias)
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref = expected(x, weight, bias, stride, padding)
    assert y.shape == ref.shape
    if N:
        assert relative_error(y, ref) < 1e-5


@pytest.mark.quick_sample(2)
@needs_interpreter
@pytest.mark.parametrize("config", [TensorCoreConfig(g, c, m, w, s, order=o) for g, c, m, w, s, o in
                                    [(16, 16, 32, 4, 3, "support"), (32, 16, 64, 4, 3, "index"),
                                     (64, 16, 32, 8, 2, "support"), (16, 32, 128, 4, 3, "index"),
                                     (32, 64, 32, 4, 3, "support")]]
                         + [TensorCoreConfig(16, 16, 32, 4, 3, order="index", unroll=u) for u in (2, 4)], ids=str)
def test_kernel_every_tile_shape_with_residual_and_relu(config):
    N, C, K, H, R = 2, 24, 40, 9, 3
    weight = unit_weight(K, C, R, R, config.group, config.chunk, keep=0.5, scatter=0.05)
    packed = pack_units(weight, *config.packing)
    x, bias = inputs((N, C, H, H)), torch.randn(K)
    residual = inputs((N, K, H, H), seed=5)
    y = unit_conv(x, packed, (1, 1), (1, 1), config, bias=bias, residual=residual, relu=True)
    assert relative_error(y, expected(x, weight, bias, 1, 1, relu=True, residual=residual)) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_3xtf32_configs_run_in_fp32(loads):
    """precision "tf32x3" reaches tl.dot (exact in the interpreter; fp32-level on tensor cores: GPU tests)."""
    config = TensorCoreConfig(group=16, chunk=16, block_m=64, order="index", loads=loads, precision="tf32x3")
    weight = unit_weight(24, 16, 3, 3, 16, 16, keep=0.4)
    x, bias = inputs((2, 16, 9, 9)), torch.randn(24)
    y = unit_conv(x, pack_units(weight, 16, 16, "index"), (1, 1), (1, 1), config, bias=bias, relu=True)
    assert relative_error(y, expected(x, weight, bias, 1, 1, relu=True)) < 1e-5


TMA_SHAPES = [  # (N, C, K, H, W, R, padding): stride 1; C=12 (48-byte rows) is past TMA in fp16 only
    (2, 8, 40, 13, 11, 3, 1), (1, 16, 33, 6, 9, 1, 0), (1, 12, 24, 7, 7, 5, 2), (1, 8, 16, 5, 6, 7, 3),
    (0, 8, 16, 5, 5, 3, 1),
]


@needs_interpreter
@pytest.mark.parametrize("N,C,K,H,W,R,padding", TMA_SHAPES)
def test_tma_kernel_matches_fp64_on_odd_shapes(N, C, K, H, W, R, padding):
    """The TMA path (zero-filled boxes for the padding and past C, stores dropped past P, Q, K),
    with residual and ReLU."""
    config = TensorCoreConfig(group=16, chunk=16, block_m=64, order="index", loads="tma")
    weight = unit_weight(K, C, R, R, 16, 16, keep=0.3)
    packed = pack_units(weight, 16, 16, "index")
    x, bias = inputs((N, C, H, W)), torch.randn(K)
    residual = inputs((N, K, H + 2 * padding - R + 1, W + 2 * padding - R + 1), seed=5)
    y = unit_conv(x, packed, (1, 1), (padding, padding), config, bias=bias, residual=residual, relu=True)
    ref = expected(x, weight, bias, 1, padding, relu=True, residual=residual)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last)
    if N:
        assert relative_error(y, ref) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("unroll", [2, 4])
@pytest.mark.parametrize("N,C,K,H,W,R,stride,padding", [ODD_SHAPES[i] for i in (0, 3, 5, 6)])
def test_unrolled_loop_matches_fp64_on_odd_shapes(N, C, K, H, W, R, stride, padding, unroll):
    """Groups whose unit count is not a multiple of `unroll` (the units past a group's end are
    masked)."""
    config = TensorCoreConfig(group=16, chunk=16, block_m=32, unroll=unroll)
    weight = unit_weight(K, C, R, R, 16, 16, keep=0.3, scatter=0.05, seed=unroll)
    packed = pack_units(weight, 16, 16, "support")
    counts = set((packed.group_start[1:] - packed.group_start[:-1]).tolist())
    assert any(count % unroll for count in counts)
    x, bias = inputs((N, C, H, W)), torch.randn(K)
    y = unit_conv(x, packed, (stride, stride), (padding, padding), config, bias=bias)
    ref = expected(x, weight, bias, stride, padding)
    assert y.shape == ref.shape
    if N:
        assert relative_error(y, ref) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_kernels_load_units_one_by_one_past_64_per_group(loads):
    """A group of 98 units (2 chunks x 7 x 7 taps, all kept) is past the register slots."""
    from sparsecnn.backends.tensorcore.tma_kernel import unit_slots

    weight = unit_weight(16, 32, 7, 7, 16, 16, keep=1.0)
    packed = pack_units(weight, 16, 16, "index")
    assert packed.max_units == 98 and unit_slots(packed.max_units) == 0
    x = inputs((1, 32, 5, 6))
    config = TensorCoreConfig(group=16, chunk=16, block_m=64, order="index", loads=loads,
                              unroll=4 if loads == "pointer" else 1)
    y = unit_conv(x, packed, (1, 1), (3, 3), config)
    assert relative_error(y, expected(x, weight, None, 1, 3)) < 1e-5


@needs_interpreter
def test_tma_config_falls_back_to_the_pointer_kernel_where_tma_cannot_run():
    """Stride 2, C=3 (12-byte rows) and support order run the pointer kernel, with the same result."""
    for C, stride, order in [(8, 2, "index"), (3, 1, "index"), (8, 1, "support")]:
        weight = unit_weight(24, C, 3, 3, 16, 16, keep=0.5, seed=C)
        packed = pack_units(weight, 16, 16, order)
        x = inputs((1, C, 7, 7))
        config = TensorCoreConfig(group=16, chunk=16, block_m=64, order=order, loads="tma")
        y = unit_conv(x, packed, (stride, stride), (1, 1), config)
        assert relative_error(y, expected(x, weight, None, stride, 1)) < 1e-5


@needs_interpreter
def test_kernel_all_zero_and_fully_dense_weights():
    config = TensorCoreConfig(group=16, chunk=16, block_m=32)
    x, bias = inputs((2, 3, 13, 13)), torch.randn(33)
    zero = torch.zeros(33, 3, 3, 3)
    y = unit_conv(x, pack_units(zero, 16, 16), (1, 1), (1, 1), config, bias=bias, relu=True)
    assert torch.equal(y, bias.clamp(min=0).view(1, -1, 1, 1).expand_as(y))
    dense = torch.randn(33, 3, 3, 3)
    y = unit_conv(x, pack_units(dense, 16, 16), (2, 2), (1, 1), config, bias=bias)
    assert relative_error(y, expected(x, dense, bias, 2, 1)) < 1e-5


@needs_interpreter
def test_kernel_refuses_a_config_of_another_packing():
    packed = pack_units(torch.randn(16, 8, 3, 3), 16, 16)
    with pytest.raises(ValueError, match="packing"):
        unit_conv(inputs((1, 8, 5, 5)), packed, (1, 1), (1, 1), TensorCoreConfig(group=32, chunk=16))


@needs_interpreter
def test_backend_prepare_bind_and_sparse_conv2d():
    backend = get_backend("tensorcore")
    spec = ConvSpec(2, 16, 33, 9, 9, 3, 3, 1, 1)
    weight = unit_weight(33, 16, 3, 3, 16, 16, keep=0.3)
    bias = torch.randn(33)
    x = inputs((2, 16, 9, 9))
    ref = expected(x, weight, bias, 1, 1)
    config = TensorCoreConfig(group=16, chunk=16, block_m=32)
    assert backend.config_from_dict(dataclasses.asdict(config)) == config
    packed = backend.prepare(weight, config)
    last = int(packed.group_start[-1] - packed.group_start[-2])  # units of the one-channel group (33 = 2 * 16 + 1)
    assert packed.num_units * 16 * 16 - int(weight.ne(0).sum()) == 15 * 16 * last  # groups found again
    assert relative_error(backend.run(x, packed, bias, spec, config), ref) < 1e-5
    with pytest.raises(ValueError, match="packing"):
        backend.bind(packed, spec, TensorCoreConfig(group=32, chunk=16), torch.float32, True)
    conv = torch.nn.Conv2d(16, 33, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    module = SparseConv2d.from_dense(conv, backend="tensorcore", config=config)
    with torch.no_grad():
        assert relative_error(module(x), ref) < 1e-5
    assert module.fallback_reason is None


@needs_interpreter
def test_op_passes_opcheck():
    backend = get_backend("tensorcore")
    spec = ConvSpec(2, 8, 16, 5, 6, 3, 3, 1, 1)
    config = TensorCoreConfig(group=16, chunk=16, block_m=32)
    call = backend.bind(backend.prepare(unit_weight(16, 8, 3, 3, 16, 16), config), spec, config, torch.float32, True)
    x, bias, residual = inputs((2, 8, 5, 6)), torch.randn(16), inputs((2, 16, 5, 6), seed=2)
    args = (x, *call.tensors, bias, residual, *call.static, True)
    torch.library.opcheck(torch.ops.sparsecnn.tensorcore_conv2d.default, args)


@needs_interpreter
def test_shortcut_op_passes_opcheck():
    backend = get_backend("tensorcore")
    spec = ConvSpec(2, 16, 16, 5, 6, 1, 1)
    config = TensorCoreConfig(group=16, chunk=16, block_m=32, order="index")
    packed = backend.prepare_shortcut(unit_weight(16, 16, 1, 1, 16, 16), unit_weight(16, 8, 1, 1, 16, 16), config)
    call = backend.bind_shortcut(packed, spec, config, torch.float32, True, (2, 2))
    x, bias, shortcut = inputs((2, 16, 5, 6)), torch.randn(16), inputs((2, 8, 9, 11), seed=2)
    args = (x, *call.tensors, bias, shortcut, *call.static, True)
    torch.library.opcheck(torch.ops.sparsecnn.tensorcore_shortcut_conv2d.default, args)
    assert backend.prepare_shortcut(unit_weight(16, 24, 1, 1, 16, 16), unit_weight(16, 8, 1, 1, 16, 16),
                                    config) is None  # C = 24 is not a multiple of the chunk
    assert backend.prepare_shortcut(unit_weight(16, 16, 1, 1, 16, 16), unit_weight(16, 8, 1, 1, 16, 16),
                                    dataclasses.replace(config, order="support")) is None


# --- GPU ------------------------------------------------------------------------------------------

GPU_MODES = [(torch.float32, "ieee"), (torch.float32, "tf32"), (torch.float32, "tf32x3"), (torch.float16, "ieee"),
             (torch.bfloat16, "ieee")]
GPU_SHAPES = [  # (N, C, K, H, R, stride, padding)
    (3, 3, 33, 13, 3, 1, 1), (1, 24, 40, 13, 1, 2, 0), (2, 64, 96, 14, 3, 2, 1), (1, 32, 33, 9, 7, 1, 3),
    (2, 48, 64, 11, 5, 3, 2), (0, 16, 16, 7, 3, 1, 1),
]


def tf32_rounding_error(x, weight, bias, stride, padding):
    """Error against fp64 of the exact conv of x and weight truncated to TF32 (10-bit mantissa)."""
    def to_tf32(t):
        return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)

    return relative_error(expected(to_tf32(x), to_tf32(weight), bias, stride, padding),
                          expected(x, weight, bias, stride, padding))


def gpu_limit(x, weight, bias, stride, padding, precision):
    """fp32 exact and 3xTF32: 1e-5; TF32: 2x the TF32 rounding's own error; fp16/bf16: 2x cuDNN's own error."""
    if x.dtype == torch.float32 and precision in ("ieee", "tf32x3"):
        return 1e-5
    if x.dtype == torch.float32:
        return 2 * tf32_rounding_error(x, weight, bias, stride, padding) + 1e-5
    torch.backends.cudnn.allow_tf32 = False
    own = relative_error(F.conv2d(x, weight, bias, stride, padding), expected(x, weight, bias, stride, padding))
    return 2 * own + 1e-5


def gpu_spec(shape):
    """The ConvSpec of a GPU test shape (N, C, K, H, R, stride, padding), square, N at least 1 (the
    configs a layer is offered do not depend on N)."""
    N, C, K, H, R, stride, padding = shape
    return ConvSpec(max(N, 1), C, K, H, H, R, R, stride, padding)


def check_gpu_layer(shape, dtype, config, epilogues):
    N, C, K, H, R, stride, padding = shape
    spec = ConvSpec(N, C, K, H, H, R, R, stride, padding)
    x = inputs((N, C, H, H), device="cuda", dtype=dtype)
    bias = torch.randn(K, device="cuda").to(dtype)
    residual = inputs((N, K, spec.P, spec.Q), seed=7, device="cuda", dtype=dtype)
    backend = get_backend("tensorcore")
    weight = unit_weight(K, C, R, R, config.group, config.chunk, keep=0.3, scatter=0.02).cuda().to(dtype)
    packed = backend.prepare(weight, config)
    for relu, with_residual in epilogues:
        res = residual if with_residual else None
        ref = expected(x, weight, bias, stride, padding, relu, res)
        torch.empty(ref.numel() * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)  # poison
        y = backend.run(x, packed, bias, spec, config, relu=relu, residual=res)
        assert y.shape == ref.shape
        if N:
            limit = gpu_limit(x, weight, bias, stride, padding, config.precision)
            assert relative_error(y, ref) <= limit, (config, relu)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,precision", GPU_MODES, ids=str)
def test_gpu_every_candidate_config(dtype, precision):
    """Every config the tuner may pick (all packings on this layer), with residual and ReLU."""
    shape = (2, 64, 96, 14, 3, 2, 1)
    configs = candidate_configs(gpu_spec(shape), dtype)
    for config in dict.fromkeys(dataclasses.replace(c, precision=precision) for c in configs):
        check_gpu_layer(shape, dtype, config, [(True, True)])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,precision", GPU_MODES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_odd_shapes(shape, dtype, precision):
    config = candidate_configs(gpu_spec(shape), dtype)[0]
    check_gpu_layer(shape, dtype, dataclasses.replace(config, precision=precision), [(False, False), (True, True)])


GPU_TMA_SHAPES = [  # (N, C, K, H, R, stride, padding): stride 1, K and C off the tiles, padding 0-3
    (3, 8, 40, 13, 3, 1, 1), (1, 24, 72, 13, 1, 1, 0), (2, 64, 96, 14, 3, 1, 2), (1, 32, 56, 9, 7, 1, 3),
    (0, 16, 16, 7, 3, 1, 1),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,precision", GPU_MODES, ids=str)
@pytest.mark.parametrize("shape", GPU_TMA_SHAPES, ids=str)
def test_gpu_every_tma_config(shape, dtype, precision):
    """Every TMA config the tuner may pick on stride-1 odd shapes, plain and with residual + ReLU."""
    configs = [c for c in candidate_configs(gpu_spec(shape), dtype) if c.loads == "tma"]
    assert configs
    for config in configs:
        check_gpu_layer(shape, dtype, dataclasses.replace(config, precision=precision),
                        [(False, False), (True, True)])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_zero_dense_and_nchw_inputs(dtype):
    backend = get_backend("tensorcore")
    spec = ConvSpec(2, 40, 70, 10, 10, 3, 3, 1, 1)
    x = inputs((2, 40, 10, 10), device="cuda", dtype=dtype)
    bias = torch.randn(70, device="cuda").to(dtype)
    for config in candidate_configs(spec, dtype)[:3]:
        zero = torch.zeros(70, 40, 3, 3, device="cuda", dtype=dtype)
        y = backend.run(x, backend.prepare(zero, config), bias, spec, config, relu=True)
        assert torch.equal(y, bias.clamp(min=0).view(1, -1, 1, 1).expand_as(y))
        dense = torch.randn(70, 40, 3, 3, device="cuda").to(dtype)
        packed = backend.prepare(dense, config)
        ref = expected(x, dense, bias, 1, 1)
        for layout in (torch.contiguous_format, torch.channels_last):
            y = backend.run(x.contiguous(memory_format=layout), packed, bias, spec, config)
            assert relative_error(y, ref) <= gpu_limit(x, dense, bias, 1, 1, config.precision), (config, layout)


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    backend = get_backend("tensorcore")
    spec = ConvSpec(4, 64, 64, 14, 14, 3, 3, 1, 1)
    config = candidate_configs(spec, torch.float16)[0]
    weight = unit_weight(64, 64, 3, 3, config.group, config.chunk).cuda().half()
    call = backend.bind(backend.prepare(weight, config), spec, config, torch.float16, False)
    x = inputs((4, 64, 14, 14), device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    expected_y = call(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected_y)


def run_chain(backend, layers, x, spec):
    """Each layer's output relu(conv(previous) + bias + the output two layers back), as a list."""
    outputs = [x, x]
    for packed, bias, config in layers:
        outputs.append(backend.run(outputs[-1], packed, bias, spec, config, relu=True, residual=outputs[-2]))
    return outputs[2:]


@gpu
@needs_cuda
def test_gpu_dependent_launch_chain_matches_plain_launches(monkeypatch):
    """Under programmatic dependent launch a layer starts before the one it reads has finished: a
    chain whose every layer reads its predecessor's output and a residual two layers back, replayed
    in a CUDA graph with its outputs poisoned before each replay, equals the same chain launched
    plainly (SPARSECNN_PDL=0), bit for bit."""
    from sparsecnn.backends.tensorcore.kernel import dependent_launch

    backend = get_backend("tensorcore")
    spec = ConvSpec(8, 64, 64, 14, 14, 3, 3, 1, 1)
    x = inputs((8, 64, 14, 14), device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    if not dependent_launch(x):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    configs = [TensorCoreConfig(64, 32, 64, 4, 3, order="index", unroll=unroll, loads=loads)
               for unroll, loads in ((1, "pointer"), (4, "pointer"), (1, "tma"))] * 2
    layers = [(backend.prepare(unit_weight(64, 64, 3, 3, 64, 32, keep=0.3, seed=i).cuda().half() / 8, config),
               torch.randn(64, device="cuda").half(), config) for i, config in enumerate(configs)]
    monkeypatch.setenv("SPARSECNN_PDL", "0")
    plain = run_chain(backend, layers, x, spec)
    monkeypatch.setenv("SPARSECNN_PDL", "1")
    run_chain(backend, layers, x, spec)  # compiles the dependent-launch kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chained = run_chain(backend, layers, x, spec)
    for _ in range(20):
        for y in chained:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(chained, plain):
            assert torch.equal(got, want)


def test_candidate_packings_are_all_tested_on_the_gpu():
    """The layer of test_gpu_every_candidate_config offers every packing and launch there is."""
    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("imports triton")
    configs = candidate_configs(ConvSpec(2, 64, 96, 14, 14, 3, 3, 2, 1), torch.float16)
    assert {c.packing for c in configs} == {(g, c, order) for g, c in [(64, 32), (64, 64), (32, 32), (64, 16), (128, 32)]
                                            for order in ("support", "index")}
    assert {(c.block_m, c.num_warps, c.num_stages) for c in configs} == set(itertools.product((64, 128, 32), (4,), (3,)))


@pytest.mark.parametrize("group, chunk", [(32, 32), (64, 16), (64, 32), (64, 64), (128, 32)])
def test_padded_work_counts_the_mma_work_of_the_packing(group, chunk):
    """`padded_work` (the tuner's cost model) equals the packed B tiles' size on odd shapes."""
    for K, C, R, S, keep in ((33, 3, 3, 3, 0.3), (70, 40, 1, 1, 0.5), (128, 96, 3, 3, 0.05), (16, 8, 7, 7, 0.0)):
        weight = unit_weight(K, C, R, S, 32, 16, keep=keep, scatter=0.01)
        assert padded_work(weight, group, chunk) == pack_units(weight, group, chunk).values.numel()


def channel_run_tiles(K, C, R, S, tile, chunk, keep=0.2, seed=0):
    """A weight whose output channels, in runs of `tile` (index order), share kept units of `chunk`."""
    gen = torch.Generator().manual_seed(seed)
    kept = torch.rand(-(-K // tile), -(-C // chunk), R, S, generator=gen) < keep
    mask = kept.repeat_interleave(tile, 0).repeat_interleave(chunk, 1)[:K, :C]
    return torch.randn(K, C, R, S, generator=gen) * mask


@needs_interpreter
def test_tuning_times_the_packings_of_least_work():
    """On 64 x 32 channel-run tiles the packings that pad no work are 32 x 32, 64 x 16 and 64 x 32
    (64 x 64 and 128 x 32 merge units): those stay, with every launch. On an unstructured 90% mask
    every packing pads the dense work: none stays. An all-zero weight pads nothing: all stay."""
    from sparsecnn.backends.tensorcore.kernel import MAX_WORK_FRACTION, least_work_configs

    spec = ConvSpec(32, 128, 256, 7, 7, 3, 3, 1, 1)
    configs = auto_configs(spec, torch.float16)
    kept = least_work_configs(channel_run_tiles(256, 128, 3, 3, 64, 32), configs)
    assert {config.packing[:2] for config in kept} == {(32, 32), (64, 16), (64, 32)}
    assert kept == [config for config in configs if config.packing[:2] in {(32, 32), (64, 16), (64, 32)}]
    assert any(config.unroll > 1 for config in kept)  # a 7 x 7 layer's small-grid launches stay too
    unstructured = torch.randn(256, 128, 3, 3) * (torch.rand(256, 128, 3, 3) < 0.1)
    assert padded_work(unstructured, 32, 32) > MAX_WORK_FRACTION * unstructured.numel()
    assert least_work_configs(unstructured, configs) == []
    assert least_work_configs(torch.zeros(256, 128, 3, 3), configs) == configs


@needs_interpreter
def test_a_first_layer_of_three_channels_is_timed_where_its_taps_are_tile_pruned():
    """conv1-like (64, 3, 7, 7): each unit runs 16 channels for 3, so the cut compares with the dense
    work at 16 channels: 10% of the taps per 64-channel tile is kept; unstructured 90% (every tap of
    every tile holds a non-zero) is not."""
    from sparsecnn.backends.tensorcore.kernel import least_work_configs

    spec = ConvSpec(32, 3, 64, 224, 224, 7, 7, 2, 3)
    configs = auto_configs(spec, torch.float16)
    assert least_work_configs(channel_run_tiles(64, 3, 7, 7, 64, 32, keep=0.1, seed=3), configs)
    unstructured = torch.randn(64, 3, 7, 7) * (torch.rand(64, 3, 7, 7) < 0.1)
    assert least_work_configs(unstructured, configs) == []


@needs_interpreter
def test_auto_tuning_offers_only_the_configs_the_weight_keeps(monkeypatch):
    """`candidates_for` with the layer's weight hands a backend's auto configs to its `weight_configs`;
    named backends (an explicit list) and calls without a weight get every config."""
    from sparsecnn.tuning import select
    from sparsecnn.tuning.precision import resolve_policy

    seen = []

    def first_only(weight, configs):
        seen.append(len(configs))
        return configs[:1]

    real = select.get_backend
    tensorcore = dataclasses.replace(real("tensorcore"), weight_configs=first_only, autotune_devices=None)
    monkeypatch.setattr(select, "get_backend", lambda name: tensorcore if name == "tensorcore" else real(name))
    spec, policy = ConvSpec(2, 64, 64, 9, 9, 3, 3, 1, 1), resolve_policy("fp16", torch.float16)
    weight = channel_run_tiles(64, 64, 3, 3, 64, 32)

    def offered(**kwargs):
        return [c for c in select.candidates_for(spec, policy, "cuda", **kwargs) if c.backend == "tensorcore"]

    assert len(offered(weight=weight)) == 1 and seen == [len(auto_configs(spec, torch.float16))] and seen[0] > 1
    assert len(offered()) == seen[0]
    assert len(offered(backends=["tensorcore"], weight=weight)) > seen[0]  # named: every candidate config
    none = dataclasses.replace(tensorcore, weight_configs=lambda weight, configs: [])
    monkeypatch.setattr(select, "get_backend", lambda name: none if name == "tensorcore" else real(name))
    assert offered(weight=weight) == [] and offered() != []  # a cost model may rule the backend out


# --- a projection shortcut in the same reduction (format.pack_shortcut_units) ------------------------

def expected_with_shortcut(x, weight, bias, stride, padding, x2, shortcut, stride2, relu=False, residual=None):
    y = expected(x, weight, bias, stride, padding, residual=residual)
    y = y + reference_conv(x2, shortcut, None, stride=stride2, padding=0, fp64=True)
    return y.clamp(min=0) if relu else y


def test_pack_shortcut_units_holds_both_weights_and_splits_each_group():
    from sparsecnn.backends.tensorcore.format import pack_shortcut_units

    weight, shortcut = unit_weight(40, 32, 3, 3, 16, 16, keep=0.4), unit_weight(40, 24, 1, 1, 16, 16, keep=0.5)
    packed = pack_shortcut_units(weight, shortcut, 16, 16)
    assert packed.kernel_shape == (40, 32, 3, 3) and packed.shortcut_channels == 24
    combined = dataclasses.replace(packed, kernel_shape=(40, 56, 3, 3))
    dense = unpack(combined)
    assert torch.equal(dense[:, :32], weight) and torch.equal(dense[:, 32:, 0, 0], shortcut[:, :, 0, 0])
    assert not dense[:, 32:, 1:].any() and not dense[:, 32:, 0, 1:].any()
    for g in range(packed.num_groups):
        start, split, end = int(packed.group_start[g]), int(packed.group_split[g]), int(packed.group_start[g + 1])
        assert start <= split <= end
        assert all(int(packed.unit_chunk[u]) < 2 for u in range(start, split))
        assert all(int(packed.unit_chunk[u]) >= 2 and int(packed.unit_tap[u]) == 0 for u in range(split, end))
    with pytest.raises(ValueError, match="multiple of chunk"):
        pack_shortcut_units(weight[:, :20], shortcut, 16, 16)
    with pytest.raises(ValueError, match=r"shortcut \(K, C2, 1, 1\)"):
        pack_shortcut_units(weight, shortcut.expand(40, 24, 3, 3), 16, 16)


SHORTCUT_SHAPES = [  # (N, C, K, H, R, stride, padding, C2, H2, stride2): main conv then the shortcut's input
    (2, 16, 33, 13, 1, 1, 0, 24, 13, 1), (1, 32, 40, 13, 3, 2, 1, 16, 13, 2), (2, 16, 17, 9, 3, 1, 1, 40, 17, 2),
    (0, 16, 16, 5, 3, 1, 1, 16, 5, 1), (1, 32, 24, 6, 5, 3, 3, 8, 9, 3),
]


@needs_interpreter
@pytest.mark.parametrize("N,C,K,H,R,stride,padding,C2,H2,stride2", SHORTCUT_SHAPES)
@pytest.mark.parametrize("unroll", [1, 2])
def test_kernel_with_a_shortcut_matches_fp64_on_odd_shapes(N, C, K, H, R, stride, padding, C2, H2, stride2, unroll):
    """C2 off the chunk (masked loads), strided shortcuts, a residual and ReLU as well."""
    from sparsecnn.backends.tensorcore.format import pack_shortcut_units

    config = TensorCoreConfig(group=16, chunk=16, block_m=32, order="index", unroll=unroll)
    weight = unit_weight(K, C, R, R, 16, 16, keep=0.4, seed=2)
    shortcut = unit_weight(K, C2, 1, 1, 16, 16, keep=0.5, seed=3)
    packed = pack_shortcut_units(weight, shortcut, 16, 16)
    x, x2, bias = inputs((N, C, H, H)), inputs((N, C2, H2, H2), seed=4), torch.randn(K)
    P = (H + 2 * padding - R) // stride + 1
    residual = inputs((N, K, P, P), seed=5)
    y = unit_conv(x, packed, (stride, stride), (padding, padding), config, bias=bias, residual=residual, relu=True,
                  shortcut=x2, shortcut_stride=(stride2, stride2))
    ref = expected_with_shortcut(x, weight, bias, stride, padding, x2, shortcut, stride2, relu=True, residual=residual)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last)
    if N:
        assert relative_error(y, ref) < 1e-5


@needs_interpreter
def test_kernel_refuses_a_shortcut_that_does_not_match():
    from sparsecnn.backends.tensorcore.format import pack_shortcut_units

    config = TensorCoreConfig(group=16, chunk=16, block_m=32, order="index")
    weight, shortcut = unit_weight(16, 16, 1, 1, 16, 16), unit_weight(16, 8, 1, 1, 16, 16)
    packed, plain = pack_shortcut_units(weight, shortcut, 16, 16), pack_units(weight, 16, 16)
    x = inputs((1, 16, 8, 8))
    with pytest.raises(ValueError, match="exactly when the packed weight holds one"):
        unit_conv(x, packed, (1, 1), (0, 0), config)
    with pytest.raises(ValueError, match="exactly when the packed weight holds one"):
        unit_conv(x, plain, (1, 1), (0, 0), config, shortcut=inputs((1, 8, 8, 8)))
    with pytest.raises(ValueError, match=r"shortcut must be \(N=1, C2=8"):
        unit_conv(x, packed, (1, 1), (0, 0), config, shortcut=inputs((1, 16, 8, 8)))
    with pytest.raises(ValueError, match="does not give the output's"):
        unit_conv(x, packed, (1, 1), (0, 0), config, shortcut=inputs((1, 8, 16, 16)), shortcut_stride=(1, 1))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,precision", GPU_MODES, ids=str)
def test_gpu_kernel_with_a_shortcut(dtype, precision):
    """ResNet's stride-2 block end (1x1 conv + projection shortcut) on odd sizes, every auto packing."""
    from sparsecnn.backends.tensorcore.format import pack_shortcut_units

    N, C, K, H, C2, H2 = 3, 32, 72, 7, 48, 13
    x = inputs((N, C, H, H), device="cuda", dtype=dtype)
    x2 = inputs((N, C2, H2, H2), seed=4, device="cuda", dtype=dtype)
    bias = torch.randn(K, device="cuda").to(dtype)
    for config in auto_configs(ConvSpec(N, C, K, H, H, 1, 1), dtype):
        config = dataclasses.replace(config, precision=precision)
        weight = unit_weight(K, C, 1, 1, config.group, config.chunk, keep=0.4).cuda().to(dtype)
        shortcut = unit_weight(K, C2, 1, 1, config.group, config.chunk, keep=0.4, seed=3).cuda().to(dtype)
        packed = pack_shortcut_units(weight, shortcut, config.group, config.chunk)
        ref = expected_with_shortcut(x, weight, bias, 1, 0, x2, shortcut, 2, relu=True)
        torch.empty(ref.numel() * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)  # poison
        y = unit_conv(x, packed, (1, 1), (0, 0), config, bias=bias, relu=True, shortcut=x2, shortcut_stride=(2, 2))
        combined = torch.cat([weight, shortcut], dim=1)
        limit = gpu_limit(torch.cat([x, x2[:, :, ::2, ::2]], dim=1), combined, bias, 1, 0, config.precision)
        assert relative_error(y, ref) <= limit, config


@needs_interpreter
@pytest.mark.parametrize("relu_only", [True, False])
def test_compiles_ahead_specialize_as_the_call_does(monkeypatch, relu_only):
    """`compile_ahead.ahead_launches` (compiled in worker processes before tuning) reaches the Triton
    specialization `unit_conv`'s launch reaches, for every auto config and epilogue it compiles: the
    same cache key, so the call finds the worker's kernel."""
    from sparsecnn.backends.tensorcore import compile_ahead, kernel

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((args, meta))

    spec = ConvSpec(2, 40, 70, 9, 9, 3, 3, 2, 1)
    weight = channel_run_tiles(70, 40, 3, 3, 64, 32, keep=0.3).half()
    configs = [config for config in kernel.auto_configs(spec, torch.float16) if config.loads == "pointer"]
    ahead = compile_ahead.ahead_launches(spec, weight, torch.float16, True, configs, relu_only, pdl=True)
    monkeypatch.setattr(kernel, "_unit_conv_kernel", Recorder())
    monkeypatch.setattr(kernel, "dependent_launch", lambda x: True)
    x = inputs((2, 40, 9, 9), dtype=torch.float16)
    for config in configs:
        packed = pack_units(weight, *config.packing)
        for relu, residual in epilogues(relu_only):
            kernel.unit_conv(x, packed, spec.stride, spec.padding, config, bias=torch.randn(70).half(), relu=relu,
                             residual=inputs((2, 70, 5, 5), dtype=torch.float16) if residual else None)
    monkeypatch.undo()
    assert len(ahead) == len(launched) == len(configs) * len(epilogues(relu_only)) > 0
    for (config, (path, args, meta)), (call_args, call_meta) in zip(ahead, launched):
        assert path.endswith(":_unit_conv_kernel") and meta == call_meta, config
        assert specialization(kernel._unit_conv_kernel, args, meta) == specialization(
            kernel._unit_conv_kernel, call_args, call_meta), config


@needs_interpreter
def test_compile_ahead_leaves_cpu_weights_alone():
    """Nothing to compile for a CPU weight (Triton's interpreter runs it): no job, nothing to settle."""
    from sparsecnn.backends.tensorcore import compile_ahead

    spec = ConvSpec(2, 40, 70, 9, 9, 3, 3, 2, 1)
    compile_ahead.prefetch(spec, channel_run_tiles(70, 40, 3, 3, 64, 32), torch.float32, True)
    assert not compile_ahead._COMPILES.pool.pending and not compile_ahead._COMPILES._by_layer


_FIRST_CALL_AFTER_WORKERS = """
import sys
from pathlib import Path
import torch
from sparsecnn.backends import get_backend
from sparsecnn.backends.tensorcore import compile_ahead, kernel
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
cache = Path(sys.argv[1])
spec = ConvSpec(32, 64, 96, 13, 13, 3, 3, 1, 1)
weight = torch.zeros(96, 64, 3, 3)
weight[:64, :32, 1, 1] = torch.randn(64, 32)
weight[64:, 32:, 0, 2] = torch.randn(32, 32)
weight = weight.half().cuda()
bias = torch.randn(96, device="cuda").half()
configs = [config for config in kernel.auto_configs(spec, torch.float16) if config.loads == "pointer"]
compile_ahead.prefetch(spec, weight, torch.float16, True, configs, relu_only=True)
pool = compile_ahead._COMPILES.pool
for key in list(pool.pending):
    pool.take(key)  # wait for every compile
assert pool.times.jobs >= 1, pool.times
before = {path.parent for path in cache.rglob("*.cubin")}
backend, x = get_backend("tensorcore"), torch.randn(spec.input_shape, device="cuda").half()
ref = reference_conv(x.cpu().float(), weight.cpu().float(), bias.cpu().float(), stride=1, padding=1,
                     fp64=True).clamp(min=0)
for config in configs:
    call = backend.bind_for(backend.prepare(weight, config), spec, config, torch.float16, True, True)
    y = call(x, bias, None, True)
    assert relative_error(y.cpu(), ref) < 2e-3, config
new = [path for path in {path.parent for path in cache.rglob("*.cubin")} - before
       if any("unit_conv" in file.name for file in path.iterdir())]
assert not new, new  # every tensorcore kernel the calls ran came from the workers' compiles
print("ok", len(before), "kernels compiled ahead")
"""


@gpu
@needs_cuda
def test_gpu_first_calls_find_the_kernels_compiled_ahead(tmp_path):
    """In a fresh process with an empty Triton cache: prefetch one layer's pointer configs, wait for
    the workers, then bind and call each config: right, and no tensorcore kernel compiled in-process."""
    assert run_compiling(_FIRST_CALL_AFTER_WORKERS, tmp_path, str(tmp_path)).startswith("ok")
