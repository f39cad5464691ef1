"""Backend `blocks` with the dense blocks a re-pruning chose (`format.given_decomposition`,
`extraction.provide_blocks`): exact cover, matching by mask, errors, and the kernel run on them (CPU
through Triton's interpreter; fp16 on CUDA)."""
import dataclasses

import pytest
import torch
from helpers.common import needs_cuda, needs_interpreter

from sparsecnn.backends import get_backend
from sparsecnn.backends.blocks.extraction import (
    clear_provided_blocks,
    extraction,
    provide_blocks,
    provided_blocks,
)
from sparsecnn.backends.blocks.format import given_decomposition
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

K, C, R, S = 33, 3, 3, 3  # odd channel count: the last tile holds one row


def tile_structure(seed=0, tile=16, keep=5):
    """Blocks of `tile` consecutive channels (the last one shorter), each sharing `keep` random
    columns of the K x C*R*S matrix, and the bool (K, C, R, S) mask of their cells plus two
    remainder cells outside every block."""
    gen = torch.Generator().manual_seed(seed)
    blocks, mask = [], torch.zeros(K, C * R * S, dtype=torch.bool)
    for start in range(0, K, tile):
        rows = list(range(start, min(K, start + tile)))
        cols = sorted(torch.randperm(C * R * S, generator=gen)[:keep].tolist())
        blocks.append((rows, cols))
        mask[torch.tensor(rows)[:, None], torch.tensor(cols)[None, :]] = True
    outside = (~mask).nonzero()[:2]
    mask[outside[:, 0], outside[:, 1]] = True
    return blocks, mask.reshape(K, C, R, S)


