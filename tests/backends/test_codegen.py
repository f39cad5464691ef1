"""Backend `codegen` (paper 002): template, PTX rewrite (Algorithm 2), toolchain, cache, backend
(float32; test_codegen_fp16.py has float16).

CPU tests compile real templates of tiny layers with the CUDA toolkit's nvcc and ptxas (skipped,
with the reason, when those are missing) and check the PTX and cubins. GPU tests (`gpu` marker)
check the kernels against the fp64 reference, that both modes agree bit for bit, and CUDA graphs.
"""
import collections
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import time

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

from sparsecnn.backends import config_to_dict, get_backend
from sparsecnn.backends.codegen import generator as codegen
from sparsecnn.backends.codegen import template
from sparsecnn.backends.codegen.plan import (
    DEFAULT_MAX_KERNEL_FMAS,
    MODES,
    SMEM_BYTES_MAX,
)
from sparsecnn.backends.codegen.ptx_rewrite import (
    RewriteError,
    immediate,
    placeholder_sites,
    rewrite_ptx,
)
from sparsecnn.core import cubin_loader as loader_module
from sparsecnn.core import toolchain
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers import get_suite

gpu = pytest.mark.gpu

SMALL = ConvSpec(2, 3, 4, 9, 9, 3, 3, 1, 1, name="small")  # the C=3, K=4, 3x3
SMALL_CONFIG = codegen.CodegenConfig(bh=1, bk=4, tx=8, ty=4)  # one output per thread: one FMA per weight
_IMMEDIATES = re.compile(r"0f[0-9A-F]{8}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return toolchain.DiskCache(tmp_path_factory.mktemp("codegen-cache"))


@pytest.fixture(scope="module")
def small_template(cache):
    plan = codegen.make_plan(SMALL, SMALL_CONFIG)
    return plan, codegen.compile_template(plan, cache)


# --- config and plan (no toolkit needed) ----------------------------------------------------


@pytest.mark.parametrize("fields, name", [
    (dict(bh=0), "bh"), (dict(bk=1.5), "bk"), (dict(tx=10, ty=3), "tx * ty"), (dict(bk=200), "bk"),
    (dict(bk=8, slice_k=12), "slice_k"), (dict(mode="jit"), "mode"), (dict(min_blocks=-1), "min_blocks"),
    (dict(chunk_c=-2), "chunk_c"), (dict(accumulate="fp8"), "accumulate"), (dict(half_terms=-1), "half_terms"),
    (dict(accumulate="half2", bk=64), "bk"),
])
def test_config_validation_names_the_field(fields, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        codegen.CodegenConfig(**fields)


def test_config_round_trips_through_dict():
    config = codegen.CodegenConfig(bh=2, bk=16, mode="emit", min_blocks=3)
    backend = get_backend("codegen")
    assert backend.config_from_dict(config_to_dict(config)) == config
    with pytest.raises(ValueError, match="unknown"):
        codegen.CodegenConfig.from_dict({"bh": 1, "threads": 128})


@pytest.mark.parametrize("spec", [SMALL, *get_suite("dong", 64), *get_suite("dong", 1)], ids=lambda s: f"{s.name}-{s.N}")
def test_candidate_configs_are_few_valid_and_within_the_cap(spec):
    configs = codegen.candidate_configs(spec)
    assert 3 <= len(configs) <= 6
    assert configs[0] == codegen.default_config(spec)
    assert len(set(configs)) == len(configs)
    assert {config.mode for config in configs} == {"rewrite", "emit"}
    for config in configs:
        plan = codegen.make_plan(spec, config)
        assert plan.template_fmas <= DEFAULT_MAX_KERNEL_FMAS
        assert plan.smem_bytes <= SMEM_BYTES_MAX
        assert plan.n_slices * plan.slice_k >= spec.K


def test_large_layers_are_split_into_slices_under_the_cap():
    resnet_conv2 = next(s for s in get_suite("dong", 64) if s.name == "resnet-conv2")  # K = C = 128
    plan = codegen.make_plan(resnet_conv2, codegen.default_config(resnet_conv2))
    assert plan.n_slices >= 2 and plan.template_fmas <= DEFAULT_MAX_KERNEL_FMAS
    small_cap = codegen.make_plan(resnet_conv2, codegen.default_config(resnet_conv2, 12_000), max_kernel_fmas=12_000)
    assert small_cap.n_slices > plan.n_slices and small_cap.template_fmas <= 12_000
    with pytest.raises(ValueError, match="exceed the cap"):
        codegen.make_plan(resnet_conv2, codegen.CodegenConfig(bk=64, bh=2), max_kernel_fmas=40_000)
    with pytest.raises(ValueError, match="groups=1"):
        codegen.make_plan(ConvSpec(1, 4, 4, 8, 8, 3, 3, groups=2), SMALL_CONFIG)


def test_placeholders_are_distinct_nonzero_and_exact_in_hex():
    bits = template.placeholder_bits(100_000)
    assert len(set(bits.tolist())) == bits.size
    assert (bits & 0x7FFFFFFF).min() > 0
    values = bits.view(np.float32)
    assert np.isfinite(values).all() and values.min() > 1e10  # far from any constant nvcc makes up
    for b in (int(bits[0]), int(bits[-1]), 0x3F99999A, 0x00000001, 0xBF800000):
        literal = template.f32_literal(b)
        assert np.float32(float.fromhex(literal[:-1])).view(np.uint32) == b


# --- the template and Algorithm 2 on real PTX -----------------------------------------------


@needs_tools
def test_template_has_each_placeholder_once_as_an_fma_weight(small_template):
    plan, tmpl = small_template
    placeholders = template.placeholder_bits(plan.template_fmas).tolist()
    assert plan.template_fmas == 4 * 3 * 3 * 3
    assert placeholder_sites(tmpl.ptx, frozenset(placeholders)) == {bits: 1 for bits in placeholders}
    text_counts = collections.Counter(_IMMEDIATES.findall(tmpl.ptx))
    assert all(text_counts[immediate(bits)] == 1 for bits in placeholders)
    assert toolchain.ptx_isa(tmpl.ptx) <= toolchain.DEFAULT_MAX_PTX_ISA


@needs_tools
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_rewrite_deletes_one_fma_per_zero_weight_and_assembles(small_template, sparsity):
    plan, tmpl = small_template
    weight = sparse(SMALL.weight_shape, sparsity)
    zeros = int((weight == 0).sum())
    ptx, stats = rewrite_ptx(tmpl.ptx, value_map(plan, weight))
    assert (stats.fmas, stats.deleted, stats.kept) == (weight.size, zeros, weight.size - zeros)
    immediates = set(_IMMEDIATES.findall(ptx))
    assert not immediates & {immediate(b) for b in template.placeholder_bits(plan.template_fmas).tolist()}
    assert {immediate(b) for b in weight[weight != 0].view(np.uint32).tolist()} <= immediates
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == weight.size - zeros
    cubin, info, _ = toolchain.ptxas_cubin(ptx)
    assert cubin[:4] == b"\x7fELF" and info.registers > 0


def store_chains(ptx: str) -> dict:
    """{byte offset of each st.global.f32: the weight immediates of the FMA chain it stores, in
    chain order}, following each stored register back through `fma d, x, w, c` to its start."""
    defined, chains = {}, {}
    for line in ptx.splitlines():
        fma = re.search(r"fma\.rn\.f32\s+(%f\d+),\s*(\S+),\s*(\S+),\s*(\S+);", line)
        if fma:
            d, a, b, c = fma.groups()
            defined[d] = (b if b.startswith("0f") else a, c)
        store = re.search(r"st\.global\.f32\s+\[%rd\d+(?:\+(\d+))?\],\s*(%f\d+);", line)
        if store:
            chain, register = [], store.group(2)
            while register in defined:
                weight, register = defined[register]
                chain.append(weight)
            chains[int(store.group(1) or 0)] = chain[::-1]
    return chains


@needs_tools
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_each_store_reads_the_chain_of_its_nonzero_weights(small_template, sparsity):
    """Dataflow of the rewritten PTX: output channel k stores bias + the FMAs of exactly the
    non-zero W[k, c, r, s], in (c, r, s) order (deleted FMAs forwarded, nothing else lost)."""
    plan, tmpl = small_template
    weight = sparse(SMALL.weight_shape, sparsity)
    ptx, _ = rewrite_ptx(tmpl.ptx, value_map(plan, weight))
    pq_bytes = 4 * SMALL.P * SMALL.Q
    expected = {k * pq_bytes: [immediate(b) for b in w[w != 0].view(np.uint32).tolist()]
                for k, w in enumerate(weight.reshape(SMALL.K, -1))}
    assert store_chains(ptx) == expected


@needs_tools
def test_rewrite_of_a_chain_starting_at_zero(cache):
    """Without bias every accumulator starts at `mov.f32 %f, 0f00000000`: a fully zero weight must
    leave the stores reading that zero."""
    plan = codegen.make_plan(SMALL, SMALL_CONFIG, has_bias=False)
    ptx = codegen.compile_template(plan, cache).ptx
    zero_registers = set(re.findall(r"mov\.f32\s+(%f\d+), 0f00000000;", ptx))
    assert zero_registers
    rewritten, stats = rewrite_ptx(ptx, value_map(plan, np.zeros(SMALL.weight_shape, np.float32)))
    assert stats.deleted == stats.fmas == plan.template_fmas and "fma.rn.f32" not in rewritten
    stored = re.findall(r"st\.global\.f32\s+\[[^\]]+\],\s*(%f\d+);", rewritten)
    assert stored and set(stored) <= zero_registers
    toolchain.ptxas_cubin(rewritten)
    half, _ = rewrite_ptx(ptx, value_map(plan, sparse(SMALL.weight_shape, 0.5)))
    toolchain.ptxas_cubin(half)


def test_figure4_example_rewrites_exactly():
    ptx = ("fma.rn.f32 %f3, %f10, 0f3F99999A, %f2;\n"  # 1.2 -> 0: deleted, %f3 -> %f2
           "fma.rn.f32 %f4, %f11, 0f3FB33333, %f3;\n")  # 1.4 -> 1.4
    out, stats = rewrite_ptx(ptx, {0x3F99999A: 0x00000000, 0x3FB33333: 0x3FB33333})
    assert out == "fma.rn.f32 %f4, %f11, 0f3FB33333, %f2;\n"
    assert (stats.deleted, stats.kept, stats.forwarded) == (1, 1, 1)


def test_rewrite_folds_placeholder_movs_and_constant_chains():
    ptx = "\n".join([
        "\tmov.f32 \t%f1, 0f3F99999A;",  # placeholder in a register (nvcc 13's form): folded
        "\tfma.rn.f32 \t%f3, %f10, %f1, 0f00000000;",  # zero weight, constant addend -> constant mov
        "\tmul.rn.f32 \t%f4, %f11, 0f3FB33333;",  # zero weight in a mul -> 0
        "\tfma.rn.f32 \t%f5, %f12, 0f3FC00000, %f4;",  # kept, weight 1.5 -> 2.0
        "\tfma.rn.f32 \t%f6, %f13, 0f40000000, %f5;",  # deleted: %f6 -> %f5
        "\tmax.f32 \t%f7, %f6, %f3;",
        "\t@%p1 st.global.f32 \t[%rd1+4], %f6;",
    ])
    vmap = {0x3F99999A: 0, 0x3FB33333: 0x80000000, 0x3FC00000: 0x40000000, 0x40000000: 0}
    out, stats = rewrite_ptx(ptx, vmap)
    assert out.splitlines() == [
        "\tmov.f32 \t%f3, 0f00000000;",
        "\tmov.f32 \t%f4, 0f00000000;",
        "\tfma.rn.f32 \t%f5, %f12, 0f40000000, %f4;",
        "\tmax.f32 \t%f7, %f5, %f3;",
        "\t@%p1 st.global.f32 \t[%rd1+4], %f5;",
    ]
    assert (stats.fmas, stats.deleted, stats.kept, stats.forwarded) == (4, 3, 1, 1)


@pytest.mark.parametrize("ptx, vmap, message", [
    ("fma.rn.f32 %f3, %f1, 0f3F99999A, %f2;\nadd.f32 %f2, %f2, %f2;\nst.global.f32 [%rd1], %f3;",
     {0x3F99999A: 0}, "SSA"),
    ("@%p1 fma.rn.f32 %f3, %f1, 0f3F99999A, %f2;", {0x3F99999A: 0}, "predicated"),
    ("fma.rn.f32 %f3, %f1, 0f3F99999A, %f2;", {0x3F99999A: 0, 0x3FB33333: 1}, "not found"),
    ("fma.rn.f32 %f3, %f1, 0f3F99999A, %f2;\nfma.rn.f32 %f4, %f1, 0f3F99999A, %f3;", {0x3F99999A: 1},
     "more than once"),
    ("mov.f32 %f1, 0f3F99999A;\nadd.f32 %f2, %f1, %f1;", {0x3F99999A: 1}, "outside a weight"),
])
def test_rewrite_refuses_what_it_cannot_do_soundly(ptx, vmap, message):
    with pytest.raises(RewriteError, match=message):
        rewrite_ptx(ptx, vmap)


def test_placeholder_sites_rejects_a_placeholder_outside_a_weight_operand():
    with pytest.raises(RewriteError, match="outside"):
        placeholder_sites("fma.rn.f32 %f3, %f1, %f2, 0f3F99999A;", {0x3F99999A})


# --- toolchain and cache ---------------------------------------------------------------------


def test_isa_check_refuses_newer_ptx(monkeypatch):
    newer = "//\n.version 9.5\n.target sm_90\n.address_size 64\n"
    with pytest.raises(toolchain.ToolchainError, match=r"9\.5 is newer than 9\.0"):
        toolchain.check_ptx_isa(newer, (9, 0))
    toolchain.check_ptx_isa(newer.replace("9.5", "9.0"), (9, 0))
    monkeypatch.setattr(toolchain, "driver_cuda_version", lambda: None)
    monkeypatch.delenv("SPARSECNN_MAX_PTX_ISA", raising=False)
    assert toolchain.max_ptx_isa() == (9, 0)
    with pytest.raises(toolchain.ToolchainError):
        toolchain.check_ptx_isa(newer)
    monkeypatch.setattr(toolchain, "driver_cuda_version", lambda: (12, 8))
    assert toolchain.max_ptx_isa() == (8, 7)
    monkeypatch.setenv("SPARSECNN_MAX_PTX_ISA", "9.5")
    toolchain.check_ptx_isa(newer)
    monkeypatch.setenv("SPARSECNN_MAX_PTX_ISA", "nine")
    with pytest.raises(toolchain.ToolchainError, match="SPARSECNN_MAX_PTX_ISA"):
        toolchain.max_ptx_isa()


def test_missing_tool_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SPARSECNN_NVCC", "/nonexistent/nvcc")
    assert toolchain.find_tool("nvcc") is None
    with pytest.raises(toolchain.ToolchainError, match="nvcc not found"):
        toolchain.require_tool("nvcc")


@needs_tools
def test_second_compile_hits_the_cache_and_the_key_follows_the_config(tmp_path):
    cache = toolchain.DiskCache(tmp_path)
    weight = sparse(SMALL.weight_shape, 0.5)
    hits_before = toolchain.CACHE_STATS["hit"]
    first = codegen.compile_conv(weight, SMALL, SMALL_CONFIG, cache=cache)
    assert first.report.cache_hits == 0 and first.report.nvcc_s > 0 and first.report.ptxas_s > 0
    files = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}
    assert {path.suffix for path in files} == {".ptx", ".cubin", ".json", ".lock"}  # no temp files left behind
    assert all(path.stat().st_size == 0 for path in files if path.suffix == ".lock")
    second = codegen.compile_conv(weight, SMALL, SMALL_CONFIG, cache=cache)
    assert second.report.cache_hits == 2 and second.report.nvcc_s == second.report.ptxas_s == 0
    assert toolchain.CACHE_STATS["hit"] >= hits_before + 3  # template ptx, slice json + cubin
    assert second.cubins == first.cubins and second.report.fmas_deleted == first.report.fmas_deleted
    assert {path: path.stat().st_mtime_ns for path in files} == files  # nothing rewritten
    other = dataclasses.replace(SMALL_CONFIG, tx=16, ty=2)
    key_a = codegen.compile_template(codegen.make_plan(SMALL, SMALL_CONFIG), cache).key
    key_b = codegen.compile_template(codegen.make_plan(SMALL, other), cache).key
    assert key_a != key_b
    codegen.compile_conv(sparse(SMALL.weight_shape, 0.5, seed=1), SMALL, SMALL_CONFIG, cache=cache)
    assert len(list(tmp_path.rglob("*.cubin"))) == 2  # new weights: new slice, same template


@needs_tools
def test_a_cached_template_is_found_without_generating_its_source(tmp_path, monkeypatch):
    cache = toolchain.DiskCache(tmp_path)
    weight = sparse(SMALL.weight_shape, 0.5)
    first = codegen.compile_conv(weight, SMALL, SMALL_CONFIG, cache=cache)

    def no_source(*args, **kwargs):
        raise AssertionError("generated the source of a cached template")

    monkeypatch.setattr(codegen, "kernel_source", no_source)
    other_layer = dataclasses.replace(SMALL, N=SMALL.N + 3, name="another layer of the same shape")
    again = codegen.compile_conv(weight, other_layer, SMALL_CONFIG, cache=cache)
    assert again.report.cache_hits == 2 and again.cubins == first.cubins
    with pytest.raises(AssertionError, match="generated the source"):  # another plan: a new template
        codegen.compile_conv(weight, SMALL, dataclasses.replace(SMALL_CONFIG, tx=16, ty=2), cache=cache)


@needs_tools
def test_concurrent_compiles_of_one_plan_run_nvcc_once(tmp_path, monkeypatch):
    """Layers of one plan compiled at once (worker processes; threads here: flock locks are per
    open file) wait for one nvcc and take its template from the cache."""
    cache, calls, real_nvcc = toolchain.DiskCache(tmp_path), [], toolchain.nvcc_ptx

    def slow_nvcc(source, *args):
        calls.append(source)
        time.sleep(0.5)  # the others ask for the template while this one compiles it
        return real_nvcc(source, *args)

    monkeypatch.setattr(toolchain, "nvcc_ptx", slow_nvcc)
    plan = codegen.make_plan(SMALL, SMALL_CONFIG)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        templates = list(pool.map(lambda _: codegen.compile_template(plan, cache), range(3)))
    assert len(calls) == 1 and sorted(t.cached for t in templates) == [False, True, True]
    assert len({t.ptx for t in templates}) == 1


def test_disk_cache_lock_is_exclusive(tmp_path):
    cache, events = toolchain.DiskCache(tmp_path), []

    def hold(name):
        with cache.exclusive("k" * 16):
            events.append(f"{name} in")
            time.sleep(0.2)
            events.append(f"{name} out")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(hold, ["a", "b"]))
    assert [event.split()[1] for event in events] == ["in", "out", "in", "out"]


