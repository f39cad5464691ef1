"""Backend `direct` (UnSparse-Opt direct sparse convolution): formats, configs, kernel, backend.

The kernel tests run on CPU through Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported, as `make test` does) and, marked `gpu`, on CUDA. Shapes are tiny and odd: the interpreter
runs each program in numpy.
"""
import dataclasses
import itertools

import pytest
import torch
from helpers.common import INTERPRET, needs_cuda, needs_interpreter

from sparsecnn.backends import get_backend
from sparsecnn.backends.direct.format import (
    ChunkedCSRWeight,
    OffsetCSRWeight,
    UniformELLWeight,
    expand_offsets,
    padding_overhead,
)
from sparsecnn.core.csr import CSRWeight
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.nn import SparseConv2d

gpu = pytest.mark.gpu

if INTERPRET or torch.cuda.is_available():
    import sparsecnn.backends.direct.kernel as triton_kernels
    DirectConfig = triton_kernels.DirectConfig
    candidate_configs = triton_kernels.candidate_configs
    direct_conv2d = triton_kernels.direct_conv2d

# Triton's interpreter converts a tensor loop bound with int() on a 1-element array (numpy warns).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

FORMATS = {"chunk": ChunkedCSRWeight, "ell": UniformELLWeight, "csr": OffsetCSRWeight, "batch": ChunkedCSRWeight}
VARIANTS = list(FORMATS)


def pack(weight, config):
    """The weight in the format of `config`'s variant."""
    if config.variant in ("chunk", "batch"):
        return ChunkedCSRWeight.from_dense(weight, config.chunk)
    return FORMATS[config.variant].from_dense(weight)


def first_config(variant):
    """The first candidate of `variant` for SMALL; for "batch", whose sub_batch must divide N, one
    image and 64 pixels per program, so that it runs on any batch size."""
    if variant == "batch":
        return DirectConfig(64, 1, 1, 1, 1, "batch", 4)
    return next(c for c in candidate_configs(SMALL) if c.variant == variant)
SMALL = ConvSpec(3, 3, 33, 13, 13, 3, 3, 2, 1, name="small")
LARGE = ConvSpec(64, 64, 64, 56, 56, 3, 3, 1, 1, name="resnet-conv1")
# Output channels of most kernel tests on the CPU: like 33, one past a multiple of every block_k up
# to 16 (a partial last channel block) and below 64; half the programs of 33 under the interpreter,
# whose time goes with the number of programs.
K = 17


# --- helpers ------------------------------------------------------------------------


def sparse_weight(k, c, r, s, sparsity, zero_channels=(), seed=0, device="cpu"):
    """Random (K, C, R, S) float32 weight with exactly round(sparsity * numel) zeros (top-k of
    random scores), then the `zero_channels` output channels zeroed entirely."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(k, c, r, s, generator=gen)
    keep = round((1 - sparsity) * weight.numel())
    mask = torch.zeros(weight.numel(), dtype=torch.bool)
    mask[torch.rand(weight.numel(), generator=gen).topk(keep).indices] = True
    weight = weight * mask.view_as(weight)
    weight[list(zero_channels)] = 0
    return weight.to(device)


def inputs(n, c, h, w, seed=1, device="cpu", dtype=torch.float32):
    """Non-zero random input (never all zeros: a zero input hides wrong offsets)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, h, w, generator=gen) + 0.1).to(device=device, dtype=dtype)


def run(x, weight, bias, stride, padding, config, relu=False):
    """direct_conv2d into an output poisoned with NaN (every element must be written)."""
    packed = pack(weight, config)
    k, _, r, s = weight.shape
    spec = ConvSpec(x.shape[0], x.shape[1], k, x.shape[2], x.shape[3], r, s, stride, padding)
    out = torch.full(spec.output_shape, float("nan"), dtype=x.dtype, device=x.device)
    result = direct_conv2d(x, packed, bias, stride, padding, config, relu=relu, out=out)
    assert result is out
    return out


def expected(x, weight, bias, stride, padding, relu=False):
    ref = reference_conv(x, weight, bias, stride=stride, padding=padding, fp64=True)
    return ref.clamp(min=0) if relu else ref


def check_fp32(x, weight, bias, stride, padding, config, relu=False, zero_channels=()):
    y = run(x, weight, bias, stride, padding, config, relu)
    err = relative_error(y, expected(x, weight, bias, stride, padding, relu))
    assert err < 1e-5, f"{config}: relative error {err:.2e}"
    for ch in zero_channels:  # an all-zero channel gives exactly its bias (or 0), ReLU'd if asked
        value = 0.0 if bias is None else bias[ch].item()
        assert torch.equal(y[:, ch], torch.full_like(y[:, ch], max(value, 0.0) if relu else value))


def all_configs():
    """Every candidate of a small and a large layer, plus extreme valid sizes."""
    corners = [DirectConfig(16, 64, 8, 4, 1, "ell"), DirectConfig(16, 64, 8, 4, 1, "csr"),
               DirectConfig(1024, 1, 1, 8, 2, "ell"), DirectConfig(32, 2, 8, 1, 1, "csr"),
               DirectConfig(16, 1, 8, 1, 1, "chunk", 4), DirectConfig(1024, 1, 1, 8, 1, "chunk", 32)]
    batch = [DirectConfig(4, 1, 2, 1, 1, "batch", 4), DirectConfig(16, 1, 64, 1, 1, "batch", 32)]
    return list(dict.fromkeys(candidate_configs(SMALL) + candidate_configs(LARGE) + corners + batch))


