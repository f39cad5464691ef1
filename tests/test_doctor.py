"""`sparsecnn doctor`: the report on a CPU machine, and the offline compile check of every generated
family (codegen fp32 and fp16, staged, unrolled) for sm_80, sm_86, sm_89 and sm_90 with ptxas."""
import pytest
import torch

from helpers.codegen import needs_tools
from sparsecnn import doctor
from sparsecnn.backends import backend_names, get_backend
from sparsecnn.cli import main



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report without a CUDA device")
def test_doctor_on_cpu_says_there_is_no_gpu_and_why_each_cuda_backend_cannot_run(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "GPU: none (" in out and "torch " in out and "triton " in out and "CUDA driver:" in out
    assert "nvcc:" in out and "ptxas:" in out
    cuda_only = [name for name in backend_names() if "cpu" not in get_backend(name).dtypes]
    assert {"codegen", "staged", "unrolled"} <= set(cuda_only)  # (Triton ones run on CPU in the interpreter)
    for name in cuda_only:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert "cannot run here: runs on CUDA only" in line and "no GPU" in line
    assert next(line for line in out.splitlines() if line.strip().startswith("dense ")).endswith("can run here (cpu: float32, bfloat16, float64)")


def test_a_missing_toolchain_is_why_the_generated_backends_cannot_run():
    status = doctor.backend_status(None, "no nvcc (install the CUDA toolkit)", None)
    assert all("nvcc" in status[name] for name in doctor.GENERATED)
    assert status["direct"] is None and status["dense"] is None


@pytest.mark.quick_sample(4)
@needs_tools
@pytest.mark.parametrize("arch", ["80", "86", "89", "90"])
def test_every_generated_family_compiles_for_the_arch_with_ptxas_offline(arch):
    results = doctor.compile_check([arch])
    assert [(r.family, r.arch) for r in results] == [(family, arch) for family in doctor.FAMILIES]
    assert all(r.ok for r in results), [r.line() for r in results if not r.ok]


def test_an_unknown_arch_fails_the_check_with_a_nonzero_status(capsys):
    assert main(["doctor", "--compile-check", "--arch", "75"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAILED") >= len(doctor.FAMILIES) and "unknown GPU arch '75'" in out


@needs_tools
@pytest.mark.slow
def test_the_compile_check_prints_one_line_per_family_and_arch(capsys):
    assert main(["doctor", "--compile-check", "--arch", "80,90"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " OK " in line]
    assert len(lines) == 2 * len(doctor.FAMILIES)


def test_arch_without_compile_check_is_an_error(capsys):
    assert main(["doctor", "--arch", "80"]) == 2
    assert "--compile-check" in capsys.readouterr().err