@needs_tools
def test_emit_mode_compiles_only_the_nonzero_terms(cache):
    weight = sparse(SMALL.weight_shape, 0.5)
    config = dataclasses.replace(SMALL_CONFIG, mode="emit")
    plan = codegen.make_plan(SMALL, config)
    source = codegen.kernel_source(plan, weight)
    assert source.count("__fmaf_rn") == np.count_nonzero(weight)
    compiled = codegen.compile_conv(weight, SMALL, config, cache=cache)
    report = compiled.report
    assert compiled.cubins[0][:4] == b"\x7fELF"
    assert (report.fmas_kept, report.fmas_deleted) == (np.count_nonzero(weight), int((weight == 0).sum()))
    assert report.ptx_bytes > 0 and report.registers > 0 and report.template_ptx_bytes == 0


@needs_tools
def test_a_template_the_rewrite_refuses_is_compiled_in_emit_mode(cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise codegen.RewriteError("register %f9 is redefined while forwarded to (PTX not in SSA form)")

    monkeypatch.setattr(codegen, "rewrite_ptx", refuse)
    weight = sparse(SMALL.weight_shape, 0.5, seed=3)
    compiled = codegen.compile_conv(weight, SMALL, SMALL_CONFIG, cache=cache)
    assert SMALL_CONFIG.mode == "rewrite" and compiled.report.mode == "emit"
    assert "not in SSA form" in compiled.report.fallback
    assert compiled.report.fmas_kept == np.count_nonzero(weight)


@needs_tools
def test_slices_share_one_template(cache):
    spec = ConvSpec(1, 3, 20, 9, 9, 3, 3, 1, 1)
    config = codegen.CodegenConfig(bh=1, bk=4, tx=8, ty=4)
    weight = sparse(spec.weight_shape, 0.7)
    compiled = codegen.compile_conv(weight, spec, config, max_kernel_fmas=2 * 4 * 27, cache=cache)
    report = compiled.report
    assert report.slices == len(compiled.cubins) == 3 and compiled.plan.slice_k == 8
    padded_zeros = (3 * 8 - 20) * 27  # channels past K in the last slice
    assert report.fmas_deleted == int((weight == 0).sum()) + padded_zeros
    assert report.fmas_kept == np.count_nonzero(weight)
    assert report.cache_hits <= 1  # at most the template


@needs_tools
@pytest.mark.slow
def test_resnet_conv1_default_tiling_does_not_spill(cache):
    spec = next(s for s in get_suite("dong", 64) if s.name == "resnet-conv1")
    compiled = codegen.compile_conv(sparse(spec.weight_shape, 0.9), spec, cache=cache)
    report = compiled.report
    assert report.slices == 1 and report.spill_stores == report.spill_loads == 0
    assert 0 < report.registers <= 255


# --- the generated CUDA C, run on the CPU ---------------------------------------------------


@pytest.mark.quick_sample(8)
@needs_gxx
@pytest.mark.parametrize("r, stride, pad, config, relu, has_bias", [
    (3, 1, 1, None, False, True),
    (5, 2, 2, None, True, True),
    (1, 2, 1, None, False, False),
    (3, 2, 1, codegen.CodegenConfig(bh=2, bw=2, bn=2, bk=8, tx=8, ty=4, chunk_c=1, slice_k=16), False, True),
    (3, 2, 1, codegen.CodegenConfig(bh=1, bw=3, bn=1, bk=5, tx=8, ty=8, chunk_c=2), True, False),
    (3, 2, 1, codegen.CodegenConfig(bh=4, bw=1, bn=3, bk=3, tx=32, ty=1, slice_k=9), True, True),
    (3, 3, 1, None, True, True),
], ids=["3x3", "5x5-s2-relu", "1x1-s2-nobias", "slices-groups-chunks", "relu-nobias", "bn3", "3x3-s3-relu"])
@pytest.mark.slow
def test_emitted_source_computes_the_convolution(tmp_path, r, stride, pad, config, relu, has_bias):
    """The generated CUDA C (staging with halo and padding, double-buffered chunks, groups, slices
    walked backwards, partial tiles and image groups, epilogue) run as C++: it is the code both
    modes compile, so its index arithmetic is checked here without a GPU."""
    spec = ConvSpec(4, 3, 33, 13, 13, r, r, stride, pad)
    config = dataclasses.replace(config or codegen.default_config(spec), mode="emit")
    plan = codegen.make_plan(spec, config, relu=relu, has_bias=has_bias)
    rng = np.random.default_rng(1)
    weight = sparse(spec.weight_shape, 0.5)
    weight[7] = 0  # one channel fully pruned: exactly the bias (or 0) must come out
    x = rng.standard_normal(spec.input_shape).astype(np.float32)
    bias = rng.standard_normal(spec.K).astype(np.float32) if has_bias else np.zeros(1, np.float32)
    y = run_emitted_on_cpu(plan, weight, x, bias, tmp_path)
    ref = reference_conv(torch.from_numpy(x), torch.from_numpy(weight),
                         torch.from_numpy(bias) if has_bias else None, stride=stride, padding=pad, fp64=True)
    ref = ref.clamp_min(0) if relu else ref
    assert relative_error(torch.from_numpy(y), ref) < 1e-6
    channel_bias = float(bias[7]) if has_bias else 0.0
    assert (y[:, 7] == np.float32(max(channel_bias, 0.0) if relu else channel_bias)).all()


# --- backend and import ----------------------------------------------------------------------


def test_backend_declares_what_it_runs():
    backend = get_backend("codegen")
    assert dict(backend.dtypes) == {"cuda": (torch.float32, torch.float16)}
    assert "cpu" in backend.unsupported_reason(SMALL, torch.float32, "cpu")
    assert "bfloat16" in backend.unsupported_reason(SMALL, torch.bfloat16, "cuda")
    assert "groups" in backend.spec_check(ConvSpec(1, 4, 4, 8, 8, 3, 3, groups=2))
    assert "dilation" in backend.spec_check(ConvSpec(1, 4, 4, 8, 8, 3, 3, dilation=2))
    assert "exceed" in backend.spec_check(ConvSpec(1, 512, 512, 14, 14, 3, 3, 1, 1))
    for spec in get_suite("dong", 64):
        assert backend.spec_check(spec) is None
        assert backend.configs(spec, torch.float32)[0] == codegen.default_config(spec)


def test_import_does_not_load_cuda_libraries():
    code = ("import sys, torch\n"
            "before = set(sys.modules)\n"
            "import sparsecnn, sparsecnn.backends, sparsecnn.backends.codegen.generator\n"
            "new = set(sys.modules) - before\n"
            "bad = [m for m in new if m.split('.')[0] in ('cupy', 'cuda', 'triton')]\n"
            "assert not bad, bad\n"
            "assert not torch.cuda.is_initialized()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --- GPU: numerics, modes, graphs, loaders ---------------------------------------------------

ODD = dict(C=3, K=33, H=13)
SHAPES = [(1, 1, 0), (1, 2, 1), (3, 1, 1), (3, 2, 0), (3, 1, 2), (5, 1, 2), (5, 2, 1), (5, 1, 0),
          (3, 3, 1)]  # (R, stride, pad)
SPARSITIES = [0.0, 0.5, 0.9, 0.99, 1.0]


def odd_spec(r, stride, pad, n=3):
    return ConvSpec(n, ODD["C"], ODD["K"], ODD["H"], ODD["H"], r, r, stride, pad)


def run_checked(compiled, x, bias):
    """Run into a NaN-filled output (so an unwritten element shows) and return it."""
    out = torch.full((x.shape[0], *compiled.plan.spec.output_shape[1:]), float("nan"), device="cuda")
    return compiled(x, bias, out=out)


@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("r, stride, pad", SHAPES)
def test_matches_the_fp64_reference(cache, mode, r, stride, pad):
    spec = odd_spec(r, stride, pad)
    config = dataclasses.replace(codegen.default_config(spec), mode=mode)
    bias = torch.randn(spec.K, device="cuda")
    for sparsity in SPARSITIES:
        weight = torch.from_numpy(sparse(spec.weight_shape, sparsity))
        compiled = codegen.compile_conv(weight, spec, config, cache=cache)
        for n in (1, 3):
            x = torch.randn(n, spec.C, spec.H, spec.W, device="cuda")
            y = run_checked(compiled, x, bias)
            ref = reference_conv(x, weight.cuda(), bias, stride=stride, padding=pad, fp64=True)
            if sparsity == 1.0:
                assert torch.equal(y, bias.view(1, -1, 1, 1).expand_as(y)), "a zero weight must give exactly the bias"
            else:
                assert relative_error(y, ref) < 1e-5, (sparsity, n)


@gpu
def test_both_modes_agree_bit_for_bit(cache):
    spec = odd_spec(3, 1, 1)
    weight = sparse(spec.weight_shape, 0.7)
    x, bias = torch.randn(3, 3, 13, 13, device="cuda"), torch.randn(spec.K, device="cuda")
    config = codegen.default_config(spec)
    rewrite = codegen.compile_conv(weight, spec, config, cache=cache)
    emit = codegen.compile_conv(weight, spec, dataclasses.replace(config, mode="emit"), cache=cache)
    assert torch.equal(run_checked(rewrite, x, bias), run_checked(emit, x, bias))


@gpu
@pytest.mark.parametrize("config, relu, has_bias", [
    (codegen.CodegenConfig(bh=2, bw=2, bn=2, bk=8, tx=8, ty=4, chunk_c=1, slice_k=16), False, True),
    (codegen.CodegenConfig(bh=1, bw=3, bn=1, bk=5, tx=8, ty=8, chunk_c=2, min_blocks=2), True, False),
    (codegen.CodegenConfig(bh=4, bw=1, bn=3, bk=3, tx=32, ty=1, slice_k=9, mode="emit"), True, True),
], ids=["slices-groups-chunks", "relu-nobias", "emit-bn3"])
def test_other_tilings(cache, config, relu, has_bias):
    """Several slices (odd ones walk backwards), groups, chunks, partial image groups, ReLU, no bias."""
    spec = odd_spec(3, 2, 1)
    weight = torch.from_numpy(sparse(spec.weight_shape, 0.6))
    bias = torch.randn(spec.K, device="cuda") if has_bias else None
    compiled = codegen.compile_conv(weight, spec, config, relu=relu, has_bias=has_bias, cache=cache)
    for n in (1, 3, 4):
        x = torch.randn(n, spec.C, spec.H, spec.W, device="cuda")
        ref = reference_conv(x, weight.cuda(), bias, stride=2, padding=1, fp64=True)
        ref = ref.clamp_min(0) if relu else ref
        assert relative_error(run_checked(compiled, x, bias), ref) < 1e-5


@gpu
def test_zero_weight_without_bias_gives_zeros(cache):
    spec = odd_spec(3, 1, 1)
    compiled = codegen.compile_conv(np.zeros(spec.weight_shape, np.float32), spec, has_bias=False, cache=cache)
    y = run_checked(compiled, torch.randn(3, 3, 13, 13, device="cuda"), None)
    assert torch.equal(y, torch.zeros_like(y))


@gpu
def test_cuda_graph_replay_equals_eager(cache):
    spec = odd_spec(3, 1, 1)
    backend = get_backend("codegen")
    packed = backend.prepare(torch.from_numpy(sparse(spec.weight_shape, 0.9)).cuda(), None)
    x, bias = torch.randn(3, 3, 13, 13, device="cuda"), torch.randn(spec.K, device="cuda")
    assert_graph_replay_equals_eager(backend, packed, x, bias, spec)


@gpu
@pytest.mark.parametrize("loader", loader_module.LOADERS)
def test_each_loader_runs_the_kernels(cache, monkeypatch, loader):
    pytest.importorskip("cuda.bindings" if loader == "cuda-python" else "cupy")
    monkeypatch.setenv("SPARSECNN_CODEGEN_LOADER", loader)
    spec = odd_spec(3, 1, 1)
    weight = torch.from_numpy(sparse(spec.weight_shape, 0.5))
    compiled = codegen.compile_conv(weight, spec, cache=cache)
    x, bias = torch.randn(3, 3, 13, 13, device="cuda"), torch.randn(spec.K, device="cuda")
    ref = reference_conv(x, weight.cuda(), bias, stride=1, padding=1, fp64=True)
    assert relative_error(run_checked(compiled, x, bias), ref) < 1e-5


@gpu
def test_sparse_conv2d_runs_on_codegen():
    from sparsecnn.nn import SparseConv2d

    weight = torch.from_numpy(sparse((33, 3, 3, 3), 0.8)).cuda()
    bias = torch.randn(33, device="cuda")
    module = SparseConv2d(weight, bias, stride=1, padding=1, backend="codegen")
    x = torch.randn(2, 3, 13, 13, device="cuda")
    ref = reference_conv(x, weight, bias, padding=1, fp64=True)
    with torch.no_grad():
        assert relative_error(module(x), ref) < 1e-5
    assert module.fallback_reason is None


def test_lazy_kernels_load_each_cubin_once_per_device(monkeypatch):
    loads = []
    monkeypatch.setattr(loader_module, "load_kernel", lambda cubin, name, device, dynamic_smem=0:
                        loads.append((cubin, name, device, dynamic_smem)) or (cubin, device))
    lazy = loader_module.LazyKernels([b"a", b"b"], "k", dynamic_smem=64)
    assert loads == []   # nothing loads before first use
    assert lazy.kernels(0) == [(b"a", 0), (b"b", 0)] and lazy.kernels(0) is lazy.kernels(0)
    assert lazy.kernels(1) == [(b"a", 1), (b"b", 1)]
    assert loads == [(b"a", "k", 0, 64), (b"b", "k", 0, 64), (b"a", "k", 1, 64), (b"b", "k", 1, 64)]

