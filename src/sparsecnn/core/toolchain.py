"""nvcc / ptxas: discovery, PTX ISA check, compilation to PTX and cubin, and the on-disk cache.

Only the CUDA toolkit's own nvcc and ptxas are used (never a pip NVRTC: NVRTC 13.5 emits PTX ISA
9.5, which a CUDA 13.0 driver refuses): the system's, or where it has none, those of NVIDIA's pip
wheel nvidia-cuda-nvcc pinned to 13.0 (requirements-cuda-tools.txt). Every PTX we make is checked
against the newest ISA the driver accepts before it goes further.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional, Tuple

import sparsecnn.settings as settings
from sparsecnn.core import device

ARCH = device.DEFAULT_ARCH  # the default target without a GPU: sm_90 / compute_90 (H100, H200)
# Oldest PTX ISA that can target each arch (PTX ISA release notes): the driver must accept it.
MIN_PTX_ISA = {"80": (7, 0), "86": (7, 1), "87": (7, 4), "89": (7, 8), "90": (7, 8)}
# IEEE fp32 (no flush-to-zero, exact division) so emitted code matches the reference; the kernels
# call __fmaf_rn explicitly, -fmad=true only lets nvcc keep them fused.
NVCC_FLAGS = ("-O3", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-fmad=true")
PTXAS_FLAGS = ("-O3", "-v")
SEARCH_DIRS = ("/usr/local/cuda/bin", "/usr/local/bin")
# Last resort, NVIDIA's pip wheels in the running interpreter's environment, by CUDA major version:
# nvidia-cuda-nvcc 13.x puts nvcc and ptxas in nvidia/cu13/bin, nvidia-cuda-nvcc-cu12 (ptxas only)
# in nvidia/cuda_nvcc/bin.
WHEEL_BIN_DIRS = {13: "cu13/bin", 12: "cuda_nvcc/bin"}
_TOOL_SETTINGS = {"nvcc": settings.nvcc, "ptxas": settings.ptxas}  # $SPARSECNN_NVCC, $SPARSECNN_PTXAS
DEFAULT_MAX_PTX_ISA = (9, 0)  # CUDA 13.0 drivers (R580): assume this when no driver is present
# Newest PTX ISA each CUDA driver version accepts (the ISA its toolkit's nvcc emits).
_DRIVER_PTX_ISA = {
    (12, 0): (8, 0), (12, 1): (8, 1), (12, 2): (8, 2), (12, 3): (8, 3), (12, 4): (8, 4), (12, 5): (8, 5),
    (12, 6): (8, 5), (12, 8): (8, 7), (12, 9): (8, 8), (13, 0): (9, 0), (13, 1): (9, 1),
}
COMPILE_TIMEOUT_S = 900
CACHE_STATS: collections.Counter = collections.Counter()  # "hit" / "miss" / "write" / "corrupt", for reports and tests


class ToolchainError(RuntimeError):
    """A tool is missing, failed, or produced something the driver would refuse."""


@dataclasses.dataclass(frozen=True)
class PtxasInfo:
    """What `ptxas -v` says about the one kernel of a cubin."""

    registers: int
    spill_stores: int
    spill_loads: int
    smem_bytes: int

    @classmethod
    def parse(cls, text: str) -> "PtxasInfo":
        def number(pattern: str) -> int:
            match = re.search(pattern, text)
            return int(match.group(1)) if match else 0

        return cls(number(r"Used (\d+) registers"), number(r"(\d+) bytes spill stores"),
                   number(r"(\d+) bytes spill loads"), number(r"(\d+) bytes smem"))


def torch_cuda_major() -> Optional[int]:
    """The CUDA major version the installed torch was built with (`torch.version.cuda`; no CUDA
    call), None for a CPU-only build."""
    import torch

    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


def wheel_bin_dirs() -> list:
    """The bin folders NVIDIA's pip wheels would put nvcc / ptxas in (WHEEL_BIN_DIRS under each
    folder of the `nvidia` namespace package), whether or not they exist: only the wheel of the CUDA
    major version torch was built with (a cubin of another major's ptxas need not load under the
    driver torch runs on), every one for a CPU-only torch (compile checks)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    major = torch_cuda_major()
    subs = [WHEEL_BIN_DIRS[major]] if major in WHEEL_BIN_DIRS else [] if major else list(WHEEL_BIN_DIRS.values())
    return [os.path.join(root, sub) for root in roots for sub in subs]


def find_tool(name: str) -> Optional[str]:
    """Path of `name` (nvcc, ptxas): $SPARSECNN_<NAME>, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin,
    /usr/local/bin, NVIDIA's pip wheel (`wheel_bin_dirs`); None if absent."""
    explicit = _TOOL_SETTINGS[name]() if name in _TOOL_SETTINGS else None
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    dirs = ([os.path.join(os.environ["CUDA_HOME"], "bin")] if os.environ.get("CUDA_HOME") else []) + list(SEARCH_DIRS)
    dirs += wheel_bin_dirs()
    for directory in dirs:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    return None


