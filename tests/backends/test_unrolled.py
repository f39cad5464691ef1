"""The unrolled kernel (`kernels/codegen/unrolled.py`: a layer's weights as FMA immediates in PTX) and
its backend.

CPU: config validation, the channel groups, the auto config rule, the PTX run by a small
interpreter (`helpers/unrolled.py`) on odd shapes for every candidate config, both output layouts,
with and without bias, residual and ReLU, and every candidate compiled by ptxas without spills
(needs the CUDA toolkit); the same for the float16 kernel's candidates (odd N included), whose
error must stay within 2x that of the fp64 output rounded to float16, and the fp32 PTX unchanged
by the float16 writer. GPU (`gpu` marker): the same cases against the fp64 reference (float16:
within 2x cuDNN's own float16 error on the same inputs), the op's opcheck, CUDA graphs, and a
SparseConv2d on the backend.
"""
import dataclasses
import hashlib

import numpy as np
import pytest
import torch
from helpers.codegen import (
    assert_graph_replay_matches,
    masked_weight,
    needs_tools,
    reference_with_epilogue,
)
from helpers.common import needs_cuda
from helpers.unrolled import run_unrolled_on_cpu

from sparsecnn import settings
from sparsecnn.backends import get_backend
from sparsecnn.backends.unrolled import kernel as unrolled
from sparsecnn.backends.unrolled import source as unrolled_source
from sparsecnn.core import toolchain
from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.reference import relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.precision import resolve_policy
from sparsecnn.tuning.select import candidates_for

gpu = pytest.mark.gpu
ODD_SHAPES = [  # (N, C, K, H, W, R, stride, padding): the odd cases
    (3, 3, 33, 13, 13, 3, 1, 1),
    (1, 5, 33, 13, 11, 3, 2, 0),
    (4, 4, 9, 7, 7, 1, 1, 0),
    (2, 6, 17, 13, 13, 5, 2, 2),
    (3, 7, 12, 9, 9, 7, 1, 3),
    (2, 16, 40, 8, 8, 1, 2, 0),
    (2, 5, 9, 13, 13, 3, 3, 1),
    (3, 5, 33, 12, 12, 3, 1, 1),    # Q divisible by the register tiles' tq (2, 4): they run too
    (2, 6, 17, 13, 16, 5, 2, 2),
    (1, 3, 9, 9, 8, 7, 1, 3),
]


def _spec(n, c, k, h, w, r, stride, padding):
    return ConvSpec(n, c, k, h, w, r, r, (stride, stride), (padding, padding))


def _weight(spec, sparsity=0.7, seed=0):
    return masked_weight(spec, sparsity, seed)


_reference = reference_with_epilogue


# --- config, groups, PTX (CPU) ----------------------------------------------------------------------


@pytest.mark.parametrize("fields, name", [
    (dict(bk=0), "bk"), (dict(bk=129), "bk"), (dict(threads=48), "threads"), (dict(threads=2048), "threads"),
    (dict(bk=1.5), "bk"), (dict(out_layout="nhwc"), "out_layout"), (dict(slices=0), "slices"),
    (dict(slices=9), "slices"), (dict(threads=512, slices=4), "slices"), (dict(bk=64, slices=3), "shared memory"),
    (dict(tq=0), "tq"), (dict(tq=9), "tq"), (dict(bk=64, tq=4), "accumulators")])
def test_config_validation_names_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        unrolled.UnrolledConfig(**fields)


def test_config_round_trips_through_dict():
    config = unrolled.UnrolledConfig(16, 64, "batch_inner")
    assert unrolled.UnrolledConfig.from_dict(dataclasses.asdict(config)) == config


def test_groups_partition_the_channels_and_balance_their_non_zeros():
    weight = np.zeros((40, 8, 3, 3), np.float32)
    for k in range(40):
        weight[k].flat[: (k * 7) % 61] = 1.0
    groups = unrolled_source.channel_groups(weight, 8)
    assert sorted(k for group in groups for k in group) == list(range(40))
    assert all(len(group) <= 8 for group in groups) and len(groups) == 5
    work = [int(np.count_nonzero(weight[group])) for group in groups]
    assert max(work) - min(work) <= max(np.count_nonzero(weight.reshape(40, -1), axis=1))


