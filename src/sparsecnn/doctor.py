"""`sparsecnn doctor`: what this machine can run, and an offline compile check per arch.

`report()` lists the GPUs (arch, SMs, shared memory), the driver, torch / CUDA / cuDNN / Triton
versions, the toolchain (nvcc and ptxas: where and which version) and the cubin loader, then every
registered backend with whether it can run here and, if not, why. `compile_check(arches)` compiles
one small layer of every generated family (codegen fp32 and fp16, staged, unrolled) for each arch
with nvcc and ptxas into a temporary cache: no GPU needed (ptxas checks register and shared memory
limits per arch).
"""
from __future__ import annotations

import dataclasses
import platform
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

FAMILIES = ("codegen-fp32", "codegen-fp16", "staged", "unrolled")
GENERATED = ("codegen", "staged", "unrolled")  # backends whose kernels nvcc/ptxas compile per layer
DEFAULT_ARCHES = ("80", "86", "89", "90")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One (family, arch) of `compile_check`: ok, and why not (or what ptxas said) in `detail`."""

    family: str
    arch: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{self.family:14s} sm_{self.arch:4s} {'OK' if self.ok else 'FAILED'}  {self.detail}"


def _version(module: str) -> str:
    try:
        imported = __import__(module)
    except ImportError:
        return "not installed"
    return str(getattr(imported, "__version__", "installed"))


def _gpus() -> Tuple[List[str], Optional[str]]:
    """(one line per GPU, why there is none or None)."""
    import torch

    from sparsecnn.core import device

    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = ("CPU-only torch build (torch.version.cuda is None)" if build is None else
               f"torch is built for CUDA {build} but sees no GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)")
        return [], why
    lines = []
    for index in range(torch.cuda.device_count()):
        p = device.properties(index)
        clock = f", {p.clock_khz / 1e6:.2f} GHz" if p.clock_khz else ""
        lines.append(f"cuda:{index} {p.name}: sm_{p.arch}, {p.sm_count} SMs, {p.max_shared_per_block_optin // 1024} KB "
                     f"shared memory per block (opt-in), {p.shared_per_sm // 1024} KB per SM{clock}")
    return lines, None


def _toolchain() -> Tuple[List[str], Optional[str]]:
    """(lines about nvcc / ptxas, why the generated backends cannot compile or None)."""
    from sparsecnn.core import toolchain

    lines, missing = [], []
    for name in ("nvcc", "ptxas"):
        path = toolchain.find_tool(name)
        if path is None:
            missing.append(name)
            lines.append(f"{name}: not found (PATH, $CUDA_HOME/bin, {', '.join(toolchain.SEARCH_DIRS)})")
            continue
        try:
            version = toolchain.tool_version(path)
        except toolchain.ToolchainError as error:
            missing.append(name)
            version = f"unusable: {error}"
        lines.append(f"{name}: {path} ({version})")
    try:
        isa = toolchain.max_ptx_isa()
        lines.append(f"newest PTX ISA the driver accepts: {isa[0]}.{isa[1]}")
    except toolchain.ToolchainError as error:
        lines.append(f"newest PTX ISA: {error}")
    why = f"no {' and no '.join(missing)} (install the CUDA toolkit)" if missing else None
    return lines, why


def _loader() -> Tuple[str, Optional[str]]:
    from sparsecnn.core import cubin_loader

    try:
        return cubin_loader.loader_name(), None
    except RuntimeError as error:
        return "none", str(error)


def backend_status(gpu_missing: Optional[str], toolchain_missing: Optional[str], loader_missing: Optional[str],
                   arch: Optional[str] = None) -> Dict[str, Optional[str]]:
    """{backend name: None if it can run here, else why not}."""
    from sparsecnn.backends import backend_names, get_backend
    from sparsecnn.core import toolchain

    status: Dict[str, Optional[str]] = {}
    for name in backend_names():
        backend = get_backend(name)
        reasons = []
        if gpu_missing is not None:
            if "cpu" not in backend.dtypes:
                reasons.append(f"runs on CUDA only ({', '.join(backend.dtypes)}) and there is no GPU: {gpu_missing}")
        if name in GENERATED:
            if toolchain_missing:
                reasons.append(f"compiles kernels with nvcc/ptxas: {toolchain_missing}")
            if gpu_missing is None and loader_missing:
                reasons.append(loader_missing)
            if gpu_missing is None and arch is not None:
                try:
                    toolchain.target_arch(arch)
                except toolchain.ToolchainError as error:
                    reasons.append(str(error))
        status[name] = "; ".join(reasons) or None
    return status


def _dtypes(name: str, gpu: bool) -> str:
    """"cpu: float32, float64" for the device types of backend `name` usable here."""
    from sparsecnn.backends import get_backend

    dtypes = get_backend(name).dtypes
    return "; ".join(f"{kind}: {', '.join(str(d).replace('torch.', '') for d in dtypes[kind])}"
                     for kind in dtypes if gpu or kind == "cpu")


def report() -> Tuple[List[str], Dict[str, Optional[str]]]:
    """(the report's lines, `backend_status`)."""
    import torch

    from sparsecnn.core import device, toolchain

    gpus, gpu_missing = _gpus()
    tools, tools_missing = _toolchain()
    loader, loader_missing = _loader()
    driver = toolchain.driver_cuda_version()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines = [f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, "
             f"cuDNN {cudnn or 'none'}), triton {_version('triton')}",
             f"CUDA driver: {'%d.%d' % driver if driver else 'none found (no libcuda.so.1)'}"]
    lines += [f"GPU {line}" for line in gpus] or [f"GPU: none ({gpu_missing})"]
    lines += tools
    lines.append(f"cubin loader: {loader}" + (f" ({loader_missing})" if loader_missing else ""))
    arch = device.properties(0).arch if gpu_missing is None else None
    status = backend_status(gpu_missing, tools_missing, loader_missing if gpu_missing is None else None, arch)
    lines.append("backends:")
    for name, why in status.items():
        lines.append(f"  {name:20s} " + (f"can run here ({_dtypes(name, gpu_missing is None)})" if why is None
                                          else f"cannot run here: {why}"))
    return lines, status


def _small_layer():
    import numpy as np

    from sparsecnn.core.spec import ConvSpec

    spec = ConvSpec(N=32, C=8, K=16, H=8, W=8, R=3, S=3, stride=1, padding=1, name="doctor")
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(spec.weight_shape).astype(np.float32)
    weight[rng.random(weight.shape) < 0.8] = 0
    return spec, weight


def _compile_codegen(dtype: str) -> Callable:
    def run(spec, weight, arch: str, cache) -> str:
        from sparsecnn.backends.codegen import generator

        compiled = generator.compile_conv(weight, spec, dtype=dtype, jobs=1, cache=cache, arch=arch)
        return f"{compiled.report.registers} registers, {len(compiled.cubins)} cubin(s)"
    return run


def _compile_staged(spec, weight, arch: str, cache) -> str:
    from sparsecnn.backends.staged import kernel as staged
    from sparsecnn.backends.staged.source import kernel_source
    from sparsecnn.core import toolchain

    config = staged.candidate_configs(spec, arch)[0]
    ptx, _ = toolchain.nvcc_ptx(kernel_source(staged.geometry(spec), config), arch)
    _, info, _ = toolchain.ptxas_cubin(ptx, arch)
    return f"{info.registers} registers"


def _compile_unrolled(spec, weight, arch: str, cache) -> str:
    import torch

    from sparsecnn.backends.unrolled import kernel as unrolled

    compiled = unrolled.compile_layer(torch.from_numpy(weight), spec, unrolled.UnrolledConfig(8, 64), cache, arch)
    return f"{compiled.registers} registers, {len(compiled.cubins)} cubin(s)"


_COMPILERS = {"codegen-fp32": _compile_codegen("float32"), "codegen-fp16": _compile_codegen("float16"),
              "staged": _compile_staged, "unrolled": _compile_unrolled}


def compile_check(arches: Sequence[str], families: Sequence[str] = FAMILIES) -> List[CheckResult]:
    """Compile one small layer of each family for each arch (nvcc + ptxas, a temporary cache)."""
    from sparsecnn.core import device, toolchain

    spec, weight = _small_layer()
    results = []
    for arch in arches:
        arch = device.normalize_arch(arch)
        for family in families:
            with tempfile.TemporaryDirectory(prefix="sparsecnn-doctor-") as tmp:
                try:
                    device.for_arch(arch)
                    detail = _COMPILERS[family](spec, weight, arch, toolchain.DiskCache(tmp))
                    results.append(CheckResult(family, arch, True, detail))
                except (toolchain.ToolchainError, ValueError, RuntimeError) as error:
                    results.append(CheckResult(family, arch, False, " ".join(str(error).split())[:300]))
    return results


def run(compile_arches: Optional[Sequence[str]] = None, print_fn=print) -> int:
    """Print the report (and the compile check for `compile_arches`); 1 if any compile failed."""
    lines, _ = report()
    for line in lines:
        print_fn(line)
    if compile_arches is None:
        return 0
    print_fn(f"compile check (nvcc + ptxas, no GPU needed) for {', '.join('sm_' + a for a in compile_arches)}:")
    results = compile_check(compile_arches)
    for result in results:
        print_fn("  " + result.line())
    failed = [result for result in results if not result.ok]
    print_fn(f"{len(results) - len(failed)} of {len(results)} compiled" + (": FAILED" if failed else ""))
    return 1 if failed else 0
