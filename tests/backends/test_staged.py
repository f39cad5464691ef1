"""The staged-input sparse conv (`kernels/codegen/staged.py`) and its format (`formats/staged.py`).

CPU: config validation, the format's packing (exact round trip, load balance, chunk pointers), the
kernel's CUDA C run as C++ on odd shapes for every candidate config (needs g++), and every
candidate compiled by nvcc/ptxas without spills (needs the CUDA toolkit). GPU (`gpu` marker): the
kernel against the fp64 reference, every candidate config, both output layouts, and CUDA graphs.
"""
import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.codegen import (
    masked_weight,
    needs_gxx,
    needs_tools,
    reference_with_epilogue,
)
from helpers.common import needs_cuda
from helpers.staged import run_staged_on_cpu

from sparsecnn.backends import get_backend
from sparsecnn.backends.staged import kernel as staged
from sparsecnn.backends.staged import source as staged_source
from sparsecnn.backends.staged.format import StagedCSRWeight
from sparsecnn.core import toolchain
from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.reference import relative_error
from sparsecnn.core.spec import ConvSpec

gpu = pytest.mark.gpu
ODD_SHAPES = [  # (C, K, H, W, R, stride, padding): the odd cases, batch 32
    (3, 33, 13, 13, 3, 1, 1),
    (5, 33, 13, 11, 3, 2, 0),
    (4, 9, 7, 7, 1, 1, 0),
    (6, 17, 13, 13, 5, 2, 2),
    (7, 12, 9, 9, 7, 1, 3),
    (16, 40, 8, 8, 1, 2, 0),
    (5, 9, 13, 13, 3, 3, 1),
]


def _spec(c, k, h, w, r, stride, padding, n=32):
    return ConvSpec(n, c, k, h, w, r, r, (stride, stride), (padding, padding))


def _weight(spec, sparsity=0.5, seed=0):
    return masked_weight(spec, sparsity, seed)


_reference = reference_with_epilogue


# --- config and format (CPU) ---------------------------------------------------------------------


@pytest.mark.parametrize("fields, name", [
    (dict(tile_w=6), "tile_w"), (dict(tile_h=0), "tile_h"), (dict(tile_h=8, tile_w=8), "32 pixels"),
    (dict(chunk_c=0), "chunk_c"), (dict(warps=3), "warps"), (dict(rows_per_warp=1.5), "rows_per_warp"),
    (dict(rows_per_warp=16, tile_h=4, tile_w=4), "accumulators"), (dict(out_layout="nhwc"), "out_layout"),
])
def test_config_validation_names_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        staged.StagedConfig(**fields)


def test_config_round_trips_through_dict():
    config = staged.StagedConfig(4, 4, 8, 4, 8)
    assert staged.StagedConfig.from_dict(dataclasses.asdict(config)) == config


@pytest.mark.parametrize("shape", ODD_SHAPES + [(256, 256, 14, 14, 3, 1, 1), (512, 512, 7, 7, 3, 1, 1)])
def test_candidate_configs_fit_the_layer(shape):
    spec = _spec(*shape)
    configs = staged.candidate_configs(spec)
    assert configs and len(set(configs)) == len(configs)
    for config in configs:
        staged.check_layer(spec, config)


def test_layers_the_kernel_cannot_run_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of 32"):
        staged.check_layer(_spec(3, 8, 9, 9, 3, 1, 1, n=30), staged.StagedConfig())
    with pytest.raises(ValueError, match="shared memory"):
        staged.check_layer(_spec(3, 8, 9, 9, 7, 2, 3), staged.StagedConfig(4, 8, 64, 1, 8))


@pytest.mark.parametrize("sparsity", [0.5, 0.9, 0.99, 1.0])
def test_packing_round_trips_exactly(sparsity):
    spec = _spec(13, 33, 9, 9, 3, 2, 1)
    weight = _weight(spec, sparsity)
    for config in staged.candidate_configs(spec):
        packed = staged.pack_weight(weight, config)
        assert torch.equal(packed.to_dense(), weight)
        assert packed.nnz == int((weight != 0).sum())
        assert sorted(packed.channel[packed.channel >= 0].tolist()) == list(range(spec.K))
        assert packed.channel.numel() % config.rows_per_block == 0