def test_modules_are_consecutive_runs_of_groups_under_the_non_zero_limit():
    weight = np.zeros((40, 8, 3, 3), np.float32)
    for k in range(40):
        weight[k].flat[: (k * 7) % 61] = 1.0
    groups = unrolled_source.channel_groups(weight, 4)
    counts = [int(np.count_nonzero(weight[group])) for group in groups]
    for limit in (1, max(counts), 2 * max(counts) + 1, sum(counts)):
        runs = unrolled_source.split_groups(weight, groups, limit)
        assert [group for run in runs for group in run] == groups
        sizes = [sum(int(np.count_nonzero(weight[group])) for group in run) for run in runs]
        assert all(size <= limit or len(run) == 1 for size, run in zip(sizes, runs))
        assert all(a + int(np.count_nonzero(weight[b[0]])) > limit for a, b in zip(sizes, runs[1:]))  # runs are full
    assert len(unrolled_source.split_groups(weight, groups, 1)) == len(groups)
    assert len(unrolled_source.split_groups(weight, groups, sum(counts))) == 1


def test_columns_list_each_non_zero_once_at_its_padded_offset():
    spec = _spec(2, 3, 5, 6, 7, 3, 1, 1)
    weight = _weight(spec).numpy()
    group = [0, 2, 4]
    columns = unrolled_source.group_columns(weight, group, spec)
    assert sum(len(column.terms) for column in columns) == np.count_nonzero(weight[group])
    for column in columns:
        assert column.offset == column.c * 8 * 9 * 2 + column.r * 9 * 2 + column.s * 2
        for j, value in column.terms:
            assert weight[group[j], column.c, column.r, column.s] == np.float32(value) != 0


def test_slices_share_each_groups_columns_by_their_non_zeros():
    spec = _spec(2, 16, 8, 9, 9, 3, 1, 1)
    weight = _weight(spec, 0.8).numpy()
    columns = unrolled_source.group_columns(weight, list(range(8)), spec)
    for slices in unrolled.SLICE_CHOICES:
        runs = unrolled_source.slice_columns(columns, slices)
        assert len(runs) == slices and [c for run in runs for c in run] == columns   # in order, each once
        fmas = [sum(len(c.terms) for c in run) for run in runs]
        assert max(fmas) - min(fmas) <= 2 * max(len(c.terms) for c in columns), fmas
    assert unrolled_source.slice_columns([], 4) == [[], [], [], []]


@pytest.mark.parametrize("tq, stride, loads_per_row", [(1, 1, 3), (4, 1, 6), (4, 2, 9), (2, 3, 6)])
def test_register_tiles_load_each_input_column_of_a_row_once(tq, stride, loads_per_row):
    """A dense 3x3 row: tq output columns at `stride` read (tq - 1) * stride + 3 inputs, not 3 * tq."""
    spec = _spec(1, 2, 4, 9, 12, 3, stride, 1)
    weight = torch.randn(spec.weight_shape).numpy()
    columns = unrolled_source.group_columns(weight, [0, 1, 2, 3], spec)
    rows = unrolled_source.tile_loads(columns, tq, stride)
    assert [key for key, _, _ in rows] == [(c, r) for c in range(2) for r in range(3)]
    assert all(len(loads) == loads_per_row for _, _, loads in rows)
    assert sum(len(row) for _, row, _ in rows) == len(columns)


def test_weights_become_exact_immediates():
    assert unrolled_source.f32_hex(1.0) == "0f3F800000"
    assert unrolled_source.f32_hex(float(np.float32(-0.1))) == "0fBDCCCCCD"
    with pytest.raises(ValueError, match="finite"):
        unrolled_source.f32_hex(float("inf"))


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_every_candidate_computes_the_convolution_on_the_cpu(shape):
    spec = _spec(*shape)
    weight = _weight(spec)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(spec.input_shape, generator=generator)
    bias = torch.randn(spec.K, generator=generator)
    residual = torch.randn(spec.output_shape, generator=generator)
    for index, config in enumerate(unrolled.candidate_configs(spec, int(weight.count_nonzero()))):
        layout = unrolled.OUT_LAYOUTS[index % 2]
        config = dataclasses.replace(config, out_layout=layout)
        with_epilogue = index % 2 == 0
        args = (bias, residual, True) if with_epilogue else (None, None, False)
        part_fmas = (None, 1, 40)[index % 3]   # one module, one per group, runs of groups
        y = run_unrolled_on_cpu(x.numpy(), weight.numpy(), spec, config,
                                *(None if a is None else (a.numpy() if isinstance(a, torch.Tensor) else a)
                                  for a in args), part_fmas=part_fmas)
        assert not np.isnan(y).any(), config
        assert relative_error(torch.from_numpy(y), _reference(x, weight, *args, spec)) < 1e-6, config


