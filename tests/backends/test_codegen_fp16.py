"""Backend `codegen` in float16: fp32-accumulating FFMA kernels and HFMA2 kernels (half2.py), the
rewrite of f16x2 templates, the accuracy of half2 partial sums (kernels run on the CPU), GPU numerics.

Accuracy bound everywhere: at most twice cuDNN fp16's error against the fp64 reference (on the CPU,
cuDNN's error is stood in for by the exact result rounded to half once, what fp32 accumulation gives).
"""
import collections
import dataclasses
import re

import numpy as np
import pytest
import torch
from helpers.codegen import (
    assert_graph_replay_equals_eager,
    needs_gxx,
    needs_tools,
    run_emitted_on_cpu,
    sparse,
    value_map,
)

from sparsecnn.backends import get_backend
from sparsecnn.backends.codegen import generator as codegen
from sparsecnn.backends.codegen import half2
from sparsecnn.backends.codegen.plan import (
    DEFAULT_MAX_KERNEL_FMAS,
    MAX_ACCUMULATOR_REGS,
    MODES,
)
from sparsecnn.backends.codegen.ptx_rewrite import (
    integer_bits,
    placeholder_sites,
    rewrite_ptx,
)
from sparsecnn.core import toolchain
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers import get_suite

gpu = pytest.mark.gpu
HALF = torch.float16
SMALL = ConvSpec(2, 3, 4, 9, 9, 3, 3, 1, 1, name="small")
HALF2_PAIRS = codegen.CodegenConfig(bh=2, bk=4, tx=8, ty=4, accumulate="half2")  # 2 HFMA2 per weight
TILINGS = {  # half2 tilings with several slices, groups, chunks, partial image groups, ReLU, no bias
    "slices-groups-chunks": (codegen.CodegenConfig(bh=2, bw=2, bn=2, bk=4, tx=8, ty=4, chunk_c=1, slice_k=12,
                                                   accumulate="half2"), False, True),
    "relu-nobias": (codegen.CodegenConfig(bh=1, bw=3, bn=1, bk=5, tx=8, ty=8, chunk_c=2, accumulate="half2"),
                    True, False),
    "bn3": (codegen.CodegenConfig(bh=2, bn=3, bk=3, tx=32, ty=1, slice_k=9, accumulate="half2"), True, True),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return toolchain.DiskCache(tmp_path_factory.mktemp("codegen-fp16-cache"))


def flushing_plan(config=HALF2_PAIRS, relu=False, has_bias=True):
    """A half2 plan of SMALL whose partials span 4 of its 27 (c, r, s) terms (density 0.5)."""
    plan = codegen.make_plan(SMALL, config, relu, has_bias, dtype=HALF, density=0.5)
    assert plan.flush_terms == 4
    return plan


@pytest.fixture(scope="module")
def half2_template(cache):
    plan = flushing_plan()
    return plan, codegen.compile_template(plan, cache)


def half_data(spec, sparsity, seed=0, has_bias=True):
    """(weight as float32 exact in half, x half, bias half or None) as numpy arrays."""
    rng = np.random.default_rng(seed + 100)
    weight = sparse(spec.weight_shape, sparsity, seed).astype(np.float16).astype(np.float32)
    x = rng.standard_normal(spec.input_shape).astype(np.float16)
    bias = rng.standard_normal(spec.K).astype(np.float16) if has_bias else None
    return weight, x, bias


def run_on_cpu(plan, weight, x, bias, tmp_path) -> torch.Tensor:
    return torch.from_numpy(run_emitted_on_cpu(plan, weight, x, np.zeros(1) if bias is None else bias, tmp_path))


def reference(spec, weight, x, bias, relu=False):
    bias = None if bias is None else torch.from_numpy(bias)
    ref = reference_conv(torch.from_numpy(x), torch.from_numpy(weight), bias, stride=spec.stride,
                         padding=spec.padding, fp64=True)
    return ref.clamp_min(0) if relu else ref


def slices(plan, weight: np.ndarray):
    """`weight` (K, C, R, S) cut into the plan's slices, zero channels past K, rounded to half."""
    padded = np.zeros((plan.n_slices * plan.slice_k, *weight.shape[1:]), np.float32)
    padded[:weight.shape[0]] = weight.astype(np.float16)
    return [padded[s * plan.slice_k:(s + 1) * plan.slice_k] for s in range(plan.n_slices)]


def rounding_error(ref: torch.Tensor) -> float:
    """The error of the exact result rounded to half once (fp32 accumulation, as cuDNN's)."""
    return relative_error(ref.half(), ref)


# --- config and plan --------------------------------------------------------------------------


def test_half2_needs_float16_and_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="half2"):
        codegen.make_plan(SMALL, HALF2_PAIRS, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        codegen.make_plan(SMALL, codegen.CodegenConfig(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="density"):
        codegen.make_plan(SMALL, HALF2_PAIRS, dtype=HALF, density=1.5)


@pytest.mark.parametrize("half_terms, density, accumulate, flush", [
    (2, 1.0, "half2", 2), (2, 0.5, "half2", 4), (2, 0.1, "half2", 20), (2, 0.05, "half2", 0),
    (0, 1.0, "half2", 0), (2, 0.0, "half2", 0), (2, 1.0, "float", 0),
])
def test_partials_span_about_half_terms_nonzero_terms(half_terms, density, accumulate, flush):
    """SMALL sums 27 (c, r, s) terms: a span reaching them all is one partial (flush_terms 0)."""
    config = dataclasses.replace(HALF2_PAIRS, half_terms=half_terms, accumulate=accumulate)
    assert codegen.make_plan(SMALL, config, dtype=HALF, density=density).flush_terms == flush


def test_half2_lanes_are_the_two_halves_of_the_output_rows():
    spec = ConvSpec(1, 3, 4, 13, 13, 3, 3, 1, 1)  # P = 13: lane 0 rows 0..6, lane 1 rows 7..12
    plan = codegen.make_plan(spec, HALF2_PAIRS, dtype=HALF)
    assert plan.lane_rows == 7 and plan.tile == (8, 8) and plan.tiles == (1, 2)
    flat = dataclasses.replace(HALF2_PAIRS, accumulate="float")
    assert codegen.make_plan(spec, flat, dtype=HALF).tiles == (2, 2)


@pytest.mark.parametrize("spec", [SMALL, *get_suite("dong", 64), *get_suite("dong", 1)],
                         ids=lambda s: f"{s.name}-{s.N}")
def test_fp16_candidates_offer_both_accumulations(spec):
    configs = codegen.candidate_configs(spec, HALF)
    assert 3 <= len(configs) <= 6 and len(set(configs)) == len(configs)
    assert configs[0] == codegen.default_config(spec) and configs[0].accumulate == "float"
    assert {config.accumulate for config in configs} == {"float", "half2"}
    assert {config.mode for config in configs} == set(MODES)
    for config in configs:
        plan = codegen.make_plan(spec, config, dtype=HALF)
        assert plan.template_fmas <= DEFAULT_MAX_KERNEL_FMAS and config.accumulator_regs <= MAX_ACCUMULATOR_REGS
    assert all(config.accumulate == "float" for config in codegen.candidate_configs(spec, torch.float32))


# --- placeholders and the f16x2 rewrite --------------------------------------------------------


def test_half2_placeholders_are_distinct_nonzero_finite_halves():
    bits = half2.placeholder_bits(half2.MAX_PLACEHOLDERS)
    assert len(set(bits.tolist())) == bits.size
    for halves in (bits & 0xFFFF, bits >> 16):
        exponent = (halves >> 10) & 0x1F
        assert (halves & 0x7FFF).min() > 0 and exponent.max() < 0x1F  # non-zero, finite
    assert half2.NEG_ZERO_HALF2 not in set(bits.tolist())
    with pytest.raises(ValueError, match="at most"):
        half2.placeholder_bits(half2.MAX_PLACEHOLDERS + 1)


@pytest.mark.parametrize("text, bits", [
    ("1342197760", 0x50005000), ("-2147450880", 0x80008000), ("0x50005000", 0x50005000), ("017", 15),
    ("0", 0), ("7U", 7), ("%r1", None), ("0f3F800000", None), ("[%rd1]", None),
])
def test_integer_immediates_are_read_as_32_bit_patterns(text, bits):
    assert integer_bits(text) == bits


def test_f16x2_rewrite_example():
    """A zero weight deletes its HFMA2 (forwarded to the -0 start), and the flush of that partial
    (unpack, convert, add) leaves the fp32 sum as it was; a kept weight gets its mov before the HFMA2."""
    ptx = "\n".join([
        "\tmov.u32 \t%r9, -2147450880;",  # the -0 a partial starts from
        "\tmov.u32 \t%r3, 1342197760;",  # placeholder A -> 0
        "\tfma.rn.f16x2 %r4, %r1, %r3, %r9;",
        "\tmov.u32 \t%r5, 1342197761;",  # placeholder B -> 1.5
        "\tfma.rn.f16x2 %r6, %r2, %r5, %r4;",
        "\tmov.b32 {%rs1, %rs2}, %r4;",  # flush of the partial that ended at A: still -0
        "\tcvt.f32.f16 %f1, %rs1;",
        "\tadd.f32 \t%f3, %f2, %f1;",
        "\tcvt.f32.f16 %f4, %rs2;",
        "\tadd.f32 \t%f5, %f4, %f2;",
        "\tst.global.f32 \t[%rd1], %f3;",
        "\tst.global.f32 \t[%rd1+4], %f5;",
        "\tst.global.b32 \t[%rd1+8], %r6;",
    ])
    out, stats = rewrite_ptx(ptx, {0x50005000: 0, 0x50005001: 0x3E003E00})
    assert out.splitlines() == [
        "\tmov.u32 \t%r9, -2147450880;",
        "\tmov.b32 %r5, 0x3E003E00;",
        "\tfma.rn.f16x2 %r6, %r2, %r5, %r9;",
        "\tmov.b32 {%rs1, %rs2}, %r9;",
        "\tcvt.f32.f16 %f1, %rs1;",
        "\tcvt.f32.f16 %f4, %rs2;",
        "\tst.global.f32 \t[%rd1], %f2;",
        "\tst.global.f32 \t[%rd1+4], %f2;",
        "\tst.global.b32 \t[%rd1+8], %r6;",
    ]
    assert (stats.fmas, stats.deleted, stats.kept, stats.forwarded, stats.zero_adds) == (2, 1, 1, 1, 2)


def test_rewrite_keeps_adds_that_are_not_of_negative_zero():
    ptx = "\n".join([
        "\tmov.u32 \t%r9, -2147483648;",  # half2 (+0, -0): only its high half is -0
        "\tmov.b32 {%rs1, %rs2}, %r9;",
        "\tcvt.f32.f16 %f1, %rs1;",
        "\tcvt.f32.f16 %f4, %rs2;",
        "\tadd.f32 \t%f3, %f2, %f1;",  # + (+0) is not the identity (-0 + +0 = +0): kept
        "\tadd.ftz.f32 \t%f5, %f2, %f4;",  # ftz flushes subnormals: kept
        "\tadd.f32 \t%f6, %f2, 0f00000000;",  # kept
        "\tadd.f32 \t%f7, %f2, 0f80000000;",  # dropped: %f7 -> %f2
        "\tadd.f32 \t%f8, %f4, %f7;",  # dropped: %f8 -> %f2
        "\tst.global.v4.f32 \t[%rd1], {%f3, %f5, %f6, %f8};",
    ])
    out, stats = rewrite_ptx(ptx, {})
    assert stats.zero_adds == 2
    assert out.splitlines() == ptx.splitlines()[:7] + ["\tst.global.v4.f32 \t[%rd1], {%f3, %f5, %f6, %f2};"]


@needs_tools
def test_half2_template_has_each_placeholder_once_as_an_hfma2_weight(half2_template):
    plan, tmpl = half2_template
    placeholders = codegen.placeholders(plan).tolist()
    assert plan.template_fmas == 4 * 27 * 2 == len(re.findall(r"\bfma\.rn\.f16x2\b", tmpl.ptx))
    assert placeholder_sites(tmpl.ptx, frozenset(placeholders)) == {bits: 1 for bits in placeholders}
    integers = collections.Counter(re.findall(r"mov\.u32\s+%r\d+,\s*(-?\d+);", tmpl.ptx))
    assert all(integers[str(bits)] == 1 for bits in placeholders)
    assert "cvt.f32.f16" in tmpl.ptx and toolchain.ptx_isa(tmpl.ptx) <= toolchain.DEFAULT_MAX_PTX_ISA


def kept_weight_constants(ptx: str) -> list:
    """The half2 constant of each kept HFMA2, read from the `mov.b32` the rewrite put right before
    it into its weight register (the order of the PTX)."""
    lines, constants = ptx.splitlines(), []
    for previous, line in zip(lines, lines[1:]):
        fma = re.search(r"fma\.rn\.f16x2\s+%r\d+,\s*%r\d+,\s*(%r\d+),", line)
        if fma:
            mov = re.fullmatch(r"\s*mov\.b32\s+(%r\d+), 0x([0-9A-F]{8});", previous)
            assert mov and mov.group(1) == fma.group(1), (previous, line)
            constants.append(int(mov.group(2), 16))
    return constants


@needs_tools
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_half2_rewrite_deletes_pixels_hfma2s_per_zero_weight_and_assembles(half2_template, sparsity):
    plan, tmpl = half2_template
    weight = sparse(SMALL.weight_shape, sparsity)
    zeros = int((weight == 0).sum())
    ptx, stats = rewrite_ptx(tmpl.ptx, value_map(plan, weight))
    assert plan.pixels == 2
    assert (stats.fmas, stats.deleted, stats.kept) == (2 * weight.size, 2 * zeros, 2 * (weight.size - zeros))
    assert not set(re.findall(r"-?\d+", ptx)) & {str(bits) for bits in codegen.placeholders(plan).tolist()}
    kept = kept_weight_constants(ptx)
    assert len(kept) == stats.kept == len(re.findall(r"\bfma\.rn\.f16x2\b", ptx))
    assert sorted(kept) == sorted(np.repeat(half2.broadcast_bits(weight[weight != 0]), 2).tolist())
    template_adds = len(re.findall(r"\badd\.f32\b", tmpl.ptx))
    if sparsity == 1.0:
        assert stats.zero_adds == template_adds and "add.f32" not in ptx
    elif sparsity == 0.0:
        assert stats.zero_adds == 0
    cubin, info, _ = toolchain.ptxas_cubin(ptx)
    assert cubin[:4] == b"\x7fELF" and info.registers > 0


# --- compile_conv in float16 -------------------------------------------------------------------


@pytest.mark.quick_sample(2)
@needs_tools
@pytest.mark.parametrize("accumulate", ["float", "half2"])
@pytest.mark.parametrize("mode", MODES)
def test_fp16_compiles_every_accumulation_and_mode(cache, accumulate, mode):
    spec = ConvSpec(3, 3, 33, 13, 13, 3, 3, 2, 1)
    config = dataclasses.replace(codegen.default_config(spec, accumulate=accumulate), mode=mode)
    weight = sparse(spec.weight_shape, 0.7)
    compiled = codegen.compile_conv(weight, spec, config, cache=cache, dtype=HALF)
    report, plan = compiled.report, compiled.plan
    nonzero = int(np.count_nonzero(weight)) * plan.pixels
    assert compiled.cubins[0][:4] == b"\x7fELF" and report.dtype == "float16"
    assert (report.fmas_kept, report.fmas_deleted) == (nonzero, plan.template_fmas * plan.n_slices - nonzero)
    if mode == "emit":
        call = "= hfma2(" if accumulate == "half2" else "= __fmaf_rn("
        assert sum(codegen.kernel_source(plan, part).count(call) for part in slices(plan, weight)) == nonzero


@needs_tools
def test_fp16_and_fp32_templates_have_different_cache_keys(cache):
    config = dataclasses.replace(HALF2_PAIRS, accumulate="float")
    keys = {codegen.compile_template(codegen.make_plan(SMALL, config, dtype=dtype), cache).key
            for dtype in (torch.float32, HALF)}
    assert len(keys) == 2


@needs_tools
def test_fp16_weights_are_rounded_to_half(cache):
    weight = sparse(SMALL.weight_shape, 0.5)
    weight[0, 0, 0, 0] = 1e-9  # rounds to 0 in half: deleted like a pruned weight
    config = dataclasses.replace(HALF2_PAIRS, mode="emit")
    report = codegen.compile_conv(weight, SMALL, config, cache=cache, dtype=HALF).report
    assert report.fmas_deleted == 2 * (int((weight == 0).sum()) + 1)
    weight[0, 0, 0, 0] = 1e5
    with pytest.raises(ValueError, match="float16 range"):
        codegen.compile_conv(weight, SMALL, config, cache=cache, dtype=HALF)


@needs_tools
@pytest.mark.parametrize("accumulate", ["float", "half2"])
@pytest.mark.slow
def test_fp16_resnet_conv1_default_tilings_do_not_spill(cache, accumulate):
    """half2 has no launch bound (plan._bounded): with one, ptxas 13.0 spilled 336 B here."""
    spec = next(s for s in get_suite("dong", 64) if s.name == "resnet-conv1")
    config = dataclasses.replace(codegen.default_config(spec, accumulate=accumulate), mode="emit")
    report = codegen.compile_conv(sparse(spec.weight_shape, 0.9), spec, config, cache=cache, dtype=HALF).report
    assert report.spill_stores == report.spill_loads == 0 and 0 < report.registers <= 255


# --- the generated float16 CUDA C, run on the CPU ----------------------------------------------


@pytest.mark.quick_sample(6)
@needs_gxx
@pytest.mark.parametrize("accumulate", ["float", "half2"])
@pytest.mark.parametrize("r, stride, pad, relu, has_bias", [
    (3, 1, 1, False, True), (5, 2, 2, True, True), (1, 2, 1, False, False), (3, 1, 0, False, True),
], ids=["3x3", "5x5-s2-relu", "1x1-s2-nobias", "3x3-p0"])
def test_emitted_fp16_source_computes_the_convolution(tmp_path, accumulate, r, stride, pad, relu, has_bias):
    """Staging (two lanes packed, halo, padding), HFMA2 chains, flushes, the epilogue of both lanes
    (odd P: lane 1 one row short), run as C++ with HFMA2's rounding."""
    spec = ConvSpec(3, 3, 33, 13, 13, r, r, stride, pad)
    weight, x, bias = half_data(spec, 0.5, has_bias=has_bias)
    weight[7] = 0  # one channel fully pruned: exactly half(bias) (or 0) must come out
    config = dataclasses.replace(codegen.default_config(spec, accumulate=accumulate), mode="emit")
    plan = codegen.make_plan(spec, config, relu, has_bias, dtype=HALF, density=np.count_nonzero(weight) / weight.size)
    y = run_on_cpu(plan, weight, x, bias, tmp_path)
    ref = reference(spec, weight, x, bias, relu)
    assert relative_error(y, ref) <= 2 * rounding_error(ref)
    channel_bias = 0.0 if bias is None else max(float(bias[7]), 0.0) if relu else float(bias[7])
    assert (y[:, 7] == channel_bias).all()


@pytest.mark.quick_sample(3)
@needs_gxx
@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.slow
def test_emitted_half2_tilings(tmp_path, tiling):
    config, relu, has_bias = TILINGS[tiling]
    spec = ConvSpec(4, 3, 33, 13, 13, 3, 3, 2, 1)
    weight, x, bias = half_data(spec, 0.6, has_bias=has_bias)
    plan = codegen.make_plan(spec, dataclasses.replace(config, mode="emit"), relu, has_bias, dtype=HALF, density=0.4)
    ref = reference(spec, weight, x, bias, relu)
    assert relative_error(run_on_cpu(plan, weight, x, bias, tmp_path), ref) <= 2 * rounding_error(ref)


@needs_gxx
@pytest.mark.slow
def test_half2_partials_keep_a_long_sum_within_twice_the_rounding_error(tmp_path):
    """288 terms per output: fp32 accumulation rounds once; half2 partials of ~2 terms stay within
    2x of that; one half2 sum per output (half_terms=0) is several times worse."""
    spec = ConvSpec(2, 32, 4, 6, 6, 3, 3, 1, 1)
    weight, x, bias = half_data(spec, 0.0)
    ref = reference(spec, weight, x, bias)
    errors = {}
    for name, accumulate, half_terms in (("float", "float", 2), ("partials", "half2", 2), ("whole", "half2", 0)):
        config = codegen.CodegenConfig(bh=1, bk=4, tx=8, ty=4, mode="emit", accumulate=accumulate,
                                       half_terms=half_terms)
        plan = codegen.make_plan(spec, config, dtype=HALF)
        (tmp_path / name).mkdir()
        errors[name] = relative_error(run_on_cpu(plan, weight, x, bias, tmp_path / name), ref)
    bound = rounding_error(ref)
    assert errors["float"] <= 1.05 * bound
    assert errors["partials"] <= 2 * bound
    assert errors["whole"] > 3 * errors["partials"]


# --- backend -----------------------------------------------------------------------------------


def test_backend_runs_float16():
    backend = get_backend("codegen")
    assert backend.dtypes["cuda"] == (torch.float32, HALF)
    assert backend.unsupported_reason(SMALL, HALF, "cuda") is None
    assert "bfloat16" in backend.unsupported_reason(SMALL, torch.bfloat16, "cuda")
    for spec in get_suite("dong", 64):
        assert backend.configs(spec, HALF) == codegen.candidate_configs(spec, HALF)


# --- GPU ---------------------------------------------------------------------------------------

ODD_SHAPES = [(1, 1, 0), (1, 2, 1), (3, 1, 1), (3, 2, 0), (3, 1, 2), (5, 1, 2), (5, 2, 1), (5, 1, 0)]  # R, stride, pad
SPARSITIES = [0.0, 0.5, 0.9, 0.99, 1.0]


def odd_spec(r, stride, pad, n=3):
    return ConvSpec(n, 3, 33, 13, 13, r, r, stride, pad)


def cudnn_error(x, weight, bias, spec) -> float:
    """cuDNN fp16's own relative error (NCHW, as the codegen kernels) against the fp64 reference."""
    y = torch.nn.functional.conv2d(x, weight, bias, spec.stride, spec.padding)
    return relative_error(y, reference_conv(x, weight, bias, stride=spec.stride, padding=spec.padding, fp64=True))


def run_checked(compiled, x, bias):
    """Run into a NaN-filled output (so an unwritten element shows) and return it."""
    out = torch.full((x.shape[0], *compiled.plan.spec.output_shape[1:]), float("nan"), device="cuda", dtype=HALF)
    return compiled(x, bias, out=out)


@gpu
@pytest.mark.parametrize("accumulate", ["float", "half2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("r, stride, pad", ODD_SHAPES)
def test_fp16_within_twice_cudnn_error(cache, accumulate, mode, r, stride, pad):
    spec = odd_spec(r, stride, pad)
    config = dataclasses.replace(codegen.default_config(spec, accumulate=accumulate), mode=mode)
    bias = torch.randn(spec.K, device="cuda", dtype=HALF)
    for sparsity in SPARSITIES:
        weight = torch.from_numpy(sparse(spec.weight_shape, sparsity)).to("cuda", HALF)
        compiled = codegen.compile_conv(weight, spec, config, cache=cache, dtype=HALF)
        for n in (1, 3):
            x = torch.randn(n, spec.C, spec.H, spec.W, device="cuda", dtype=HALF)
            y = run_checked(compiled, x, bias)
            if sparsity == 1.0:
                assert torch.equal(y, bias.view(1, -1, 1, 1).expand_as(y)), "a zero weight must give exactly the bias"
                continue
            ref = reference_conv(x, weight, bias, stride=stride, padding=pad, fp64=True)
            limit = 2 * cudnn_error(x, weight, bias, spec.with_batch(n)) + 1e-6
            assert relative_error(y, ref) <= limit, (sparsity, n)


@gpu
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_fp16_half2_tilings(cache, tiling):
    config, relu, has_bias = TILINGS[tiling]
    spec = odd_spec(3, 2, 1)
    weight = torch.from_numpy(sparse(spec.weight_shape, 0.6)).to("cuda", HALF)
    bias = torch.randn(spec.K, device="cuda", dtype=HALF) if has_bias else None
    compiled = codegen.compile_conv(weight, spec, config, relu=relu, has_bias=has_bias, cache=cache, dtype=HALF)
    for n in (1, 3, 4):
        x = torch.randn(n, spec.C, spec.H, spec.W, device="cuda", dtype=HALF)
        ref = reference_conv(x, weight, bias, stride=2, padding=1, fp64=True)
        cudnn = torch.nn.functional.conv2d(x, weight, bias, 2, 1)
        if relu:
            ref, cudnn = ref.clamp_min(0), cudnn.clamp_min(0)
        assert relative_error(run_checked(compiled, x, bias), ref) <= 2 * relative_error(cudnn, ref) + 1e-6


@gpu
@pytest.mark.parametrize("accumulate", ["float", "half2"])
def test_fp16_modes_agree_bit_for_bit(cache, accumulate):
    """half2: 5x5 at 50% spans partials over 4 terms, so some are flushed empty in the template."""
    spec = odd_spec(5, 1, 2)
    weight = torch.from_numpy(sparse(spec.weight_shape, 0.5)).to("cuda", HALF)
    x = torch.randn(3, 3, 13, 13, device="cuda", dtype=HALF)
    bias = torch.randn(spec.K, device="cuda", dtype=HALF)
    config = codegen.default_config(spec, accumulate=accumulate)
    rewrite = codegen.compile_conv(weight, spec, config, cache=cache, dtype=HALF)
    emit = codegen.compile_conv(weight, spec, dataclasses.replace(config, mode="emit"), cache=cache, dtype=HALF)
    assert rewrite.plan.flush_terms == (4 if accumulate == "half2" else 0)
    assert torch.equal(run_checked(rewrite, x, bias), run_checked(emit, x, bias))


@gpu
@pytest.mark.parametrize("accumulate", ["float", "half2"])
def test_fp16_zero_weight_without_bias_gives_zeros(cache, accumulate):
    spec = odd_spec(3, 1, 1)
    config = codegen.default_config(spec, accumulate=accumulate)
    compiled = codegen.compile_conv(np.zeros(spec.weight_shape, np.float32), spec, config, has_bias=False,
                                    cache=cache, dtype=HALF)
    y = run_checked(compiled, torch.randn(3, 3, 13, 13, device="cuda", dtype=HALF), None)
    assert torch.equal(y, torch.zeros_like(y))


@gpu
def test_fp16_long_reductions_with_every_candidate(cache):
    """288 terms per output, dense and 90% sparse, every float16 candidate (HFMA2 included)."""
    spec = ConvSpec(2, 32, 16, 12, 12, 3, 3, 1, 1)
    x = torch.randn(spec.input_shape, device="cuda", dtype=HALF)
    bias = torch.randn(spec.K, device="cuda", dtype=HALF)
    for sparsity in (0.0, 0.9):
        weight = torch.from_numpy(sparse(spec.weight_shape, sparsity)).to("cuda", HALF)
        ref = reference_conv(x, weight, bias, stride=1, padding=1, fp64=True)
        limit = 2 * cudnn_error(x, weight, bias, spec) + 1e-6
        for config in codegen.candidate_configs(spec, HALF):
            compiled = codegen.compile_conv(weight, spec, config, cache=cache, dtype=HALF)
            assert relative_error(run_checked(compiled, x, bias), ref) <= limit, (sparsity, config)


@gpu
def test_fp16_cuda_graph_replay_equals_eager():
    spec = odd_spec(3, 1, 1)
    backend = get_backend("codegen")
    packed = backend.prepare(torch.from_numpy(sparse(spec.weight_shape, 0.9)).to("cuda", HALF), None)
    x = torch.randn(3, 3, 13, 13, device="cuda", dtype=HALF)
    bias = torch.randn(spec.K, device="cuda", dtype=HALF)
    assert backend.run(x, packed, bias, spec, None).dtype == HALF
    assert_graph_replay_equals_eager(backend, packed, x, bias, spec)
