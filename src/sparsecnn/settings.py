"""Every `SPARSECNN_*` environment variable, in one place: the only module that reads them.

`SETTINGS` lists them (name, type, default, meaning); `describe()` returns those rows and
`markdown_table()` renders them for the README. Each variable has one accessor below, which reads
the environment when called, never at import, so a variable set after `import sparsecnn` (or by
`monkeypatch.setenv` in a test) takes effect on the next call. An empty value counts as unset. A
value that cannot be parsed raises ValueError naming the variable and what it expects.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple, Optional, Tuple


class Setting(NamedTuple):
    """One environment variable: its name, the type of its value, its default and its meaning."""

    name: str
    type: str
    default: str
    meaning: str


CODEGEN_LOADERS = ("cuda-python", "cupy")
UNROLLED_MAX_NNZ_DEFAULT = 60_000
MAX_WORKERS = 16  # the default worker counts' cap
_WORKERS_DEFAULT = f"half the CPUs (1 to {MAX_WORKERS})"
# Replaced by $SPARSECNN_COMPILE_WORKERS (one pool compiles for codegen, staged and unrolled)
_REPLACED_WORKERS = ("SPARSECNN_CODEGEN_WORKERS", "SPARSECNN_UNROLLED_WORKERS")

CACHE_DIR = Setting("SPARSECNN_CACHE_DIR", "path", "~/.cache/sparsecnn/autotune",
                    "tuning decisions cache (`sparsify_`, `autotune_model`)")
CACHE = Setting("SPARSECNN_CACHE", "path", "~/.cache/sparsecnn/codegen",
                "compiled-kernel disk cache (codegen, staged and unrolled backends; blocks' extractions)")
CODEGEN_LOADER = Setting("SPARSECNN_CODEGEN_LOADER", " or ".join(CODEGEN_LOADERS),
                         "cuda-python if installed, else cupy", "library that loads and launches cubins")
NVCC = Setting("SPARSECNN_NVCC", "path", "nvcc on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, /usr/local/bin, "
               "NVIDIA's pip wheel",
               "nvcc to run; when set, no search (not executable: no nvcc)")
PTXAS = Setting("SPARSECNN_PTXAS", "path", "ptxas on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, /usr/local/bin, "
                "NVIDIA's pip wheel",
                "ptxas to run; when set, no search (not executable: no ptxas)")
MAX_PTX_ISA = Setting("SPARSECNN_MAX_PTX_ISA", "major.minor (e.g. 9.0)", "from the driver's CUDA version",
                      "newest PTX ISA the driver accepts (set it if the driver is newer than detected)")
FAST_LAUNCH = Setting("SPARSECNN_FAST_LAUNCH", "0 or 1", "1",
                      "0: launch Triton kernels through Triton's own path (no launch cache)")
PDL = Setting("SPARSECNN_PDL", "0 or 1", "1",
              "0: tensorcore kernels launch without programmatic dependent launch (Hopper and newer)")
UNROLLED_MAX_NNZ = Setting("SPARSECNN_UNROLLED_MAX_NNZ", "int >= 1", str(UNROLLED_MAX_NNZ_DEFAULT),
                           "most non-zeros per layer for the unrolled backend (higher: longer ptxas time)")
BLOCKS_WORKERS = Setting("SPARSECNN_BLOCKS_WORKERS", "int >= 0", _WORKERS_DEFAULT,
                         "worker processes extracting blocks while tuning (0: in-process)")
COMPILE_WORKERS = Setting("SPARSECNN_COMPILE_WORKERS", "int >= 0", f"all the CPUs (1 to {MAX_WORKERS})",
                          "worker processes compiling codegen, staged and unrolled kernels while tuning, "
                          "in the order tuning needs them, and up to 4 more compiling Triton kernels "
                          "(0: in-process)")
DLMC = Setting("SPARSECNN_DLMC", "path", "shared/data/dlmc-rn50 or .carry/dlmc-rn50 found upwards",
               "DLMC ResNet-50 masks (a directory with index.json)")
COMMIT = Setting("SPARSECNN_COMMIT", "str", "git rev-parse --short HEAD of the package's checkout",
                 "commit recorded in benchmark rows (for a copied tree)")
SPUTNIK_LIB = Setting("SPARSECNN_SPUTNIK_LIB", "path", "none",
                      "libsputnik_spmm.so for `sparsecnn bench layers --peers sputnik` "
                      "(built by benchmarks/peers/build_sputnik.sh)")
SPARSERT_COMPILE = Setting("SPARSECNN_SPARSERT_COMPILE", "path", "none",
                           "sparsert_compile.py for `sparsecnn bench layers --peers sparsert` "
                           "(made by benchmarks/peers/build_sparsert.sh)")

SETTINGS: Tuple[Setting, ...] = (CACHE_DIR, CACHE, CODEGEN_LOADER, NVCC, PTXAS, MAX_PTX_ISA, FAST_LAUNCH, PDL,
                                  UNROLLED_MAX_NNZ, BLOCKS_WORKERS, COMPILE_WORKERS,
                                  DLMC, COMMIT, SPUTNIK_LIB, SPARSERT_COMPILE)


def describe() -> Tuple[Setting, ...]:
    """The table of settings: one (name, type, default, meaning) row per variable."""
    return SETTINGS


def markdown_table() -> str:
    """`describe()` as a markdown table (the README's settings section)."""
    lines = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    lines += [f"| `{s.name}` | {s.type} | {s.default} | {s.meaning} |" for s in describe()]
    return "\n".join(lines)


def _raw(setting: Setting) -> Optional[str]:
    """The variable's value, None when unset or empty."""
    return os.environ.get(setting.name) or None


def _path(setting: Setting) -> Optional[Path]:
    raw = _raw(setting)
    return Path(raw).expanduser() if raw else None


def tuning_cache_dir() -> Path:
    """$SPARSECNN_CACHE_DIR (path; default ~/.cache/sparsecnn/autotune): where tuning decisions are cached."""
    return _path(CACHE_DIR) or Path.home() / ".cache" / "sparsecnn" / "autotune"


def codegen_cache_dir() -> Path:
    """$SPARSECNN_CACHE (path; default ~/.cache/sparsecnn/codegen): the compiled-kernel disk cache
    (and, under blocks/, the dense blocks Algorithm 1 found)."""
    return _path(CACHE) or Path.home() / ".cache" / "sparsecnn" / "codegen"


def codegen_loader() -> Optional[str]:
    """$SPARSECNN_CODEGEN_LOADER ("cuda-python" or "cupy"; default None: the caller picks the first
    that imports): the library that loads cubins."""
    chosen = (_raw(CODEGEN_LOADER) or "").strip()
    if not chosen:
        return None
    if chosen not in CODEGEN_LOADERS:
        raise ValueError(f"{CODEGEN_LOADER.name} must be one of {CODEGEN_LOADERS}, got {chosen!r}")
    return chosen


def nvcc() -> Optional[str]:
    """$SPARSECNN_NVCC (path; default None: search PATH and the CUDA directories): the nvcc to run."""
    return _raw(NVCC)


def ptxas() -> Optional[str]:
    """$SPARSECNN_PTXAS (path; default None: search PATH and the CUDA directories): the ptxas to run."""
    return _raw(PTXAS)


def max_ptx_isa() -> Optional[Tuple[int, int]]:
    """$SPARSECNN_MAX_PTX_ISA ("major.minor", e.g. "9.0"; default None: from the driver): the newest
    PTX ISA the driver accepts, as (major, minor)."""
    override = _raw(MAX_PTX_ISA)
    if not override:
        return None
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", override)
    if match is None:
        raise ValueError(f"{MAX_PTX_ISA.name} must look like 9.0, got {override!r}")
    return int(match.group(1)), int(match.group(2))


def fast_launch() -> bool:
    """$SPARSECNN_FAST_LAUNCH (bool; default True; "0" turns it off, any other value leaves it on):
    whether Triton kernels launch through `core.triton_launch`'s cache. Called per launch, so it only
    looks the variable up."""
    return os.environ.get(FAST_LAUNCH.name, "1").strip() != "0"


def pdl() -> bool:
    """$SPARSECNN_PDL (bool; default True; "0" turns it off, any other value leaves it on): whether
    the tensorcore kernels launch with programmatic dependent launch where the GPU has it. Called
    per launch, so it only looks the variable up."""
    return os.environ.get(PDL.name, "1").strip() != "0"


def unrolled_max_nnz() -> int:
    """$SPARSECNN_UNROLLED_MAX_NNZ (int >= 1; default UNROLLED_MAX_NNZ_DEFAULT, 60000): the most
    non-zeros one layer's unrolled kernel may hold."""
    text = (_raw(UNROLLED_MAX_NNZ) or "").strip()
    if not text:
        return UNROLLED_MAX_NNZ_DEFAULT
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${UNROLLED_MAX_NNZ.name} must be a positive int, got {text!r}")
    return int(text)


def _workers(setting: Setting, share: int = 2) -> int:
    """The setting's worker count; unset: 1 / `share` of the CPUs, 1 to MAX_WORKERS."""
    value = (_raw(setting) or "").strip()
    if not value:
        return max(1, min((os.cpu_count() or 1) // share, MAX_WORKERS))
    if not value.isdigit():
        raise ValueError(f"${setting.name} must be a non-negative int, got {value!r}")
    return int(value)


def blocks_workers() -> int:
    """$SPARSECNN_BLOCKS_WORKERS (int >= 0; default half the CPUs, 1 to 16; 0: none): worker
    processes extracting blocks ahead of tuning."""
    return _workers(BLOCKS_WORKERS)


def compile_workers() -> int:
    """$SPARSECNN_COMPILE_WORKERS (int >= 0; default all the CPUs, 1 to 16; 0: none): worker
    processes compiling codegen, staged and unrolled kernels ahead of tuning, one queue for the
    three (Triton compiles: a pool of their own, `core.triton_ahead.workers`). ValueError when a
    variable it replaced is set."""
    replaced = [name for name in _REPLACED_WORKERS if name in os.environ]
    if replaced:
        raise ValueError(f"${' and $'.join(replaced)} {'is' if len(replaced) == 1 else 'are'} replaced by "
                         f"${COMPILE_WORKERS.name} (one pool compiles codegen, staged and unrolled kernels); "
                         f"set that instead")
    return _workers(COMPILE_WORKERS, share=1)


def dlmc_dir() -> Optional[Path]:
    """$SPARSECNN_DLMC (path; default None: search for shared/data/dlmc-rn50 or .carry/dlmc-rn50):
    the directory holding the DLMC ResNet-50 masks."""
    return _path(DLMC)


def commit() -> Optional[str]:
    """$SPARSECNN_COMMIT (str; default None: ask git): the commit recorded in benchmark rows."""
    return _raw(COMMIT)


def sputnik_lib() -> Optional[Path]:
    """$SPARSECNN_SPUTNIK_LIB (path; default None: the Sputnik peer cannot run): the shared library
    benchmarks/peers/build_sputnik.sh builds, loaded by `bench layers --peers sputnik`."""
    return _path(SPUTNIK_LIB)


def sparsert_compile() -> Optional[Path]:
    """$SPARSECNN_SPARSERT_COMPILE (path; default None: the SparseRT peer cannot run): the
    sparsert_compile.py benchmarks/peers/build_sparsert.sh makes, run by `bench layers --peers sparsert`."""
    return _path(SPARSERT_COMPILE)