def weight_in(mask, seed=1, dtype=torch.float32):
    """Random non-zero values on the mask's cells (magnitude >= 0.1: none rounds to zero)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(mask.shape, generator=gen)
    return ((values.sign() + (values == 0)) * (values.abs() + 0.1) * mask).to(dtype)


def test_given_decomposition_covers_the_weight_exactly_with_the_given_blocks():
    blocks, mask = tile_structure()
    weight = weight_in(mask)
    weight.reshape(K, -1)[blocks[0][0][0], blocks[0][1][0]] = 0.0  # a zero inside a block stays a cell of it
    decomposition = given_decomposition(weight, blocks)
    assert torch.equal(decomposition.to_dense(), weight)
    assert [(b.rows.tolist(), b.cols.tolist()) for b in decomposition.blocks] == blocks
    matrix = weight.reshape(K, -1)
    for block in decomposition.blocks:
        assert torch.equal(block.values, matrix[block.rows[:, None], block.cols[None, :]])
    assert decomposition.remainder.nnz == 2
    report = decomposition.report
    assert report.partitioner == "given" and report.nnz == int(torch.count_nonzero(weight))
    assert report.nnz_in_blocks + 2 == report.nnz and report.num_levels == 1


@pytest.mark.parametrize("blocks, message", [
    ([([0, 1], [0, 1]), ([1, 2], [1, 2])], r"blocks\[1\] shares cells"),
    ([([0, K], [0])], r"blocks\[0\] rows must be distinct ints in \[0, 33\)"),
    ([([0], [C * R * S])], r"blocks\[0\] cols must be distinct ints in \[0, 27\)"),
    ([([0, 0], [1])], r"blocks\[0\] rows must be distinct"),
    ([([], [1])], r"blocks\[0\] rows"),
])
def test_given_decomposition_names_the_bad_block(blocks, message):
    with pytest.raises(ValueError, match=message):
        given_decomposition(torch.ones(K, C, R, S), blocks)


def test_given_decomposition_refuses_a_weight_that_is_not_a_4d_float_tensor():
    with pytest.raises(ValueError, match="weight must be a floating"):
        given_decomposition(torch.ones(K, C * R * S), [])
    with pytest.raises(ValueError, match="weight must be a floating"):
        given_decomposition(torch.ones(K, C, R, S, dtype=torch.int32), [])


def test_extraction_takes_the_provided_blocks_for_weights_inside_the_mask():
    blocks, mask = tile_structure()
    weight = weight_in(mask)
    algorithm1 = extraction(weight, 4)
    assert algorithm1.report.partitioner != "given"
    provide_blocks(mask, blocks)
    assert provided_blocks(mask) == tuple((tuple(rows), tuple(cols)) for rows, cols in blocks)
    scale = torch.linspace(0.5, 2.0, K).reshape(K, 1, 1, 1)  # BatchNorm folding scales each channel
    for candidate in (weight, weight * scale, (weight * scale).half(), weight * (torch.rand(mask.shape) < 0.5)):
        for t2 in (4, 12):
            decomposition = extraction(candidate, t2)
            assert decomposition.report.partitioner == "given" and decomposition.params.t2 == t2
            assert [(b.rows.tolist(), b.cols.tolist()) for b in decomposition.blocks] == blocks
            assert torch.equal(decomposition.to_dense(), candidate)
    outside = weight.clone()
    outside[~mask] = 1.0  # non-zeros outside the mask: another layer's weight
    assert extraction(outside, 4).report.partitioner != "given"
    assert extraction(torch.zeros_like(weight), 4).report.partitioner != "given"
    clear_provided_blocks()
    assert provided_blocks(mask) is None and extraction(weight, 4).report.partitioner != "given"


@pytest.mark.parametrize("policy", ["tf32", "fp16"])
def test_auto_tries_blocks_only_on_layers_whose_blocks_were_given(policy):
    from sparsecnn.tuning.precision import POLICIES
    from sparsecnn.tuning.select import candidates_for

    blocks, mask = tile_structure()
    weight, spec = weight_in(mask), ConvSpec(4, C, K, 13, 13, R, S, 2, 1)
    offered = lambda **kwargs: [c for c in candidates_for(spec, POLICIES[policy], "cuda", weight=weight, **kwargs)
                                if c.backend == "blocks"]
    assert offered() == []  # Algorithm 1's own blocks: not timed unasked
    assert offered(backends=["blocks"])  # named: every config
    provide_blocks(mask, blocks)
    assert offered() and {c.config.t2 for c in offered()} == {4, 8}
    clear_provided_blocks()


def test_the_smallest_covering_mask_wins_and_an_equal_mask_is_replaced():
    blocks, mask = tile_structure()
    wide_blocks, wide_mask = [(list(range(K)), list(range(C * R * S)))], torch.ones(K, C, R, S, dtype=torch.bool)
    provide_blocks(wide_mask, wide_blocks)
    provide_blocks(mask, blocks)
    assert len(extraction(weight_in(mask), 4).blocks) == len(blocks)
    assert len(extraction(weight_in(wide_mask), 4).blocks) == 1
    provide_blocks(mask.clone(), blocks[:1])
    assert len(extraction(weight_in(mask), 4).blocks) == 1


def test_provide_blocks_checks_its_arguments():
    blocks, mask = tile_structure()
    with pytest.raises(ValueError, match="mask must be a bool"):
        provide_blocks(mask.float(), blocks)
    with pytest.raises(ValueError, match="mask must be a bool"):
        provide_blocks(mask.reshape(K, -1), blocks)
    with pytest.raises(ValueError, match="shares cells"):
        provide_blocks(mask, blocks + blocks[:1])
    assert provided_blocks(mask) is None


def run_on_given_blocks(device, dtype):
    """(output, fp64 reference, packed weight, cuDNN's output) of backend `blocks` on a layer with
    provided tiles, N=3, 13x13 input, stride 2, padding 1, bias."""
    blocks, mask = tile_structure(tile=16, keep=6)
    weight = weight_in(mask).to(device, dtype)
    provide_blocks(mask, blocks)
    backend = get_backend("blocks")
    spec = ConvSpec(3, C, K, 13, 13, R, S, 2, 1)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, C, 13, 13, generator=gen) + 0.1).to(device, dtype)
    bias = torch.randn(K, generator=gen).to(device, dtype)
    config = dataclasses.replace(backend.configs(spec, dtype)[0], block_m=16)
    packed = backend.prepare(weight, config)
    out = backend.run(x, packed, bias, spec, config)
    dense = torch.nn.functional.conv2d(x, weight, bias, 2, 1)
    return out, reference_conv(x, weight, bias, stride=2, padding=1, fp64=True), packed, dense


@needs_interpreter
def test_the_kernel_runs_the_provided_blocks_exactly():
    out, ref, packed, _ = run_on_given_blocks("cpu", torch.float32)
    assert packed.decomposition.report.partitioner == "given"
    assert packed.stats["tiles"] == 3  # one kernel tile per given block of 16, 16 and 1 channels
    assert relative_error(out, ref) < 1e-5


def structure_case(case):
    """(blocks, mask, weight) of the odd cases: tiles of 16, 32 or 64 rows over K=33 (the last tile
    short), one tile group whose weights are all zero, and a fully dense layer as one block."""
    if case == "dense":
        mask = torch.ones(K, C, R, S, dtype=torch.bool)
        return [(list(range(K)), list(range(C * R * S)))], mask, weight_in(mask)
    blocks, mask = tile_structure(tile=16 if case == "zero group" else case, keep=6)
    weight = weight_in(mask)
    if case == "zero group":
        weight.reshape(K, -1)[torch.tensor(blocks[1][0])[:, None], torch.tensor(blocks[1][1])[None, :]] = 0.0
    return blocks, mask, weight


@pytest.mark.quick_sample(6)
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", [16, 32, 64, "zero group", "dense"], ids=str)
@pytest.mark.parametrize("kernel_case", [(1, 3), (2, 0), (1, 2)], ids=lambda c: f"stride{c[0]}-pad{c[1]}")
def test_every_candidate_config_on_given_tiles(case, kernel_case, dtype):
    """fp32: every precision's config (the interpreter multiplies tf32 and tf32x3 dots in fp32, so
    all are exact here); fp16: the half-precision dot loop, within 2x of torch's own fp16 conv."""
    stride, padding = kernel_case
    blocks, mask, weight = structure_case(case)
    provide_blocks(mask, blocks)
    backend = get_backend("blocks")
    spec = ConvSpec(2, C, K, 13, 13, R, S, stride, padding)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(2, C, 13, 13, generator=gen) + 0.1).to(dtype)
    bias = torch.randn(K, generator=gen).to(dtype)
    weight = weight.to(dtype)
    ref = reference_conv(x.double(), weight.double(), bias.double(), stride=stride, padding=padding, fp64=True)
    own = torch.nn.functional.conv2d(x, weight, bias, stride, padding)
    bound = 1e-5 if dtype == torch.float32 else 2 * relative_error(own, ref) + 1e-6
    from sparsecnn.backends.blocks.kernel import blocks_conv2d

    for config in backend.configs(spec, dtype):
        packed = backend.prepare(weight, config)
        assert packed.decomposition.report.partitioner == "given"
        out = torch.full(spec.output_shape, float("nan"), dtype=dtype)  # every element must be written
        assert blocks_conv2d(x, packed, bias, stride, padding, config, out=out) is out
        assert relative_error(out, ref) < bound, config


@pytest.mark.gpu
@needs_cuda
def test_the_kernel_runs_the_provided_blocks_in_fp16_on_cuda():
    out, ref, packed, cudnn = run_on_given_blocks("cuda", torch.float16)
    assert packed.decomposition.report.partitioner == "given"
    assert relative_error(out, ref) <= 2 * relative_error(cudnn, ref) + 1e-5