def batch_for(config, default=3):
    """A batch size `config` runs on: two image blocks for "batch" (its sub_batch divides N), else `default`."""
    return 2 * config.sub_batch if config.variant == "batch" else default


def batch_inner(x):
    """x (N, C, H, W) copied into the batch-innermost layout (strides (1, H*W*N, W*N, N))."""
    from sparsecnn.core.batch_inner import batch_inner_view

    return batch_inner_view(x.shape, x.dtype, x.device).copy_(x)


def count_packs(monkeypatch):
    """The paddings of the `padded_batch_inner` calls the direct launcher makes from now on."""
    calls, real = [], triton_kernels.padded_batch_inner
    monkeypatch.setattr(triton_kernels, "padded_batch_inner",
                        lambda x, *args: calls.append(tuple(args[:2])) or real(x, *args))
    return calls


def pack_path(x, packed, bias, stride, padding, config, relu=False, residual=None):
    """Variant "batch" on x through the pack path whatever x's layout (`weight_arrays` without masked
    codes), into an output poisoned with NaN."""
    k, _, r, s = packed.kernel_shape
    spec = ConvSpec(x.shape[0], x.shape[1], k, x.shape[2], x.shape[3], r, s, stride, padding)
    arrays = triton_kernels.weight_arrays(packed, spec.H + 2 * spec.padding[0], spec.W + 2 * spec.padding[1])
    out = torch.full(spec.output_shape, float("nan"), dtype=x.dtype, device=x.device)
    return triton_kernels.direct_conv2d_arrays(x, *arrays, packed.kernel_shape, bias, stride, padding, config,
                                               relu=relu, residual=residual, out=out)


def config_id(config):
    return (f"{config.variant}-p{config.block_pix}-k{config.block_k}-sb{config.sub_batch}"
            f"-w{config.num_warps}-s{config.num_stages}-c{config.chunk}")


# --- formats ------------------------------------------------------------------------