@pytest.mark.parametrize("density", ["all-zero", "dense"])
def test_all_zero_and_fully_dense_weights_on_the_cpu(density):
    """No non-zero at all (the output is the epilogue of the bias alone), and no zero at all."""
    spec = _spec(3, 5, 9, 13, 13, 3, 1, 1)
    weight = torch.zeros(spec.weight_shape) if density == "all-zero" else torch.randn(spec.weight_shape) + 4.0
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(spec.input_shape, generator=generator)
    bias, residual = torch.randn(spec.K, generator=generator), torch.randn(spec.output_shape, generator=generator)
    for config in unrolled.candidate_configs(spec, int(weight.count_nonzero())):
        y = run_unrolled_on_cpu(x.numpy(), weight.numpy(), spec, config, bias.numpy(), residual.numpy(), True)
        assert not np.isnan(y).any(), config
        assert relative_error(torch.from_numpy(y), _reference(x, weight, bias, residual, True, spec)) < 1e-6, config


def test_auto_config_keeps_enough_threads_per_column():
    """bk 32 in one slice where enough threads walk each column, else bk 32 in two slices."""
    def chosen(*shape):
        config = unrolled.auto_config(_spec(*shape))
        assert config in unrolled.CANDIDATES
        return config.bk, config.slices

    assert chosen(32, 512, 128, 28, 28, 1, 1, 0) == (32, 1)    # layer2 1x1: 25088 positions
    assert chosen(32, 128, 128, 28, 28, 3, 1, 1) == (32, 1)    # layer2 3x3
    assert chosen(32, 256, 1024, 14, 14, 1, 1, 0) == (32, 1)   # layer3 expansion
    assert chosen(32, 1024, 256, 14, 14, 1, 1, 0) == (32, 2)   # layer3 1x1 reduction: bk 16 in one slice
    assert chosen(32, 256, 256, 14, 14, 3, 1, 1) == (32, 2)    # layer3 3x3: bk 8 in one slice
    assert chosen(1, 512, 512, 7, 7, 3, 1, 1) == (32, 2)       # too few threads at all


def test_layers_the_kernel_cannot_take_are_refused_with_the_reason():
    spec = _spec(32, 64, 64, 14, 14, 3, 1, 1)
    with pytest.raises(ValueError, match="non-zeros"):
        unrolled.check_layer(spec, unrolled.UnrolledConfig(), nnz=unrolled.MAX_KERNEL_FMAS + 1)
    with pytest.raises(ValueError, match="groups"):
        unrolled.check_layer(dataclasses.replace(spec, groups=2), unrolled.UnrolledConfig())
    with pytest.raises(ValueError, match="32-bit"):
        unrolled.check_layer(_spec(512, 256, 256, 64, 64, 3, 1, 1), unrolled.UnrolledConfig())


def test_the_non_zero_limit_can_be_raised_by_the_environment(monkeypatch):
    spec = _spec(32, 64, 64, 14, 14, 3, 1, 1)
    monkeypatch.setenv(settings.UNROLLED_MAX_NNZ.name, str(unrolled.MAX_KERNEL_FMAS * 2))
    unrolled.check_layer(spec, unrolled.UnrolledConfig(), nnz=unrolled.MAX_KERNEL_FMAS + 1)
    with pytest.raises(ValueError, match="non-zeros"):
        unrolled.check_layer(spec, unrolled.UnrolledConfig(), nnz=unrolled.MAX_KERNEL_FMAS * 2 + 1)
    for bad in ("0", "-5", "many"):
        monkeypatch.setenv(settings.UNROLLED_MAX_NNZ.name, bad)
        with pytest.raises(ValueError, match=settings.UNROLLED_MAX_NNZ.name):
            unrolled.max_kernel_fmas()


# The spill checks compile one candidate per test case (each takes seconds in ptxas), so that xdist
# spreads them over the workers instead of one worker running them all at the end of a run.
SPILL_SPEC = _spec(32, 32, 96, 16, 16, 3, 1, 1)   # Q = 16: every tq divides it


def _config_id(config):
    return f"bk{config.bk}-t{config.threads}-s{config.slices}-tq{config.tq}"


def test_every_candidate_is_offered_on_the_spill_check_layer():
    assert len(unrolled.candidate_configs(SPILL_SPEC, 0)) == len(unrolled.CANDIDATES)
    assert len(unrolled.candidate_configs(SPILL_SPEC, 0, torch.float16)) == len(unrolled.HALF_CANDIDATES)


@needs_tools
@pytest.mark.slow
@pytest.mark.parametrize("config", unrolled.CANDIDATES, ids=_config_id)
def test_every_candidate_compiles_without_spills(config):
    weight = _weight(SPILL_SPEC, 0.9).numpy()
    _, info, _ = toolchain.ptxas_cubin(unrolled_source.kernel_ptx(weight, SPILL_SPEC, config.bk, config.threads,
                                                                  slices=config.slices, tq=config.tq))
    assert info.spill_stores == 0 and info.spill_loads == 0, (config, info)