def missing_tools(*names: str) -> Optional[str]:
    """None when `find_tool` finds every tool of `names` (e.g. "nvcc", "ptxas"), else a sentence
    naming the missing ones, where they were looked for and how to get them."""
    absent = [name for name in names if find_tool(name) is None]
    if not absent:
        return None
    return (f"no {' or '.join(absent)} found (looked at $SPARSECNN_NVCC/$SPARSECNN_PTXAS, PATH, $CUDA_HOME/bin, "
            f"{', '.join(SEARCH_DIRS)}, NVIDIA's pip wheel): install the CUDA toolkit or `pip install \"sparsecnn[gpu]\"`")


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise ToolchainError(f"{name} not found (looked at $SPARSECNN_{name.upper()}, PATH, $CUDA_HOME/bin, "
                             f"{', '.join(SEARCH_DIRS)}, NVIDIA's pip wheel); install the CUDA toolkit, or "
                             f"`pip install -r requirements-cuda-tools.txt` (nvidia-cuda-nvcc 13.0)")
    return path


@functools.lru_cache(maxsize=None)
def tool_version(path: str) -> str:
    """`release X.Y, VX.Y.Z` of a CUDA tool (part of every cache key)."""
    result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    match = re.search(r"release \d+\.\d+, V[\d.]+", result.stdout)
    if result.returncode or match is None:
        raise ToolchainError(f"{path} --version failed: {result.stdout[-300:]}{result.stderr[-300:]}")
    return match.group(0)


@functools.lru_cache(maxsize=None)
def driver_cuda_version() -> Optional[Tuple[int, int]]:
    """CUDA version of the installed driver (cuDriverGetVersion: no context, no cuInit), or None."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return version.value // 1000, (version.value % 1000) // 10


def max_ptx_isa() -> Tuple[int, int]:
    """Newest PTX ISA the driver accepts: $SPARSECNN_MAX_PTX_ISA ("9.0"), else from the driver
    version, else 9.0 (no driver here: the GPU machines run CUDA 13.0 drivers)."""
    try:
        override = settings.max_ptx_isa()
    except ValueError as error:
        raise ToolchainError(str(error)) from error
    if override is not None:
        return override
    driver = driver_cuda_version()
    if driver is None:
        return DEFAULT_MAX_PTX_ISA
    known = [version for version in _DRIVER_PTX_ISA if version <= driver]
    return _DRIVER_PTX_ISA[max(known)] if known else (0, 0)


def ptx_isa(ptx: str) -> Tuple[int, int]:
    match = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.MULTILINE)
    if match is None:
        raise ToolchainError("PTX has no .version directive")
    return int(match.group(1)), int(match.group(2))


def check_ptx_isa(ptx: str, limit: Optional[Tuple[int, int]] = None) -> None:
    """ToolchainError if the PTX's ISA is newer than `limit` (default: `max_ptx_isa()`)."""
    limit = max_ptx_isa() if limit is None else limit
    version = ptx_isa(ptx)
    if version > limit:
        raise ToolchainError(f"PTX ISA {version[0]}.{version[1]} is newer than {limit[0]}.{limit[1]}, the newest "
                             "the CUDA driver accepts: use the nvcc of a CUDA toolkit no newer than the driver "
                             "(or set SPARSECNN_MAX_PTX_ISA if the driver is newer than detected)")


def target_arch(arch=None) -> str:
    """The arch to compile for: `arch` ("86", "sm_86", DeviceProperties) or the current device's
    (`device.current_arch()`: "90" without a GPU). ToolchainError if below sm_80 or if the driver's
    newest PTX ISA is older than the arch needs."""
    arch = device.current_arch() if arch is None else (
        arch.arch if isinstance(arch, device.DeviceProperties) else device.normalize_arch(arch))
    if not arch.isdigit() or int(arch) < 80:
        raise ToolchainError(f"cannot target sm_{arch}: the generated kernels need sm_80 or newer")
    needed, limit = MIN_PTX_ISA.get(arch, (7, 8)), max_ptx_isa()
    if needed > limit:
        raise ToolchainError(f"sm_{arch} needs PTX ISA {needed[0]}.{needed[1]}, newer than {limit[0]}.{limit[1]} "
                             "the CUDA driver accepts: update the driver")
    return arch


def _run(command, what: str) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise ToolchainError(f"{what} timed out after {COMPILE_TIMEOUT_S} s") from exc
    if result.returncode:
        raise ToolchainError(f"{what} failed ({result.returncode}): {(result.stderr or result.stdout)[-2000:]}")
    return result