def test_chunk_pointers_delimit_each_blocks_segment_per_chunk():
    spec = _spec(20, 8, 5, 5, 3, 1, 1)
    packed = StagedCSRWeight.from_dense(_weight(spec), chunk_c=8, rows_per_warp=2, warps=2)
    entries = packed.entries(4, 6, 8)
    assert packed.chunk_ptr.shape == (2, 3, 5) and packed.rows_per_block == 4
    flat = packed.chunk_ptr.reshape(-1, 5)
    assert (flat[1:, 0] == flat[:-1, -1]).all() and flat[0, 0] == 0 and flat[-1, -1] == packed.nnz
    assert packed.max_segment == int((flat[:, -1] - flat[:, 0]).max())
    for block in range(2):
        for chunk in range(3):
            for row in range(4):
                begin, end = packed.chunk_ptr[block, chunk, row], packed.chunk_ptr[block, chunk, row + 1]
                cols = packed.cols[begin:end]
                assert (cols // 9 // 8 == chunk).all() and (cols[1:] > cols[:-1]).all()
                position = entries[begin:end, 1] // 8
                assert torch.equal(position // 24, cols // 9 % 8)                      # channel in the chunk
                assert torch.equal(position % 24 // 6 * 3 + position % 6, cols % 9)    # tap (r, s)
                assert torch.equal(entries[begin:end, 0].view(torch.float32), packed.values[begin:end])


def test_warps_get_about_the_same_number_of_non_zeros():
    generator = torch.Generator().manual_seed(3)
    keep = torch.rand(64, generator=generator)[:, None, None, None] * 0.4   # skewed: 0-40% kept per channel
    weight = torch.randn(64, 32, 3, 3) * (torch.rand(64, 32, 3, 3, generator=generator) < keep)
    packed = StagedCSRWeight.from_dense(weight, 8, rows_per_warp=4, warps=4)
    per_row = (packed.chunk_ptr[:, :, 1:] - packed.chunk_ptr[:, :, :-1]).sum(1).reshape(-1)
    per_warp = per_row.reshape(-1, 4).sum(1).float()
    assert per_warp.max() / per_warp.mean() < 1.1
    assert per_row.max() / per_row.float().mean() > 1.8   # the channels themselves are skewed


def test_the_format_round_trips_through_an_artefact_tree():
    from sparsecnn.artifact.packing import decode_packed, encode_packed

    packed = staged.pack_weight(_weight(_spec(13, 33, 9, 9, 3, 1, 1)), staged.StagedConfig(4, 4, 4, 4, 4))
    tensors = {}
    tree = json.loads(json.dumps(encode_packed(packed, "p/", torch.device("cpu"), tensors)))
    restored = decode_packed(tree, tensors, torch.device("cpu"))
    assert type(restored) is StagedCSRWeight and torch.equal(restored.to_dense(), packed.to_dense())
    assert (restored.max_segment, restored.rows_per_block, restored.chunk_c) == (packed.max_segment, 16, 4)
    assert torch.equal(restored.entries(6, 6, 8), packed.entries(6, 6, 8))


def test_entries_refuse_a_halo_smaller_than_the_kernel():
    with pytest.raises(ValueError, match="halo"):
        StagedCSRWeight.from_dense(torch.ones(4, 3, 3, 3), 4, 1, 1).entries(2, 6, 8)


# --- the CUDA C on the CPU, and its compile ------------------------------------------------------


def _cpu_case(shape, config, relu, with_bias, with_residual, batch_inner, tmp_path, pool=0, weight=None):
    spec = _spec(*shape)
    generator = torch.Generator().manual_seed(1)
    weight = _weight(spec) if weight is None else weight
    x = torch.randn(spec.input_shape, generator=generator)
    bias = torch.randn(spec.K, generator=generator) if with_bias else None
    residual = torch.randn(spec.output_shape, generator=generator) if with_residual else None
    n, k, p, q = staged.pooled_shape(spec.output_shape, pool)
    strides = (1, p * q * n, q * n, n) if batch_inner else (k * p * q, p * q, q, 1)
    packed = staged.pack_weight(weight, config)
    y = run_staged_on_cpu(x.numpy(), packed, spec, config, None if bias is None else bias.numpy(),
                          None if residual is None else residual.numpy(), relu, strides, tmp_path, pool)
    assert not np.isnan(y).any(), "outputs left unwritten"
    ref = _reference(x, weight, bias, residual, relu, spec)
    if pool:
        ref = F.max_pool2d(ref, pool)
    assert relative_error(torch.from_numpy(y), ref) < 1e-6


@pytest.mark.quick_sample(9)
@needs_gxx
@pytest.mark.parametrize("shape", ODD_SHAPES,
                         ids=[f"C{s[0]}K{s[1]}H{s[2]}W{s[3]}R{s[4]}s{s[5]}p{s[6]}" for s in ODD_SHAPES])
def test_kernel_source_computes_the_convolution_on_the_cpu(shape, tmp_path):
    """Small configs (few threads per block) on every odd shape, all epilogue flags and both
    output layouts."""
    config = staged.StagedConfig(tile_h=2, tile_w=4, chunk_c=2, rows_per_warp=3, warps=2)
    for relu, with_bias, with_residual, batch_inner in ((True, True, True, True), (False, False, False, False),
                                                        (True, True, False, False)):
        _cpu_case(shape, config, relu, with_bias, with_residual, batch_inner, tmp_path)


@needs_gxx
@pytest.mark.parametrize("shape, tile", [((3, 33, 13, 13, 3, 1, 1), (2, 4)), ((6, 8, 13, 11, 3, 2, 0), (4, 4)),
                                         ((5, 9, 8, 8, 1, 1, 0), (2, 8))])
@pytest.mark.slow
def test_fused_pool_matches_max_pool_of_the_convolution_on_the_cpu(shape, tile, tmp_path):
    """The 2x2 stride-2 pool in the epilogue: odd output sizes (floor mode), strides, 1x1, tiles
    with one and two pixel columns per lane group (each shape once and each tile once), both
    layouts, with and without bias and ReLU."""
    config = staged.StagedConfig(tile_h=tile[0], tile_w=tile[1], chunk_c=2, rows_per_warp=3, warps=2)
    for relu, with_bias, batch_inner in ((True, True, True), (False, False, False)):
        _cpu_case(shape, config, relu, with_bias, False, batch_inner, tmp_path, pool=2)


def test_fused_pool_is_refused_where_the_kernel_cannot_pool():
    spec = _spec(8, 8, 9, 9, 3, 1, 1)
    with pytest.raises(ValueError, match="tile_h"):
        staged.check_pool(2, staged.StagedConfig(tile_h=1, tile_w=4), spec, False)
    with pytest.raises(ValueError, match="residual"):
        staged.check_pool(2, staged.StagedConfig(), spec, True)
    with pytest.raises(ValueError, match="pool must be"):
        staged.check_pool(3, staged.StagedConfig(), spec, False)


@pytest.mark.quick_sample(2)
@needs_gxx
@pytest.mark.parametrize("density", ["all-zero", "dense"])
@pytest.mark.slow
def test_all_zero_and_fully_dense_weights_on_the_cpu(density, tmp_path):
    """No non-zero at all (the output is the epilogue of the bias alone), and no zero at all."""
    shape = (5, 9, 13, 13, 3, 1, 1)
    spec = _spec(*shape)
    weight = torch.zeros(spec.weight_shape) if density == "all-zero" else torch.randn(spec.weight_shape) + 4.0
    config = staged.StagedConfig(tile_h=2, tile_w=4, chunk_c=2, rows_per_warp=3, warps=2)
    _cpu_case(shape, config, True, True, True, True, tmp_path, weight=weight)
    _cpu_case(shape, config, False, True, False, False, tmp_path, weight=weight)


@needs_gxx
@pytest.mark.slow
def test_every_candidate_config_computes_the_convolution_on_the_cpu(tmp_path):
    shape = (6, 20, 9, 9, 3, 1, 1)
    for config in staged.candidate_configs(_spec(*shape)):
        _cpu_case(shape, config, True, True, True, True, tmp_path)


@pytest.mark.quick_sample(4)
@needs_tools
@pytest.mark.parametrize("geometry", [(1, 1, 0), (3, 1, 1), (3, 2, 1), (7, 2, 3)])
def test_every_candidate_compiles_without_spills(geometry):
    r, stride, padding = geometry
    spec = _spec(64, 64, 28, 28, r, stride, padding)
    for config in staged.candidate_configs(spec):
        source = staged.kernel_source(spec, config)
        ptx, _ = toolchain.nvcc_ptx(source)
        _, info, _ = toolchain.ptxas_cubin(ptx)
        assert info.spill_stores == 0 and info.spill_loads == 0, (config, info)
        blocks = staged_source.MIN_BLOCKS_PER_SM[config.warps]
        assert info.registers * 32 * config.warps * blocks <= 65536, (config, info)   # that many blocks fit an SM


# --- GPU -------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", ODD_SHAPES + [(64, 64, 28, 28, 3, 1, 1), (256, 64, 14, 14, 1, 1, 0)])
def test_matches_the_fp64_reference_for_every_config(shape):
    spec = _spec(*shape, n=64)
    weight = _weight(spec, 0.9).cuda()
    x = torch.randn(spec.input_shape, device="cuda")
    bias = torch.randn(spec.K, device="cuda")
    for config in staged.candidate_configs(spec):
        packed = staged.pack_weight(weight, config)
        for out_layout in staged.OUT_LAYOUTS:
            config = dataclasses.replace(config, out_layout=out_layout)
            residual = new_output(spec.output_shape, x, config.out_layout).copy_(torch.randn(spec.output_shape))
            torch.empty(4 * residual.numel(), device="cuda").fill_(float("nan"))   # poison the allocator's memory
            y = staged.staged_conv2d(x, packed, spec.stride, spec.padding, config, bias, residual, relu=True)
            assert y.stride() == residual.stride()
            ref = _reference(x.cpu(), weight.cpu(), bias.cpu(), residual.cpu(), True, spec)
            assert relative_error(y.cpu(), ref) < 1e-6, config


@gpu
@needs_cuda
def test_cuda_graph_replay_equals_eager():
    spec = _spec(32, 48, 14, 14, 3, 1, 1)
    weight = _weight(spec, 0.9).cuda()
    config = staged.candidate_configs(spec)[0]
    packed = staged.pack_weight(weight, config)
    x = torch.randn(spec.input_shape, device="cuda")
    run = lambda: staged.staged_conv2d(x, packed, spec.stride, spec.padding, config)   # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_static, run())


def test_backend_declares_what_it_runs():
    backend = get_backend("staged")
    spec = _spec(16, 32, 14, 14, 3, 1, 1)
    assert dict(backend.dtypes) == {"cuda": (torch.float32,)}
    assert backend.unsupported_reason(spec, torch.float32, "cuda") is None
    assert "cpu" in backend.unsupported_reason(spec, torch.float32, "cpu")
    assert "float16" in backend.unsupported_reason(spec, torch.float16, "cuda")
    assert "multiple of 32" in backend.unsupported_reason(spec.with_batch(8), torch.float32, "cuda")
    assert "groups" in backend.unsupported_reason(dataclasses.replace(spec, groups=2), torch.float32, "cuda")
    assert backend.configs(spec, torch.float32) == staged.candidate_configs(spec)


@gpu
@needs_cuda
def test_the_op_passes_opcheck_and_the_backend_fuses_its_epilogue():
    spec = _spec(24, 40, 13, 13, 3, 2, 1)
    backend = get_backend("staged")
    weight = _weight(spec, 0.9).cuda()
    x, bias = torch.randn(spec.input_shape, device="cuda"), torch.randn(spec.K, device="cuda")
    residual = torch.randn(spec.output_shape, device="cuda")
    for config in backend.configs(spec, torch.float32):
        packed = backend.prepare(weight, config)
        call = backend.bind(packed, spec, config, torch.float32, True)
        torch.library.opcheck(call.fn, (x, *call.tensors, bias, residual, *call.static, True))
        ref = _reference(x.cpu(), weight.cpu(), bias.cpu(), residual.cpu(), True, spec)
        assert relative_error(call(x, bias, residual, True).cpu(), ref) < 1e-6


@gpu
@needs_cuda
def test_fused_pool_on_the_gpu_for_every_config_and_through_the_op():
    """Every candidate with a 2x2 pool fused (both layouts, odd output size: floor mode), the op's
    opcheck with the pool, and a SparseConv2d on staged ending in that pool binding the fused kernel."""
    from sparsecnn.core.pool_args import PoolArgs
    from sparsecnn.nn import SparseConv2d

    spec = _spec(24, 40, 27, 27, 3, 1, 1)
    backend = get_backend("staged")
    weight = _weight(spec, 0.9).cuda()
    x, bias = torch.randn(spec.input_shape, device="cuda"), torch.randn(spec.K, device="cuda")
    ref = F.max_pool2d(_reference(x.cpu(), weight.cpu(), bias.cpu(), None, True, spec), 2)
    for config in backend.configs(spec, torch.float32):
        packed = backend.prepare(weight, config)
        for out_layout in staged.OUT_LAYOUTS:
            config = dataclasses.replace(config, out_layout=out_layout)
            torch.empty(4 * spec.N * spec.K * spec.P * spec.Q, device="cuda").fill_(float("nan"))
            call = backend.bind_pooled(packed, spec, config, torch.float32, True, PoolArgs.of(2))
            assert relative_error(call(x, bias, None, True).cpu(), ref) < 1e-6, config
    torch.library.opcheck(call.fn, (x, *call.tensors, bias, None, *call.static, True))
    assert backend.bind_pooled(packed, spec, config, torch.float32, True, PoolArgs.of(3, 2)) is None
    layer = SparseConv2d(weight, bias, backend="staged", config=config, stride=1, padding=1, activation="relu")
    layer.pool = PoolArgs.of(2)
    assert relative_error(layer(x).cpu(), ref) < 1e-6 and layer._binding.pooled


def test_auto_tries_staged_only_on_large_enough_layers():
    backend = get_backend("staged")
    for shape, batch, tried in (((64, 64, 28, 28, 3, 1, 1), 32, True), ((256, 256, 14, 14, 3, 1, 1), 32, False),
                                ((256, 256, 14, 14, 3, 1, 1), 128, True), ((512, 512, 7, 7, 3, 1, 1), 32, False),
                                ((512, 512, 14, 14, 3, 1, 1), 32, True), ((1024, 256, 14, 14, 1, 1, 0), 32, False)):
        spec = _spec(*shape, n=batch)
        assert bool(backend.auto_configs(spec, torch.float32)) == tried
        assert backend.configs(spec, torch.float32)   # named explicitly, every layer still has candidates