def test_backend_declares_what_it_runs(generated_backends_ready):
    backend = get_backend("unrolled")
    spec = _spec(32, 256, 256, 14, 14, 3, 1, 1)
    assert dict(backend.dtypes) == {"cuda": (torch.float32, torch.float16)}
    assert backend.unsupported_reason(spec, torch.float32, "cuda") is None
    assert backend.unsupported_reason(spec, torch.float16, "cuda") is None
    assert "cpu" in backend.unsupported_reason(spec, torch.float32, "cpu")
    assert "bfloat16" in backend.unsupported_reason(spec, torch.bfloat16, "cuda")
    assert "dilation" in backend.unsupported_reason(dataclasses.replace(spec, dilation=(2, 2)), torch.float32, "cuda")
    assert backend.configs(spec, torch.float32) == [c for c in unrolled.CANDIDATES if c.tq in (1, 2)]   # Q = 14
    assert backend.auto_configs(spec, torch.float32) == [unrolled.auto_config(spec)]
    for shape in [(32, 512, 128, 28, 28, 1, 1, 0), (32, 256, 256, 14, 14, 3, 2, 1), (32, 512, 2048, 7, 7, 1, 1, 0)]:
        layer = _spec(*shape)   # what auto tries is among the configs (the tuner offers only those)
        assert set(backend.auto_configs(layer, torch.float32)) <= set(backend.configs(layer, torch.float32))
    policy = resolve_policy("fp32", torch.float32)
    assert [c.config for c in candidates_for(spec, policy, "cuda") if c.backend == "unrolled"] == \
        [unrolled.auto_config(spec)]
    assert backend.auto_configs(_spec(32, 64, 64, 56, 56, 3, 1, 1), torch.float32) == []   # 56x56: not measured
    assert backend.auto_configs(spec.with_batch(1), torch.float32) == []
    # float16: tuned over its own candidates where named, never tried by `auto` (not measured)
    assert backend.configs(spec, torch.float16) == [c for c in unrolled.HALF_CANDIDATES if c.tq in (1, 2)]
    assert all(c.slices == 1 for c in backend.configs(spec, torch.float16))
    assert backend.auto_configs(spec, torch.float16) == []
    assert [c.config for c in candidates_for(spec, resolve_policy("fp16", torch.float16), "cuda")
            if c.backend == "unrolled"] == []
    assert unrolled.auto_config(spec, torch.float16).slices == 1


# --- float16 (CPU) ---------------------------------------------------------------------------------

# sha256 (first 16 hex digits) of the fp32 PTX written before the float16 writer existed: the fp32
# path must stay byte for byte what it was.
FP32_PTX_DIGESTS = [
    ((3, 3, 33, 13, 13, 3, 1, 1), 32, 128, 1, 1, "d58087c6375496c2"),
    ((2, 6, 17, 13, 16, 5, 2, 2), 16, 64, 2, 1, "4864fb3779f5f36b"),
    ((3, 5, 33, 12, 12, 3, 1, 1), 8, 128, 1, 4, "02192f827173a35b"),
    ((2, 16, 40, 8, 8, 1, 2, 0), 16, 128, 4, 1, "b6f13580bbe0e718"),
]


@pytest.mark.parametrize("shape, bk, threads, slices, tq, digest", FP32_PTX_DIGESTS)
def test_the_fp32_ptx_is_unchanged(shape, bk, threads, slices, tq, digest):
    spec = _spec(*shape)
    ptx = unrolled_source.kernel_ptx(_weight(spec).numpy(), spec, bk, threads, slices=slices, tq=tq)
    assert hashlib.sha256(ptx.encode()).hexdigest()[:16] == digest


def test_half_weights_become_packed_pair_immediates():
    assert unrolled_source.half2_hex(1.0) == "0x3C003C00"
    assert unrolled_source.half2_hex(-2.0) == "0xC000C000"
    assert unrolled_source.half2_hex(0.1) == "0x2E662E66"   # rounded to float16
    with pytest.raises(ValueError, match="float16"):
        unrolled_source.half2_hex(1e5)


def _half_inputs(spec, sparsity=0.7, seed=1):
    """Weight, x, bias and residual rounded to float16 (held as float32 CPU tensors)."""
    weight = _weight(spec, sparsity).half().float()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.input_shape, generator=generator).half().float()
    bias = torch.randn(spec.K, generator=generator).half().float()
    residual = torch.randn(spec.output_shape, generator=generator).half().float()
    return weight, x, bias, residual