def nvcc_ptx(source: str, arch=None) -> Tuple[str, float]:
    """CUDA C -> PTX for compute_<arch> (`target_arch(arch)`; ISA-checked); returns (ptx, seconds)."""
    arch = target_arch(arch)
    nvcc = require_tool("nvcc")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparsecnn-nvcc-") as tmp:
        src, out = Path(tmp, "kernel.cu"), Path(tmp, "kernel.ptx")
        src.write_text(source)
        _run([nvcc, "-ptx", f"-arch=compute_{arch}", *NVCC_FLAGS, str(src), "-o", str(out)], "nvcc -ptx")
        ptx = out.read_text()
    check_ptx_isa(ptx)
    return ptx, time.perf_counter() - start


def ptxas_cubin(ptx: str, arch=None) -> Tuple[bytes, PtxasInfo, float]:
    """PTX -> sm_<arch> cubin (`target_arch(arch)`); returns (cubin, registers/spills, seconds)."""
    arch = target_arch(arch)
    check_ptx_isa(ptx)
    ptxas = require_tool("ptxas")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparsecnn-ptxas-") as tmp:
        src, out = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        src.write_text(ptx)
        result = _run([ptxas, f"-arch=sm_{arch}", *PTXAS_FLAGS, str(src), "-o", str(out)], "ptxas")
        cubin = out.read_bytes()
    return cubin, PtxasInfo.parse(result.stdout + result.stderr), time.perf_counter() - start


def toolchain_id(arch=None) -> str:
    """Versions and flags of both tools and the target arch (`target_arch(arch)`): part of every
    cache key, so a key changes with the toolkit and the arch (sm_90 keys are as before)."""
    arch = target_arch(arch)
    return (f"nvcc {tool_version(require_tool('nvcc'))} {' '.join(NVCC_FLAGS)} | "
            f"ptxas {tool_version(require_tool('ptxas'))} {' '.join(PTXAS_FLAGS)} | sm_{arch}")


def cache_root() -> Path:
    """$SPARSECNN_CACHE, else ~/.cache/sparsecnn/codegen."""
    return settings.codegen_cache_dir()


def cache_key(*parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


_ENTRY_MAGIC = b"sparsecnn-cache-entry-v1\n"
_DIGEST_BYTES = 32  # sha256


def encode_entry(data: bytes) -> bytes:
    """A cache file's bytes: a magic line, the sha256 of `data`, then `data`."""
    return _ENTRY_MAGIC + hashlib.sha256(data).digest() + data


def decode_entry(raw: bytes) -> Optional[bytes]:
    """The data of a cache file's bytes, or None when they are not an intact entry (truncated,
    damaged, or a file this cache did not write)."""
    head = len(_ENTRY_MAGIC) + _DIGEST_BYTES
    if len(raw) < head or not raw.startswith(_ENTRY_MAGIC):
        return None
    data = raw[head:]
    return data if hashlib.sha256(data).digest() == raw[len(_ENTRY_MAGIC):head] else None


class DiskCache:
    """Files named by key under `root` (default `cache_root()`); writes are atomic (temp + rename),
    so concurrent compiles of the same key are harmless, and `exclusive(key)` lets processes that
    need the same file wait for one of them to make it rather than all compile it. Each file
    carries the sha256 of its data (`encode_entry`): a truncated or foreign file is a miss, removed
    with a warning (once per process), and the caller compiles again."""

    _warned = False

    def __init__(self, root: Optional[Path] = None):
        self.root = cache_root() if root is None else Path(root)

    def path(self, key: str, suffix: str) -> Path:
        return self.root / key[:2] / f"{key}.{suffix}"

    def get(self, key: str, suffix: str) -> Optional[bytes]:
        path = self.path(key, suffix)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            CACHE_STATS["miss"] += 1
            return None
        data = decode_entry(raw)
        if data is None:
            self._discard(path)
            CACHE_STATS["miss"] += 1
            return None
        CACHE_STATS["hit"] += 1
        return data

    @classmethod
    def _discard(cls, path: Path) -> None:
        CACHE_STATS["corrupt"] += 1
        if not cls._warned:
            cls._warned = True
            warnings.warn(f"compiled-kernel cache file {path} is truncated, damaged or not written by this "
                          "version of sparsecnn: removed, compiling again (later such files are replaced "
                          "without a warning)", RuntimeWarning, stacklevel=3)
        with contextlib.suppress(OSError):
            path.unlink()

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]:
        """Hold an advisory lock on `key` (fcntl.flock on a lock file; released when the block
        exits or the process dies), one holder at a time across processes."""
        path = self.path(key, "lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def put(self, key: str, suffix: str, data: bytes) -> None:
        path = self.path(key, suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(encode_entry(data))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        CACHE_STATS["write"] += 1