def test_ell_layout_padding_and_decoding():
    weight = sparse_weight(7, 3, 3, 3, 0.7, zero_channels=(2,))
    weight[4] = 0
    weight[4, 1, 2, 0] = 5.0  # a one-non-zero row
    ell = UniformELLWeight.from_dense(weight)
    row_nnz = (weight.reshape(7, -1) != 0).sum(1)
    assert ell.width == int(row_nnz.max())
    assert torch.equal(ell.row_nnz.long(), row_nnz)
    assert ell.nnz == int(row_nnz.sum()) and ell.padded_slots == 7 * ell.width - ell.nnz
    assert ell.padding_overhead == pytest.approx(ell.padded_slots / ell.nnz)
    assert ell.values.dtype == torch.float32 and ell.values.stride() == (1, 7)  # step-major
    assert torch.equal(ell.to_dense(), weight)

    height, width = 9, 11
    off = ell.offsets(height, width).long()
    assert off.shape == (7, ell.width) and ell.offsets(height, width) is ell.offsets(height, width)
    c, rest = off // (height * width), off % (height * width)
    dense = torch.zeros_like(weight)
    dense.index_put_((torch.arange(7)[:, None].expand_as(off), c, rest // width, rest % width), ell.values,
                     accumulate=True)
    assert torch.equal(dense, weight)
    for row in range(7):  # padding: value 0, offset of the row's last real entry (0 for an empty row)
        n = int(row_nnz[row])
        assert torch.all(ell.values[row, n:] == 0)
        assert torch.all(off[row, n:] == (off[row, n - 1] if n else 0))


def test_csr_layout_order_and_decoding():
    weight = sparse_weight(6, 4, 3, 2, 0.6, zero_channels=(1,))
    fmt = OffsetCSRWeight.from_dense(weight)
    reference = CSRWeight.from_dense(weight)
    assert torch.equal(fmt.row_ptr, reference.row_ptr)
    assert torch.equal(fmt.csr.col_idx, reference.col_idx)
    row_nnz = fmt.row_nnz
    assert torch.all(row_nnz[fmt.row_order.long()][:-1] >= row_nnz[fmt.row_order.long()][1:])
    assert sorted(fmt.row_order.tolist()) == list(range(6))
    assert torch.equal(fmt.to_dense(), weight)

    height, width = 5, 7
    off = fmt.offsets(height, width).long()
    rows = torch.repeat_interleave(torch.arange(6), row_nnz)
    c, rest = off // (height * width), off % (height * width)
    dense = torch.zeros_like(weight)
    dense[rows, c, rest // width, rest % width] = fmt.values
    assert torch.equal(dense, weight)
    assert fmt.ell_padding_overhead == pytest.approx(UniformELLWeight.from_dense(weight).padding_overhead)


def test_padding_overhead_values():
    assert padding_overhead(torch.tensor([2, 2, 2])) == 0.0
    assert padding_overhead(torch.tensor([4, 1, 0, 3])) == pytest.approx((16 - 8) / 8)
    assert padding_overhead(torch.tensor([0, 0])) == 0.0
    skewed = torch.tensor([21, 2, 10, 7])  # DLMC-like spread: 2% to 21% per channel
    assert padding_overhead(skewed) == pytest.approx((4 * 21 - 40) / 40)


def test_formats_of_an_all_zero_weight():
    weight = torch.zeros(5, 2, 3, 3)
    chunked = ChunkedCSRWeight.from_dense(weight, 8)
    assert chunked.nnz == 0 and torch.equal(chunked.to_dense(), weight) and chunked.offsets(4, 4).shape == (0,)
    ell, csr = UniformELLWeight.from_dense(weight), OffsetCSRWeight.from_dense(weight)
    assert ell.width == 0 and ell.nnz == 0 and ell.padding_overhead == 0.0
    assert csr.nnz == 0 and csr.ell_padding_overhead == 0.0
    assert torch.equal(ell.to_dense(), weight) and torch.equal(csr.to_dense(), weight)
    assert ell.offsets(4, 4).shape == (5, 0) and csr.offsets(4, 4).shape == (0,)


def test_half_weights_are_stored_exactly_in_float32():
    weight = sparse_weight(4, 3, 3, 3, 0.5).half()
    for packed in (ChunkedCSRWeight.from_dense(weight, 8), UniformELLWeight.from_dense(weight),
                   OffsetCSRWeight.from_dense(weight)):
        assert packed.values.dtype == torch.float32
        assert torch.equal(packed.to_dense(), weight.float())


def test_format_errors():
    with pytest.raises(ValueError, match="smaller than"):
        expand_offsets(torch.zeros(1, dtype=torch.int32), (1, 1, 3, 3), 2, 5)
    with pytest.raises(ValueError, match="weight"):
        UniformELLWeight.from_dense(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="weight"):
        OffsetCSRWeight.from_dense(torch.zeros(2, 2, 2, 2, dtype=torch.int32))


def test_masked_codes_decode_cache_and_fit():
    weight = sparse_weight(7, 3, 5, 5, 0.6, zero_channels=(2,))
    fmt = ChunkedCSRWeight.from_dense(weight, 8)
    height, width, pad_h, pad_w = 11, 7, 2, 1
    codes = fmt.masked_codes(height, width, pad_h, pad_w)
    assert codes.dtype == torch.int32 and codes.shape == fmt.cols.shape
    assert fmt.masked_codes(height, width, pad_h, pad_w) is codes                # cached,
    assert fmt.masked_codes(height, width, pad_w, pad_h) is not codes            # per padding,
    assert fmt.offsets(height + 2 * pad_h, width + 2 * pad_w).shape == codes.shape  # beside the offsets
    r, s, off = (codes >> 3) & 7, codes & 7, codes >> 6   # torch's >> on int32 is arithmetic, as Triton's
    c, rs = fmt.cols.long() // 25, fmt.cols.long() % 25
    assert torch.equal(r.long(), rs // 5) and torch.equal(s.long(), rs % 5)
    assert torch.equal(off.long(), c * height * width + (r.long() - pad_h) * width + (s.long() - pad_w))
    assert (off < 0).any()  # taps above the image: negative offsets survive the encoding

    def codes_of(c, r, s, height, width, pad_h, pad_w):
        return ChunkedCSRWeight.from_dense(sparse_weight(2, c, r, s, 0.5), 8).masked_codes(height, width, pad_h, pad_w)

    assert codes_of(1, 9, 3, 13, 13, 4, 1) is None and codes_of(1, 3, 9, 13, 13, 1, 4) is None  # r, s in 3 bits
    assert codes_of(1, 8, 8, 13, 13, 4, 4) is not None
    # |off| * 64 + 63 within int32: 1023 * 181 * 181 + 182 fits, 1023 * 182 * 182 + 183 does not
    assert codes_of(1024, 3, 3, 181, 181, 1, 1) is not None and codes_of(1024, 3, 3, 182, 182, 1, 1) is None


# --- configs ------------------------------------------------------------------------


@needs_interpreter
def test_direct_config_validation_names_the_field():
    for field, value in [("block_pix", 24), ("block_pix", 8), ("block_k", 128), ("sub_batch", 3),
                         ("num_warps", 16), ("num_stages", 0), ("variant", "coo"), ("chunk", 3)]:
        with pytest.raises(ValueError, match=field):
            DirectConfig(**{field: value})
    with pytest.raises(ValueError, match="num_warps"):
        DirectConfig(block_pix=1024, block_k=64, sub_batch=8, num_warps=1)
    with pytest.raises(ValueError, match="block_k must be 1"):
        DirectConfig(block_k=4, variant="chunk")
    config = DirectConfig(64, 8, 4, 2, 1, "csr")
    assert DirectConfig.from_dict(dataclasses.asdict(config)) == config
    with pytest.raises(ValueError, match="unknown keys"):
        DirectConfig.from_dict({**dataclasses.asdict(config), "unroll": 2})


@needs_interpreter
@pytest.mark.parametrize("spec", [SMALL, LARGE, ConvSpec(32, 512, 512, 4, 4, 3, 3, 1, 1),
                                  ConvSpec(1, 3, 64, 224, 224, 3, 3, 1, 1), ConvSpec(2, 8, 5, 1, 301, 1, 7)],
                         ids=lambda spec: f"N{spec.N}-C{spec.C}-K{spec.K}-{spec.H}x{spec.W}")
def test_candidate_configs(spec):
    configs = candidate_configs(spec, torch.float32)
    assert 4 <= len(configs) <= 14 and len(set(configs)) == len(configs)
    batch_ok = spec.N % 4 == 0
    assert {c.variant for c in configs} == set(VARIANTS) - ({"batch"} if not batch_ok else set())
    assert all(spec.N % c.sub_batch == 0 for c in configs if c.variant == "batch")
    assert configs[0].variant == "chunk"
    assert get_backend("direct").default_config(spec, torch.float16) == configs[0]


@needs_interpreter
@pytest.mark.parametrize("spec", [SMALL, LARGE], ids=lambda spec: f"K{spec.K}-{spec.H}x{spec.W}")
def test_auto_tries_the_configs_that_ever_won(spec):
    from sparsecnn.tuning import POLICIES, candidates_for

    every = candidate_configs(spec, torch.float32)
    auto = triton_kernels.auto_configs(spec, torch.float32)
    assert auto[0] == every[0] and set(auto) < set(every)
    assert {c.variant for c in auto} == {"chunk"} | ({"batch"} if spec.N % 4 == 0 else set())
    assert max(c.block_pix for c in auto if c.variant != "batch") <= 128
    assert all(128 <= c.block_pix * c.sub_batch <= 256 for c in auto if c.variant == "batch")
    offered = [c.config for c in candidates_for(spec, POLICIES["fp32"], "cuda") if c.backend == "direct"]
    assert offered == auto
    named = [c.config for c in candidates_for(spec, POLICIES["fp32"], "cuda", ["direct"]) if c.backend == "direct"]
    assert named == every


# --- kernel on CPU (interpreter) -----------------------------------------------------


@pytest.mark.quick_sample(6)
@needs_interpreter
@pytest.mark.parametrize("config", all_configs() if INTERPRET else [], ids=config_id)
def test_every_config(config):
    # 7x5 output pixels: a partial last pixel block for every block_pix (7x7 had it too); stride 2
    # reaches the bottom and right padding.
    # "batch" configs: 4x3 pixels, their batch of two image blocks (up to 128 images) is the cost.
    weight = sparse_weight(K, 3, 3, 3, 0.5, zero_channels=(0, 9, K - 1))
    bias = torch.randn(K)
    h, w = (7, 5) if config.variant == "batch" else (13, 9)
    check_fp32(inputs(batch_for(config), 3, h, w), weight, bias, 2, 1, config, zero_channels=(0, 9, K - 1))


SHAPES = [(kernel, stride, padding) for kernel, stride, padding in itertools.product((1, 3, 5, 7), (1, 2), range(4))]
SHAPES += [(1, 3, 0), (3, 3, 1), (5, 3, 2)]  # stride 3


@pytest.mark.quick_sample(8)
@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernel,stride,padding", SHAPES)
def test_shapes(kernel, stride, padding, variant):
    case = SHAPES.index((kernel, stride, padding))
    sparsity = (0.5, 0.9, 0.99)[case % 3]
    batch = (1, 3)[case % 2]
    # 9 output channels: a partial last channel block for every block_k from 2 to 16, as 17 has
    weight = sparse_weight(9, 3, kernel, kernel, sparsity, zero_channels=(5,), seed=case)
    bias = torch.randn(9) if case % 4 else None
    config = first_config(variant)
    check_fp32(inputs(batch, 3, 9, 9, seed=case), weight, bias, stride, padding, config, zero_channels=(5,))


@pytest.mark.quick_sample(4)
@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("relu", [False, True])
def test_zero_weight_gives_exactly_the_bias(variant, relu):
    bias = torch.randn(33)
    config = first_config(variant)
    y = run(inputs(2, 3, 13, 13), torch.zeros(33, 3, 3, 3), bias, 1, 1, config, relu=relu)
    want = bias.clamp(min=0) if relu else bias
    assert torch.equal(y, want.view(1, -1, 1, 1).expand_as(y))


@pytest.mark.quick_sample(2)
@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_relu_and_no_bias(variant):
    weight = sparse_weight(K, 3, 3, 3, 0.8, zero_channels=(3,))
    config = first_config(variant)
    x = inputs(3, 3, 9, 7)
    check_fp32(x, weight, torch.randn(K), 1, 2, config, relu=True, zero_channels=(3,))
    check_fp32(x, weight, None, 1, 2, config, relu=True, zero_channels=(3,))


@pytest.mark.quick_sample(2)
@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_conv1d_as_h1(variant):
    spec = ConvSpec(2, 3, 33, 1, 29, 1, 5, (1, 2), (0, 2))
    weight = sparse_weight(33, 3, 1, 5, 0.5, zero_channels=(1,))
    for config in ([c for c in candidate_configs(spec) if c.variant == variant][:2] or [first_config(variant)]):
        check_fp32(inputs(2, 3, 1, 29), weight, torch.randn(33), spec.stride, spec.padding, config,
                   zero_channels=(1,))


@pytest.mark.quick_sample(6)
@needs_interpreter
@pytest.mark.parametrize("layout", ["channels_last", "sliced", "transposed"])
@pytest.mark.parametrize("padding", [0, 1])
def test_non_contiguous_inputs(layout, padding):
    base = inputs(3, 3, 9, 18)
    x = {"channels_last": base[..., :9].contiguous().to(memory_format=torch.channels_last),
         "sliced": base[..., ::2],
         "transposed": base[..., :9].transpose(2, 3)}[layout]
    assert not x.is_contiguous()
    weight = sparse_weight(K, 3, 3, 3, 0.9)
    for variant in VARIANTS:
        config = first_config(variant)
        check_fp32(x, weight, torch.randn(K), 1, padding, config)


@pytest.mark.quick_sample(6)
@needs_interpreter
@pytest.mark.parametrize("out_layout", ["nchw", "batch_inner"])
@pytest.mark.parametrize("in_layout", ["nchw", "batch_inner", "channels_last"])
@pytest.mark.slow
def test_batch_variant_layouts_and_residual(in_layout, out_layout):
    from sparsecnn.core.batch_inner import batch_inner_view, is_batch_inner

    base = inputs(8, 3, 9, 7)
    x = {"nchw": base, "channels_last": base.to(memory_format=torch.channels_last),
         "batch_inner": batch_inner_view(base.shape, base.dtype, base.device).copy_(base)}[in_layout]
    assert is_batch_inner(x) == (in_layout == "batch_inner")
    weight = sparse_weight(K, 3, 3, 3, 0.8, zero_channels=(2,))
    bias = torch.randn(K)
    config = DirectConfig(16, 1, 4, 1, 1, "batch", 8)
    shape = (8, K, 9, 7)
    residual = inputs(*shape, seed=3)  # NCHW: the launcher reads it in out's layout
    out = torch.full(shape, float("nan")) if out_layout == "nchw" else batch_inner_view(shape, x.dtype, x.device).fill_(
        float("nan"))
    y = direct_conv2d(x, pack(weight, config), bias, 1, 1, config, relu=True, residual=residual, out=out)
    assert y is out and is_batch_inner(y) == (out_layout == "batch_inner")
    want = (expected(x, weight, bias, 1, 1) + residual.double()).clamp(min=0)
    assert relative_error(y, want) < 1e-5


@pytest.mark.quick_sample(3)
@needs_interpreter
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "sliced", "batch_inner"])
@pytest.mark.parametrize("pad", [(0, 0), (1, 2), (3, 0)])
@pytest.mark.parametrize("step", [(1, 1), (2, 2), (3, 2)])
def test_padded_batch_inner_matches_torch(layout, pad, step):
    """Every padded position at multiples of `step` is torch's padded input (the others are not read)."""
    from sparsecnn.core.batch_inner import batch_inner_view
    from sparsecnn.core.batch_pack import padded_batch_inner

    base = inputs(5, 3, 7, 22)
    x = {"nchw": base[..., :11].contiguous(), "channels_last": base[..., :11].to(memory_format=torch.channels_last),
         "sliced": base[..., ::2], "batch_inner": batch_inner_view((5, 3, 7, 11), base.dtype, base.device)}[layout]
    if layout == "batch_inner":
        x.copy_(base[..., :11])
    want = torch.nn.functional.pad(x, (pad[1], pad[1], pad[0], pad[0])).permute(1, 2, 3, 0)
    got = padded_batch_inner(x, *pad, step)
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(got[:, ::step[0], ::step[1]], want[:, ::step[0], ::step[1]])


# (N, C, H, W, kernel, stride, padding, weight sparsity, epilogue): every padding 1..3 with 3x3,
# 5x5 and 7x7 kernels, taps wholly outside the image (3x3 with padding 3) and a rectangular padding.
MASKED_CASES = [
    (4, 3, 13, 13, 3, 1, 1, 0.5, "bias"),
    (8, 5, 11, 7, 3, 2, 3, 0.8, "bias-relu-residual"),
    (4, 5, 13, 13, 5, 2, 2, 0.9, "plain"),
    (8, 3, 11, 7, 5, 1, 1, 0.7, "relu"),
    (4, 3, 13, 13, 7, 1, 3, 0.95, "bias-relu"),
    (8, 5, 11, 7, 7, 2, (3, 1), 0.6, "residual"),
]


@needs_interpreter
@pytest.mark.parametrize("case", MASKED_CASES, ids=lambda case: "N{}-C{}-{}x{}-k{}-s{}-p{}-{}-{}".format(*case))
@pytest.mark.slow
def test_masked_batch_path(case, monkeypatch):
    """Variant "batch" reads a batch-innermost padded input unpadded, with masked loads (no pack),
    for every "batch" candidate of the layer: within 1e-5 of fp64, and bitwise equal to the pack
    path on the same input (the same FMAs in the same order: a masked tap adds w * 0 as the
    padding's zero does)."""
    n, c, h, w, kernel, stride, padding, sparsity, epilogue = case
    spec = ConvSpec(n, c, K, h, w, kernel, kernel, stride, padding)
    case_id = MASKED_CASES.index(case)
    weight = sparse_weight(K, c, kernel, kernel, sparsity, zero_channels=(5,), seed=case_id)
    bias = torch.randn(K) if "bias" in epilogue else None
    residual = inputs(*spec.output_shape, seed=3) if "residual" in epilogue else None
    relu = "relu" in epilogue
    x = batch_inner(inputs(n, c, h, w, seed=case_id))
    want = expected(x, weight, bias, stride, padding) + (0 if residual is None else residual.double())
    want = want.clamp(min=0) if relu else want
    configs = [config for config in candidate_configs(spec) if config.variant == "batch"]
    assert configs
    packs = count_packs(monkeypatch)
    for config in configs[case_id % 6::6] or configs[:1]:  # every sixth candidate: each runs in one of the 6 cases
        packed = pack(weight, config)
        out = torch.full(spec.output_shape, float("nan"))
        masked = direct_conv2d(x, packed, bias, stride, padding, config, relu=relu, residual=residual, out=out)
        assert packs == []
        err = relative_error(masked, want)
        assert err < 1e-5, f"{config}: relative error {err:.2e}"
        assert torch.equal(masked[:, 5], want[:, 5].float())  # the all-zero channel: act(bias + residual)
        assert torch.equal(masked, pack_path(x, packed, bias, stride, padding, config, relu, residual)), config
        assert packs == [spec.padding]
        packs.clear()


@needs_interpreter
@pytest.mark.slow
def test_only_inputs_not_batch_innermost_are_packed(monkeypatch):
    """`direct_conv2d` and the backend's bound call (its checked first call, then its plan) never
    launch the pack for a batch-innermost padded input; an NCHW input still needs it."""
    spec = ConvSpec(4, 3, 33, 11, 7, 3, 3, 1, 1)
    weight = sparse_weight(33, 3, 3, 3, 0.8, zero_channels=(2,))
    config = next(c for c in candidate_configs(spec) if c.variant == "batch")
    backend = get_backend("direct")
    call = backend.bind(backend.prepare(weight, config), spec, config, torch.float32, False)
    x = inputs(4, 3, 11, 7)
    want = expected(x, weight, None, 1, 1)

    def no_pack(*args):
        raise AssertionError("padded_batch_inner called")

    monkeypatch.setattr(triton_kernels, "padded_batch_inner", no_pack)
    assert relative_error(direct_conv2d(batch_inner(x), pack(weight, config), None, 1, 1, config), want) < 1e-5
    for attempt in range(2):
        assert relative_error(call(batch_inner(x)), want) < 1e-5, attempt
        assert call.eager._plan is not None
    with pytest.raises(AssertionError, match="padded_batch_inner called"):
        call(x)
    with pytest.raises(AssertionError, match="padded_batch_inner called"):
        direct_conv2d(x, pack(weight, config), None, 1, 1, config)


@needs_interpreter
@pytest.mark.parametrize("reason", ["int32", "kernel-9x3"])
@pytest.mark.slow
def test_masked_codes_that_do_not_fit_fall_back_to_the_pack(reason, monkeypatch):
    kernel, padding = ((3, 3), (1, 1)) if reason == "int32" else ((9, 3), (4, 1))
    if reason == "int32":  # codes up to (2*11*7 + 7 + 1) * 64 + 63 = 10431; offsets up to 3*13*9
        monkeypatch.setattr("sparsecnn.backends.direct.format._INT32_MAX", 5000)
    weight = sparse_weight(33, 3, *kernel, 0.7, zero_channels=(4,))
    bias = torch.randn(33)
    config = DirectConfig(32, 1, 4, 1, 1, "batch", 8)
    packed = pack(weight, config)
    assert packed.masked_codes(11, 7, *padding) is None
    packs = count_packs(monkeypatch)
    x = batch_inner(inputs(4, 3, 11, 7))
    y = direct_conv2d(x, packed, bias, 1, padding, config, out=torch.full((4, 33, 11, 7), float("nan")))
    assert packs == [padding]
    assert relative_error(y, expected(x, weight, bias, 1, padding)) < 1e-5


@needs_interpreter
def test_batch_variant_errors():
    weight = ChunkedCSRWeight.from_dense(sparse_weight(33, 3, 3, 3, 0.8), 8)
    config = DirectConfig(16, 1, 4, 1, 1, "batch", 8)
    with pytest.raises(ValueError, match="sub_batch=4 must divide the batch size N=6"):
        direct_conv2d(inputs(6, 3, 13, 13), weight, None, 1, 1, config)
    with pytest.raises(ValueError, match="out must be a contiguous or batch-innermost"):
        direct_conv2d(inputs(8, 3, 13, 13), weight, None, 1, 1, config,
                      out=torch.empty(8, 33, 13, 13).to(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="sub_batch"):
        DirectConfig(16, 1, 128, 8, 1, "batch", 8)
    with pytest.raises(ValueError, match="block_k must be 1"):
        DirectConfig(16, 4, 4, 1, 1, "batch", 8)


@needs_interpreter
@pytest.mark.slow
def test_rectangular_stride_padding_and_kernel():
    weight = sparse_weight(33, 3, 3, 5, 0.5, zero_channels=(7,))
    strided_bias = torch.randn(66)[::2]
    for config in candidate_configs(SMALL)[:2]:
        check_fp32(inputs(3, 3, 11, 13), weight, strided_bias, (2, 1), (1, 3), config, zero_channels=(7,))


@needs_interpreter
def test_default_config_and_argument_errors():
    weight = sparse_weight(33, 3, 3, 3, 0.5)
    x = inputs(1, 3, 13, 13)
    ell, csr = UniformELLWeight.from_dense(weight), OffsetCSRWeight.from_dense(weight)
    ref = expected(x, weight, None, 1, 1)
    assert relative_error(direct_conv2d(x, ell, padding=1), ref) < 1e-5  # config None: default
    assert relative_error(direct_conv2d(x, csr, padding=1), ref) < 1e-5
    ell_config, csr_config = DirectConfig(variant="ell"), DirectConfig(variant="csr")
    with pytest.raises(TypeError, match="variant"):
        direct_conv2d(x, csr, config=ell_config)
    with pytest.raises(TypeError, match="dtype"):
        direct_conv2d(x.double(), ell, config=ell_config)
    with pytest.raises(ValueError, match="channels"):
        direct_conv2d(inputs(1, 4, 13, 13), ell, config=ell_config)
    with pytest.raises(ValueError, match="bias"):
        direct_conv2d(x, ell, torch.zeros(5), config=ell_config)
    with pytest.raises(ValueError, match="out"):
        direct_conv2d(x, ell, config=ell_config, out=torch.empty(1, 33, 11, 12))
    with pytest.raises(ValueError, match="x must be"):
        direct_conv2d(x[0], ell, config=ell_config)
    with pytest.raises(ValueError, match="stride"):
        direct_conv2d(x, ell, stride=0, config=ell_config)
    with pytest.raises(TypeError, match="weight"):
        direct_conv2d(x, weight, config=ell_config)
    assert direct_conv2d(x[:0], csr, padding=1, config=csr_config).shape == (0, 33, 13, 13)


# --- backend -------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_backend_prepare_run_and_sparse_conv(variant):
    backend = get_backend("direct")
    spec = SMALL.with_batch(4)  # "batch" needs a power-of-two divisor of N >= 4
    config = next(c for c in backend.configs(spec, torch.float32) if c.variant == variant)
    assert backend.config_from_dict(dataclasses.asdict(config)) == config
    weight = sparse_weight(33, 3, 3, 3, 0.9)
    bias = torch.randn(33)
    x = inputs(4, 3, 13, 13)
    packed = backend.prepare(weight, config)
    assert isinstance(packed, FORMATS[variant])
    y = backend.run(x, packed, bias, spec, config)
    assert relative_error(y, expected(x, weight, bias, 2, 1)) < 1e-5

    conv1d = torch.nn.Conv1d(3, 33, 5, stride=2, padding=2)
    with torch.no_grad():
        conv1d.weight.mul_(torch.rand_like(conv1d.weight) > 0.8)
    module = SparseConv2d.from_dense(conv1d, backend="direct")
    x1 = inputs(2, 3, 1, 29)[:, :, 0]
    with torch.no_grad():
        assert relative_error(module(x1), conv1d(x1)) < 1e-5
    assert module.fallback_reason is None


@needs_interpreter
@pytest.mark.parametrize("sub_batch,batch,expected_sub_batch", [(8, 8, 8), (8, 4, 4), (8, 6, 2), (8, 3, 1), (4, 1, 1),
                                                                (2, 0, 2)])
def test_for_batch_halves_images_per_program_until_they_divide_the_batch(sub_batch, batch, expected_sub_batch):
    config = DirectConfig(16, 1, sub_batch, 1, 1, "batch", 8)
    assert triton_kernels.for_batch(config, batch) == dataclasses.replace(config, sub_batch=expected_sub_batch)
    ell = DirectConfig(64, 4, 8, 4, 1, "ell")
    assert triton_kernels.for_batch(ell, 3) is ell


@needs_interpreter
def test_a_layer_tuned_at_one_batch_runs_other_batches_on_the_batch_variant():
    """A layer bound with 8 images per program (as tuned at N=8) gets inputs of 4, 3 and 1 images:
    each runs the direct kernel (no dense fallback) and matches fp64."""
    conv = torch.nn.Conv2d(3, 33, 3, stride=2, padding=1)
    with torch.no_grad():
        conv.weight.copy_(sparse_weight(33, 3, 3, 3, 0.8))
    module = SparseConv2d.from_dense(conv, backend="direct", config=DirectConfig(16, 1, 8, 1, 1, "batch", 8))
    with torch.no_grad():
        for batch in (8, 4, 3, 1):
            x = inputs(batch, 3, 13, 13, seed=batch)
            ref = expected(x, conv.weight.detach(), conv.bias.detach(), 2, 1)
            assert relative_error(module(x), ref) < 1e-5, batch
    assert module.fallback_reason is None


# --- GPU -----------------------------------------------------------------------------


def cudnn_error(x, weight, bias, stride, padding, relu=False):
    """cuDNN's own relative error at x's dtype (channels_last, as it runs fastest) against fp64."""
    y = torch.nn.functional.conv2d(x.to(memory_format=torch.channels_last), weight, bias, stride, padding)
    return relative_error(y.clamp(min=0) if relu else y, expected(x, weight, bias, stride, padding, relu))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel,stride,padding", SHAPES[::3])
def test_gpu_shapes(kernel, stride, padding, dtype):
    weight = sparse_weight(33, 3, kernel, kernel, 0.9, zero_channels=(4,), device="cuda").to(dtype)
    bias = torch.randn(33, device="cuda").to(dtype)
    x = inputs(3, 3, 13, 13, device="cuda", dtype=dtype)
    ref = expected(x, weight, bias, stride, padding)
    limit = 1e-5 if dtype == torch.float32 else 2 * cudnn_error(x, weight, bias, stride, padding) + 1e-5
    for config in candidate_configs(SMALL, dtype):
        y = run(x, weight, bias, stride, padding, config)
        assert relative_error(y, ref) <= limit, config


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_resnet_conv1(dtype):
    spec = LARGE.with_batch(2)
    weight = sparse_weight(64, 64, 3, 3, 0.9, zero_channels=(9,), device="cuda").to(dtype)
    bias = torch.randn(64, device="cuda").to(dtype)
    x = inputs(2, 64, 56, 56, device="cuda", dtype=dtype)
    ref = expected(x, weight, bias, 1, 1, relu=True)
    limit = 1e-5 if dtype == torch.float32 else 2 * cudnn_error(x, weight, bias, 1, 1, relu=True) + 1e-5
    for config in [c for c in candidate_configs(spec, dtype) + candidate_configs(LARGE, dtype) if c.variant != "batch"]:
        for memory_format in (torch.contiguous_format, torch.channels_last):
            y = run(x.to(memory_format=memory_format), weight, bias, 1, 1, config, relu=True)
            assert relative_error(y, ref) <= limit, (config, memory_format)


@gpu
@needs_cuda
def test_gpu_zero_weight_and_conv1d():
    bias = torch.randn(33, device="cuda")
    for config in all_configs():
        y = run(inputs(batch_for(config), 3, 13, 13, device="cuda"), torch.zeros(33, 3, 3, 3, device="cuda"), bias, 1,
                1, config)
        assert torch.equal(y, bias.view(1, -1, 1, 1).expand_as(y)), config
        weight = sparse_weight(33, 3, 1, 5, 0.5, device="cuda")
        check_fp32(inputs(batch_for(config, 2), 3, 1, 29, device="cuda"), weight, bias, (1, 2), (0, 2), config)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [32, 8])
def test_gpu_batch_variant(dtype, batch):
    """Every "batch" candidate of a batch of 32 or 8 (vector loads on the GPU), NCHW and
    batch-innermost input and output, odd shapes, fused residual and ReLU. A padded batch-innermost
    input takes the masked path: bitwise equal to the pack path on it."""
    from sparsecnn.core.batch_inner import batch_inner_view

    bias = torch.randn(33, device="cuda").to(dtype)
    for kernel, stride, padding in ((3, 1, 1), (3, 2, 0), (3, 1, 3), (5, 2, 2), (7, 1, (3, 1)), (1, 2, 0), (1, 2, 1)):
        weight = sparse_weight(33, 19, kernel, kernel, 0.9, zero_channels=(4,), device="cuda").to(dtype)
        spec = ConvSpec(batch, 19, 33, 13, 13, kernel, kernel, stride, padding)
        x = inputs(batch, 19, 13, 13, device="cuda", dtype=dtype)
        residual = inputs(*spec.output_shape, seed=2, device="cuda", dtype=dtype)
        ref = (expected(x, weight, bias, stride, padding) + residual.double()).clamp(min=0)
        cudnn = relative_error(
            (torch.nn.functional.conv2d(x.to(memory_format=torch.channels_last), weight, bias, stride, padding)
             + residual).clamp(min=0), ref)
        limit = 1e-5 if dtype == torch.float32 else 2 * cudnn + 1e-5
        configs = [c for c in candidate_configs(spec, dtype) if c.variant == "batch"]
        assert configs
        for config in configs:
            packed = pack(weight, config)
            for inner in (False, True):
                source = batch_inner_view(x.shape, dtype, x.device).copy_(x) if inner else x
                out = (batch_inner_view(spec.output_shape, dtype, x.device) if inner
                       else torch.empty(spec.output_shape, dtype=dtype, device="cuda")).fill_(float("nan"))
                direct_conv2d(source, packed, bias, stride, padding, config, relu=True, residual=residual, out=out)
                assert relative_error(out, ref) <= limit, (config, kernel, stride, padding, inner)
                if inner and spec.padding != (0, 0):
                    padded = pack_path(source, packed, bias, stride, padding, config, True, residual)
                    assert torch.equal(out, padded), (config, kernel, stride, padding)


def test_chunked_rows_pad_to_the_chunk_and_decode():
    weight = sparse_weight(33, 3, 3, 3, 0.7, zero_channels=(0, 17))
    fmt = ChunkedCSRWeight.from_dense(weight, 8)
    slots = (fmt.row_ptr[1:] - fmt.row_ptr[:-1]).long()
    assert torch.all(slots % 8 == 0) and torch.all(slots >= fmt.row_nnz) and torch.all(slots < fmt.row_nnz + 8)
    assert slots[0] == 0 and slots[17] == 0
    assert torch.equal(fmt.to_dense(), weight)
    assert fmt.padding_overhead == pytest.approx((slots.sum() - fmt.nnz).item() / fmt.nnz)
