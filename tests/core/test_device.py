"""core.device: nominal per-arch properties, the CPU default, and the sizing of the staged, codegen
and direct backends derived from it (the H100 numbers for sm_90, scaled on a 108-SM A100)."""
import numpy as np
import pytest
import torch

from helpers.codegen import needs_tools
from sparsecnn.backends.codegen import plan as codegen_plan
from sparsecnn.backends.direct import kernel as direct
from sparsecnn.backends.staged import kernel as staged
from sparsecnn.backends.unrolled import source as unrolled_source
from sparsecnn.core import device, toolchain
from sparsecnn.core.spec import ConvSpec

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


@pytest.mark.parametrize("arch, capability, sms, optin_kb, per_sm_kb", [
    ("80", (8, 0), 108, 163, 164), ("86", (8, 6), 72, 99, 100), ("87", (8, 7), 16, 163, 164),
    ("89", (8, 9), 58, 99, 100), ("90", (9, 0), 132, 227, 228)])
def test_for_arch_gives_the_nominal_properties(arch, capability, sms, optin_kb, per_sm_kb):
    props = device.for_arch(arch)
    assert (props.arch, props.capability, props.sm_count) == (arch, capability, sms)
    assert props.max_shared_per_block_optin == optin_kb * 1024 and props.shared_per_sm == per_sm_kb * 1024
    assert props.registers_per_sm == props.registers_per_block == 65536 and props.warp_size == 32
    assert device.for_arch(f"sm_{arch}") == device.for_arch(capability) == props


def test_for_arch_refuses_an_unknown_arch():
    with pytest.raises(ValueError, match="'75'"):
        device.for_arch("75")


@no_gpu
def test_properties_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        device.properties()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        device.properties(0)


@no_gpu
def test_without_a_gpu_sizing_and_compiling_target_the_h100():
    assert device.current() == device.for_arch("90")
    assert device.current_arch() == toolchain.target_arch() == "90"


def test_target_arch_checks_the_arch_and_the_drivers_ptx_isa(monkeypatch):
    assert toolchain.target_arch("sm_86") == toolchain.target_arch(device.for_arch("86")) == "86"
    with pytest.raises(toolchain.ToolchainError, match="sm_75"):
        toolchain.target_arch("75")
    monkeypatch.setenv("SPARSECNN_MAX_PTX_ISA", "7.4")
    assert toolchain.target_arch("87") == "87"
    with pytest.raises(toolchain.ToolchainError, match="sm_89 needs PTX ISA 7.8"):
        toolchain.target_arch("89")


@needs_tools
def test_cache_keys_name_the_arch():
    assert toolchain.toolchain_id("90").endswith("| sm_90") and toolchain.toolchain_id("80").endswith("| sm_80")


H100, A100 = device.for_arch("90"), device.for_arch("80")
# 16 tiles of 4 x 4 pixels x 15 groups of 32 channels x 1: 240 blocks, between 2 x 108 and 2 x 132
MID = ConvSpec(N=32, C=64, K=480, H=16, W=16, R=3, S=3, stride=1, padding=1)
LAYERS = [MID, ConvSpec(N=32, C=64, K=64, H=56, W=56, R=3, S=3, stride=1, padding=1),
          ConvSpec(N=1, C=256, K=512, H=14, W=14, R=1, S=1, stride=2, padding=0),
          ConvSpec(N=8, C=3, K=64, H=224, W=224, R=7, S=7, stride=2, padding=3)]


def test_the_h100_numbers_are_unchanged():
    assert staged.max_smem_bytes(H100) == 227 * 1024
    assert codegen_plan.target_blocks(H100) == 264
    assert direct.target_programs(H100) == 1024
    for spec in LAYERS:  # the default (no GPU here, or an H100 on the GPU machine) is the H100
        assert staged.candidate_configs(spec, H100) == staged.candidate_configs(spec, "90")
        assert codegen_plan.candidate_configs(spec, "float32", props=H100) \
            == codegen_plan.candidate_configs(spec, "float32", props="90")
        assert direct.candidate_configs(spec, props=H100) == direct.candidate_configs(spec, props="90")


@no_gpu
def test_the_default_sizing_without_a_gpu_is_the_h100s():
    for spec in LAYERS:
        assert staged.candidate_configs(spec) == staged.candidate_configs(spec, H100)
        assert codegen_plan.candidate_configs(spec) == codegen_plan.candidate_configs(spec, props=H100)
        assert direct.candidate_configs(spec) == direct.candidate_configs(spec, props=H100)


def test_the_sizing_scales_with_the_device():
    assert staged.max_smem_bytes(A100) == 163 * 1024
    assert codegen_plan.target_blocks(A100) == 216
    assert direct.target_programs(A100) == 512  # 8 x 108 = 864, rounded down to a power of two
    # 240 blocks of 8 warps: fewer than two per SM of an H100 (4 warps then), enough on an A100
    assert staged.candidate_configs(MID, H100)[0].warps == 4
    assert staged.candidate_configs(MID, A100)[0].warps == 8
    big = staged.StagedConfig(4, 8, 13, 4, 8)  # 195 KB of shared memory: an H100's, not an A100's
    staged.check_layer(MID, big, H100)
    with pytest.raises(ValueError, match=f"max {163 * 1024}"):
        staged.check_layer(MID, big, A100)


def test_unrolled_ptx_targets_the_arch_asked_for():
    spec = ConvSpec(N=32, C=4, K=8, H=6, W=6, R=3, S=3, stride=1, padding=1)
    weight = np.random.default_rng(0).standard_normal(spec.weight_shape).astype(np.float32)
    assert "\n.target sm_90\n" in unrolled_source.kernel_ptx(weight, spec, 8, 64)
    assert "\n.target sm_86\n" in unrolled_source.kernel_ptx(weight, spec, 8, 64, arch="86")