def _half_error(spec, config, weight, x, args, flush=0):
    """(the float16 kernel's relative error against the fp64 reference on the CPU, that of the fp64
    reference rounded to float16: what storing the output in float16 alone costs)."""
    y = run_unrolled_on_cpu(x.numpy(), weight.numpy(), spec, config,
                            *(a.numpy() if isinstance(a, torch.Tensor) else a for a in args), half=True, flush=flush)
    assert not np.isnan(y).any(), config
    ref = _reference(x, weight, *args, spec)
    return relative_error(torch.from_numpy(y.astype(np.float64)), ref), relative_error(ref.half().double(), ref)


# The bound. With fp16 inputs and weights (exact in fp64), cuDNN's fp16 convolution accumulates in
# fp32 and rounds once to fp16: its error is about that of rounding the fp64 result to fp16. The
# kernel adds the roundings of its f16x2 partials of HALF_FLUSH_TERMS terms, which grow with the
# terms per partial (error variance about (F + 1) / 2 times the output rounding's for F terms:
# about 1.9x the error at F = 4, 2.3x at F = 8). The project's rule, 2x cuDNN's error, is the bound.
HALF_ERROR_FACTOR = 2.0


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_every_float16_candidate_computes_the_convolution_on_the_cpu(shape):
    """Odd N too: the launcher packs a zero image after the last, whose results are not stored (an
    NCHW store of it would leave the output buffer; a batch-innermost one would overwrite a value)."""
    spec = _spec(*shape)
    weight, x, bias, residual = _half_inputs(spec)
    configs = unrolled.candidate_configs(spec, int(weight.count_nonzero()), torch.float16)
    assert configs and all(config in unrolled.HALF_CANDIDATES for config in configs)
    for index, config in enumerate(configs):
        config = dataclasses.replace(config, out_layout=unrolled.OUT_LAYOUTS[index % 2])
        args = (bias, residual, True) if (index // 2) % 2 == 0 else (None, None, False)
        error, storage = _half_error(spec, config, weight, x, args)
        assert error <= HALF_ERROR_FACTOR * storage, (config, error, storage)


@pytest.mark.parametrize("density", ["all-zero", "dense"])
def test_float16_all_zero_and_fully_dense_weights_on_the_cpu(density):
    spec = _spec(3, 8, 9, 9, 9, 3, 1, 1)   # dense: 72 terms per output, 18 flushes
    weight = torch.zeros(spec.weight_shape) if density == "all-zero" else _half_inputs(spec, 0.0)[0]
    _, x, bias, residual = _half_inputs(spec)
    for config in unrolled.candidate_configs(spec, int(weight.count_nonzero()), torch.float16):
        error, storage = _half_error(spec, config, weight, x, (bias, residual, True))
        assert error <= HALF_ERROR_FACTOR * storage, (config, error, storage)


def test_float16_partials_are_flushed_every_few_terms():
    """Each accumulator's f16x2 partial takes at most HALF_FLUSH_TERMS terms before its flush to fp32:
    without the flush (one partial for all 144 terms) the error exceeds the bound."""
    spec = _spec(2, 16, 8, 6, 6, 3, 1, 1)
    weight, x, _, _ = _half_inputs(spec, 0.0)
    config = unrolled.UnrolledConfig(8, 64, "batch_inner")
    error, storage = _half_error(spec, config, weight, x, (None, None, False))
    assert error <= HALF_ERROR_FACTOR * storage
    unflushed, _ = _half_error(spec, config, weight, x, (None, None, False), flush=10 ** 6)
    assert unflushed > HALF_ERROR_FACTOR * storage
    ptx = unrolled_source.kernel_ptx(weight.numpy(), spec, 8, 64, half=True)
    terms = ptx.count("fma.rn.f16x2") + ptx.count("mul.rn.f16x2")
    assert terms == int(weight.count_nonzero())
    per_channel = torch.count_nonzero(weight.reshape(spec.K, -1), dim=1).tolist()   # one slot per channel (N = 2)
    assert ptx.count("mov.b32 {") == sum(-(-count // unrolled_source.HALF_FLUSH_TERMS) for count in per_channel)
    assert ".f16x2" in ptx and "fma.rn.f32" not in ptx


def test_float16_kernel_refuses_what_it_does_not_run():
    spec = _spec(3, 5, 9, 13, 13, 3, 1, 1)
    with pytest.raises(ValueError, match="one slice"):
        unrolled.check_layer(spec, unrolled.UnrolledConfig(slices=2), dtype=torch.float16)
    with pytest.raises(ValueError, match="one slice"):
        unrolled_source.kernel_ptx(_weight(spec).numpy(), spec, 8, 64, slices=2, half=True)
    with pytest.raises(ValueError, match="bfloat16"):
        unrolled.candidate_configs(spec, 0, torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        unrolled_source.kernel_ptx(_weight(spec).numpy() * 1e6, spec, 8, 64, half=True)
    assert unrolled.thread_positions(spec, unrolled.UnrolledConfig(), torch.float16) == 13 * 13 * 2   # pairs


def test_the_dtype_is_part_of_the_compile_keys():
    from sparsecnn.backends.unrolled import backend as unrolled_backend

    spec, config = _spec(4, 8, 12, 6, 6, 3, 1, 1), unrolled.UnrolledConfig(8, 64)
    weight = _weight(spec)
    assert unrolled._cache_key(weight, spec, config, "90") != unrolled._cache_key(weight, spec, config, "90",
                                                                                   torch.float16)
    assert (unrolled_backend._compile_key(weight, spec, config, torch.float32)
            != unrolled_backend._compile_key(weight, spec, config, torch.float16))


@needs_tools
@pytest.mark.slow
@pytest.mark.parametrize("config", unrolled.HALF_CANDIDATES, ids=_config_id)
@pytest.mark.parametrize("n, arch", [(32, "80"), (32, "90"), (3, "90")])  # odd N: the same registers, one arch
def test_every_float16_candidate_compiles_without_spills(config, n, arch):
    spec = SPILL_SPEC.with_batch(n)
    weight = _weight(spec, 0.9).numpy()
    _, info, _ = toolchain.ptxas_cubin(unrolled_source.kernel_ptx(
        weight, spec, config.bk, config.threads, arch=arch, slices=config.slices, tq=config.tq, half=True), arch)
    assert info.spill_stores == 0 and info.spill_loads == 0, (config, arch, info)


# --- GPU -------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", ODD_SHAPES + [(32, 64, 64, 28, 28, 3, 1, 1), (32, 256, 64, 14, 14, 1, 1, 0)])
def test_matches_the_fp64_reference_for_every_config(shape):
    spec = _spec(*shape)
    weight = _weight(spec, 0.9)
    x = torch.randn(spec.input_shape, device="cuda")
    bias = torch.randn(spec.K, device="cuda")
    for config in unrolled.candidate_configs(spec, int(weight.count_nonzero())):
        compiled = unrolled.compile_layer(weight, spec, config)
        for out_layout in unrolled.OUT_LAYOUTS:
            config = dataclasses.replace(config, out_layout=out_layout)
            residual = new_output(spec.output_shape, x, config.out_layout).copy_(torch.randn(spec.output_shape))
            torch.empty(4 * residual.numel(), device="cuda").fill_(float("nan"))   # poison the allocator's memory
            y = unrolled.unrolled_conv2d(x, compiled, bias, residual, True, config)
            assert y.stride() == residual.stride()
            ref = _reference(x.cpu(), weight, bias.cpu(), residual.cpu(), True, spec)
            assert relative_error(y.cpu(), ref) < 1e-6, config
            y = unrolled.unrolled_conv2d(x, compiled, None, None, False, config)
            assert relative_error(y.cpu(), _reference(x.cpu(), weight, None, None, False, spec)) < 1e-6, config


def _cudnn_half_error(x, weight, bias, residual, relu, spec, ref) -> float:
    """cuDNN's own float16 error on these inputs (fp16, channels_last, fp32 accumulation inside; the
    residual and ReLU after it in fp16, as PyTorch runs them unfused) against `ref`."""
    y = torch.nn.functional.conv2d(x.half().to(memory_format=torch.channels_last), weight.cuda().half(),
                                   None if bias is None else bias.half(), spec.stride, spec.padding)
    y = y + residual.half() if residual is not None else y
    return relative_error((y.relu() if relu else y).cpu(), ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", ODD_SHAPES + [(32, 64, 64, 28, 28, 3, 1, 1), (31, 256, 64, 14, 14, 1, 1, 0)])
def test_float16_matches_the_fp64_reference_within_twice_cudnns_error(shape):
    spec = _spec(*shape)
    weight = _weight(spec, 0.9).half().float()
    x = torch.randn(spec.input_shape, device="cuda").half()
    bias = torch.randn(spec.K, device="cuda").half()
    for config in unrolled.candidate_configs(spec, int(weight.count_nonzero()), torch.float16):
        compiled = unrolled.compile_layer(weight, spec, config, dtype=torch.float16)
        for out_layout in unrolled.OUT_LAYOUTS:
            config = dataclasses.replace(config, out_layout=out_layout)
            residual = new_output(spec.output_shape, x, config.out_layout).copy_(torch.randn(spec.output_shape))
            torch.empty(4 * residual.numel(), device="cuda").fill_(float("nan"))   # poison the allocator's memory
            for args in ((bias, residual, True), (None, None, False)):
                y = unrolled.unrolled_conv2d(x, compiled, *args, config)
                assert y.dtype == torch.float16 and y.stride() == residual.stride()
                ref = _reference(x.cpu().float(), weight, *(a.cpu().float() if isinstance(a, torch.Tensor) else a
                                                            for a in args), spec)
                bound = HALF_ERROR_FACTOR * _cudnn_half_error(x, weight, *args, spec, ref)
                assert relative_error(y.cpu(), ref) <= bound, config


@gpu
@needs_cuda
def test_float16_refuses_mismatched_dtypes_naming_the_argument():
    spec = _spec(3, 8, 16, 9, 9, 3, 1, 1)
    compiled = unrolled.compile_layer(_weight(spec), spec, unrolled.UnrolledConfig(8, 64), dtype=torch.float16)
    x = torch.randn(spec.input_shape, device="cuda").half()
    with pytest.raises(ValueError, match="bias must be a torch.float16"):
        unrolled.unrolled_conv2d(x, compiled, torch.randn(spec.K, device="cuda"))
    with pytest.raises(TypeError, match="x dtype"):
        unrolled.unrolled_conv2d(x.float(), compiled)
    with pytest.raises(ValueError, match="out must be a torch.float16"):
        unrolled.unrolled_conv2d(x, compiled, out=torch.empty(spec.output_shape, device="cuda"))


@gpu
@needs_cuda
def test_cuda_graph_replay_equals_eager_and_the_op_passes_opcheck():
    spec = _spec(32, 32, 48, 14, 14, 3, 1, 1)
    backend = get_backend("unrolled")
    weight = _weight(spec, 0.9).cuda()
    x, bias = torch.randn(spec.input_shape, device="cuda"), torch.randn(spec.K, device="cuda")
    residual = torch.randn(spec.output_shape, device="cuda")
    config = unrolled.auto_config(spec)
    call = backend.bind(backend.prepare(weight, config), spec, config, torch.float32, True)
    torch.library.opcheck(call.fn, (x, *call.tensors, bias, residual, *call.static, True))
    ref = _reference(x.cpu(), weight.cpu(), bias.cpu(), residual.cpu(), True, spec)
    assert relative_error(call(x, bias, residual, True).cpu(), ref) < 1e-6
    call(x, bias, residual, True)
    assert_graph_replay_matches(lambda: call(x, bias, residual, True), x)


@gpu
@needs_cuda
def test_a_layer_in_several_modules_matches_the_reference_eagerly_and_in_a_cuda_graph(monkeypatch, tmp_path):
    from sparsecnn.core.toolchain import DiskCache

    spec = _spec(32, 64, 96, 28, 28, 3, 1, 1)
    weight = _weight(spec, 0.9)
    monkeypatch.setattr(unrolled, "PART_FMAS", int(weight.count_nonzero()) // 4)
    config = unrolled.UnrolledConfig(16, 128, "batch_inner")
    compiled = unrolled.compile_layer(weight, spec, config, DiskCache(tmp_path))
    assert len(compiled.cubins) >= 4
    x, bias = torch.randn(spec.input_shape, device="cuda"), torch.randn(spec.K, device="cuda")
    residual = new_output(spec.output_shape, x, config.out_layout).copy_(torch.randn(spec.output_shape))
    ref = _reference(x.cpu(), weight, bias.cpu(), residual.cpu(), True, spec)
    torch.empty(4 * residual.numel(), device="cuda").fill_(float("nan"))   # poison the allocator's memory
    assert relative_error(unrolled.unrolled_conv2d(x, compiled, bias, residual, True).cpu(), ref) < 1e-6
    assert_graph_replay_matches(lambda: unrolled.unrolled_conv2d(x, compiled, bias, residual, True), x)


@gpu
@needs_cuda
def test_sparse_conv_on_the_backend_matches_the_reference_in_both_layouts():
    from sparsecnn.nn import SparseConv2d

    spec = _spec(32, 24, 40, 13, 13, 3, 2, 1)
    weight = _weight(spec, 0.9).cuda()
    bias = torch.randn(spec.K, device="cuda")
    x = torch.randn(spec.input_shape, device="cuda")
    ref = _reference(x.cpu(), weight.cpu(), bias.cpu(), None, True, spec)
    for out_layout in unrolled.OUT_LAYOUTS:
        config = unrolled.UnrolledConfig(16, 64, out_layout)
        layer = SparseConv2d(weight, bias, backend="unrolled", config=config, stride=2, padding=1, activation="relu")
        assert relative_error(layer(x).cpu(), ref) < 1e-6


@gpu
@needs_cuda
def test_float16_sparse_conv_on_the_named_backend_matches_the_reference():
    """A half model's layer (fp16 weight, bias and input) on the backend, odd N, both layouts, and
    its op through opcheck and a CUDA graph."""
    from sparsecnn.nn import SparseConv2d

    spec = _spec(33, 24, 40, 13, 13, 3, 2, 1)
    weight, bias = _weight(spec, 0.9).half().cuda(), torch.randn(spec.K, device="cuda").half()
    x = torch.randn(spec.input_shape, device="cuda").half()
    ref = _reference(x.cpu().float(), weight.cpu().float(), bias.cpu().float(), None, True, spec)
    bound = HALF_ERROR_FACTOR * _cudnn_half_error(x, weight.float(), bias, None, True, spec, ref)
    for out_layout in unrolled.OUT_LAYOUTS:
        config = unrolled.UnrolledConfig(16, 64, out_layout)
        layer = SparseConv2d(weight, bias, backend="unrolled", config=config, stride=2, padding=1, activation="relu")
        y = layer(x)
        assert layer.fallback_reason is None and y.dtype == torch.float16
        assert relative_error(y.cpu(), ref) <= bound
    backend = get_backend("unrolled")
    call = backend.bind(backend.prepare(weight, None), spec, None, torch.float16, True)
    torch.library.opcheck(call.fn, (x, *call.tensors, bias, None, *call.static, True))
    assert relative_error(call(x, bias, None, True).cpu(), ref) <= bound
    assert_graph_replay_matches(lambda: call(x, bias, None, True), x)


def test_a_compiled_kernel_travels_between_processes_and_registers_by_identity():
    import pickle

    from sparsecnn.core.op_support import codegen_kernel, register_codegen

    spec = _spec(2, 3, 4, 5, 5, 1, 1, 0)
    compiled = unrolled.CompiledUnrolled((b"cubin", b"other"), (3, 1), spec, unrolled.UnrolledConfig(), 0.5, 32, 0)
    rebuilt = unrolled.CompiledUnrolled(*pickle.loads(pickle.dumps(compiled.fields())))
    assert rebuilt.fields() == compiled.fields() and rebuilt is not compiled
    handles = register_codegen(compiled), register_codegen(rebuilt)
    assert handles[0] != handles[1] and codegen_kernel(handles[0]) is compiled


@needs_tools
def test_a_cached_kernel_is_found_without_writing_its_ptx(tmp_path, monkeypatch):
    from sparsecnn.core.toolchain import DiskCache

    spec = _spec(4, 8, 12, 6, 6, 3, 1, 1)
    weight, cache = _weight(spec), DiskCache(tmp_path)
    first = unrolled.compile_layer(weight, spec, unrolled.UnrolledConfig(8, 64), cache)
    assert first.registers > 0   # compiled by ptxas
    monkeypatch.setattr(unrolled, "kernel_ptx", lambda *args: pytest.fail("a cache hit wrote the PTX"))
    again = unrolled.compile_layer(weight, dataclasses.replace(spec, name="renamed"), unrolled.UnrolledConfig(8, 64),
                                   cache)
    assert again.cubins == first.cubins and again.registers == -1
    for other_weight, other_config in ((weight * 2, unrolled.UnrolledConfig(8, 64)),
                                       (weight, unrolled.UnrolledConfig(16, 64))):
        with pytest.raises(pytest.fail.Exception, match="wrote the PTX"):   # a different key: a compile
            unrolled.compile_layer(other_weight, spec, other_config, cache)


@needs_tools
def test_a_large_layer_compiles_as_several_modules_each_cached(tmp_path, monkeypatch):
    from sparsecnn.core.toolchain import DiskCache

    spec = _spec(4, 8, 33, 6, 6, 3, 1, 1)
    weight, cache, config = _weight(spec), DiskCache(tmp_path), unrolled.UnrolledConfig(8, 64)
    monkeypatch.setattr(unrolled, "PART_FMAS", int(weight.count_nonzero()) // 3)
    compiled = unrolled.compile_layer(weight, spec, config, cache)
    modules = unrolled.layer_modules(weight.numpy(), config)
    assert len(compiled.cubins) == len(modules) >= 3 and compiled.registers > 0
    assert compiled.group_counts == tuple(len(groups) for groups in modules) and sum(compiled.group_counts) == 5
    assert len(set(compiled.cubins)) == len(compiled.cubins)
    monkeypatch.setattr(unrolled, "kernel_ptx", lambda *args: pytest.fail("a cache hit wrote the PTX"))
    assert unrolled.compile_layer(weight, spec, config, cache).cubins == compiled.cubins
