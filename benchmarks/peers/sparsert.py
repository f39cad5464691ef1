"""SparseRT (marsupialtail/gpu-sparsert, MIT; Wang, PACT'20) as a peer of
`sparsecnn bench layers --peers sparsert`: its per-weight generated kernels on our layers, masks and inputs.

SparseRT is a code generator, not a library: for one weight it writes one kernel in which every
non-zero is the immediate of one fma, assembled by ptxas. `sparsert_compile.py` drives it; it is
made outside the repository by `build_sparsert.sh` (SparseRT's code is never committed here) and
found through SPARSECNN_SPARSERT_COMPILE. fp32 only (SparseRT's fp16 code does not assemble with
ptxas 13). Two kinds of layer:

* conv3x3: 3x3, stride 1, padding 1, H == W, N == 1 (SparseRT's convolution generator is of one
  image). The kernel reads the image (C, H, W) and up to W+1 floats before and after it (border
  taps, multiplied by 0), so the image lies in a guarded buffer [W+1 zeros | C*H*W image | W+1
  zeros]; it writes (K, H*W), the (1, K, H, W) output.
* spmm: 1x1, stride 1, no padding, any N: A (K x C) times B (C x N*H*W) row-major, B = x permuted
  to (C, N*H*W) (for N == 1 x itself, no copy), C (K x N*H*W) turned back into (N, K, H, W).

Every kernel is `mm(const float* in, float* out)`, launched on grid (A_blocks, C_blocks, 1) with
blocks of `threads` = columns / C_blocks threads, each block computing K / A_blocks output channels
(one accumulator register each) of its columns. bind compiles a few launches (`launch_candidates`)
in parallel, times each on the real input and keeps the fastest. Two row variants per layer:

* "sparsert": the whole convolution on our contract (NCHW (N, C, H, W) contiguous in, (N, K, P, Q)
  contiguous out): the copy of x into the guarded buffer or its permute into B, the kernel, and the
  permute back for N > 1.
* "sparsert-kernel": the kernel alone on its input prepared ahead (the output a (N, K, P, Q) view
  of its (K, N*P*Q) result): what SparseRT itself computes.

Every buffer, the outputs included, is allocated at bind, filled with NaN so an element the kernel
misses shows; the timed call allocates nothing and returns the same tensor each time. `torch_kernel`
is a pure-torch stand-in for the cubins (what one computes from the weight matrix and its input
buffer), used by the CPU tests of the data path only.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sparsecnn import settings
from sparsecnn.bench.peers import Peer, common_unsupported_reason
from sparsecnn.core.cubin_loader import LazyKernels, missing_loader
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.timing import benchmark

KERNEL = "_Z2mmPKfPf"  # mm(const float* in, float* out), the generated kernel's mangled name
DTYPES = ("fp32",)
VARIANTS = ("sparsert", "sparsert-kernel")
CONV3X3, SPMM = "conv3x3", "spmm"  # sparsert_compile.py's kinds
WEIGHT_EPS = 1e-7  # the generator drops weights with |w| <= this (sparsednn/utils.py EPS)
INT32_MAX = 2**31 - 1
MAX_THREADS = 1024
PREFERRED_THREADS = (64, 256)  # threads per block tried first; 128 the centre
MIN_ROWS, MAX_ROWS, TARGET_ROWS = 4, 64, 16  # output channels per block: one accumulator register each
FILL_BLOCKS = 128  # a grid of fewer thread blocks leaves SMs of an H100 (132) idle
THREAD_CHOICES, ROW_CHOICES = 2, 2  # launch candidates: the best 2 thread counts, each with its best 2 row counts
TUNE_TIMING = dict(warmup_ms=2, rep_ms=10, min_rep=5)  # the brief timing of each launch candidate


# --- layers and launches ----------------------------------------------------------------------------------
def kernel_kind(spec: ConvSpec) -> Optional[str]:
    """CONV3X3 (3x3, stride 1, padding 1), SPMM (1x1, stride 1, no padding) or None (neither)."""
    if spec.stride != (1, 1):
        return None
    if (spec.R, spec.S, spec.padding) == (3, 3, (1, 1)):
        return CONV3X3
    if (spec.R, spec.S, spec.padding) == (1, 1, (0, 0)):
        return SPMM
    return None


def columns(spec: ConvSpec) -> int:
    """The kernel's column count: output pixels of one image (conv3x3, H*W) or of the batch (spmm, N*H*W)."""
    return spec.H * spec.W if kernel_kind(spec) == CONV3X3 else spec.N * spec.H * spec.W


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a SparseRT kernel: grid (a_blocks, c_blocks, 1), block (threads, 1, 1).
    a_blocks divides K (K / a_blocks output channels per block); c_blocks * threads = the columns."""

    a_blocks: int
    c_blocks: int
    threads: int

    @property
    def grid(self) -> Tuple[int, int, int]:
        return self.a_blocks, self.c_blocks, 1

    @property
    def block(self) -> Tuple[int, int, int]:
        return self.threads, 1, 1


def _divisors(n: int) -> List[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def thread_counts(cols: int) -> List[int]:
    """Threads per block for `cols` (> 0) columns, best first: the divisors of cols up to MAX_THREADS,
    those within PREFERRED_THREADS first, then by the idle lanes of their last warp, then nearest 128.
    Less than a warp only when no divisor fills one (e.g. 13 x 13 columns: 169, not 13)."""
    def rank(threads: int) -> Tuple[bool, int, float]:
        low, high = PREFERRED_THREADS
        return not low <= threads <= high, -threads % 32, abs(math.log2(threads / 128))

    counts = [t for t in _divisors(cols) if t <= MAX_THREADS]
    return sorted([t for t in counts if t >= 32] or counts, key=rank)


def rows_per_block(k: int, c_blocks: int = FILL_BLOCKS) -> List[int]:
    """Output channels per block for K = k and c_blocks blocks along the columns, best first: the
    divisors of k within MIN_ROWS..MAX_ROWS, those whose grid of k / rows * c_blocks blocks falls
    least short of FILL_BLOCKS first, then nearest TARGET_ROWS (ties: more rows, fewer blocks
    reloading the input); [k] when there are none and k <= MAX_ROWS; [] when k fits neither (its
    accumulators would not fit the registers)."""
    def rank(rows: int) -> Tuple[float, float, int]:
        shortfall = max(0.0, math.log2(FILL_BLOCKS / (k // rows * c_blocks)))
        return shortfall, abs(math.log2(rows / TARGET_ROWS)), -rows

    rows = [r for r in _divisors(k) if MIN_ROWS <= r <= MAX_ROWS]
    if not rows:
        return [k] if k <= MAX_ROWS else []
    return sorted(rows, key=rank)


def launch_candidates(spec: ConvSpec) -> List[Launch]:
    """The launches bind compiles and times for a supported `spec` (`unsupported_reason` None): for
    each of the best THREAD_CHOICES thread counts, the best ROW_CHOICES row counts with it, best first."""
    cols = columns(spec)
    return [Launch(spec.K // rows, cols // threads, threads) for threads in thread_counts(cols)[:THREAD_CHOICES]
            for rows in rows_per_block(spec.K, cols // threads)[:ROW_CHOICES]]


def unsupported_reason(spec: ConvSpec, dtype: str, device_type: str, compiled: bool = True) -> Optional[str]:
    """Why SparseRT cannot run this layer at dtype name `dtype`, None if it can. compiled: whether
    its cubins run it (else the torch stand-in, which runs on any device)."""
    reason = common_unsupported_reason("SparseRT", DTYPES, spec, dtype, device_type, compiled,
                                       dtype_note="its fp16 code does not assemble with ptxas 13")
    if reason:
        return reason
    kind = kernel_kind(spec)
    if kind is None:
        return (f"SparseRT generates 3x3 stride-1 padding-1 and 1x1 stride-1 unpadded convolutions, not "
                f"{spec.R}x{spec.S} stride {spec.stride} padding {spec.padding}")
    if kind == CONV3X3 and spec.H != spec.W:
        return f"SparseRT's 3x3 kernels take square images, got H={spec.H}, W={spec.W}"
    if kind == CONV3X3 and spec.N != 1:
        return f"SparseRT's 3x3 generator convolves one image (batch 1), got N={spec.N}"
    if spec.N == 0:
        return "N = 0: a SparseRT kernel is compiled for a fixed number of columns N*H*W > 0"
    if not rows_per_block(spec.K):
        return (f"K={spec.K} has no divisor in {MIN_ROWS}..{MAX_ROWS} output channels per thread block and is "
                f"over {MAX_ROWS} (SparseRT keeps one accumulator register per channel)")
    if max(spec.C, spec.K) * columns(spec) * 4 > INT32_MAX:
        return "SparseRT's 32-bit offsets into its input (byte immediates) or output (int indices) would overflow"
    return None


# --- the kernel's operands ------------------------------------------------------------------------------
def weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(K, C, R, S) -> (K, C*R*S), columns in (c, r, s) order: the matrix sparsert_compile.py takes."""
    return weight.reshape(weight.shape[0], -1)


def guard_floats(spec: ConvSpec) -> int:
    """Floats the conv3x3 kernel may read before and after the image: a border tap of the first
    (last) pixel reaches one row and one column out (W + 1)."""
    return spec.W + 1


def guarded_buffer(spec: ConvSpec, dtype: torch.dtype, device: torch.device | str, guard: float = 0.0) -> torch.Tensor:
    """(C*H*W + 2*guard_floats,) of `dtype` on `device`, every element `guard` (finite: border taps
    read it and multiply it by 0); the image goes in its middle (`guarded_image`)."""
    return torch.full((spec.C * spec.H * spec.W + 2 * guard_floats(spec),), guard, dtype=dtype, device=device)


def guarded_image(buffer: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """The (1, C, H, W) view of the image inside `buffer` (`guarded_buffer`), where the kernel's
    input pointer points."""
    start = guard_floats(spec)
    return buffer[start:start + spec.C * spec.H * spec.W].view(1, spec.C, spec.H, spec.W)


@dataclasses.dataclass
class Operands:
    """One layer's kernel operands, allocated once.

    data: what the kernel reads, conv3x3 the guarded buffer (`guarded_buffer`), spmm B (C, N*H*W)
    row-major (for N == 1 a view of x itself); out: (K, columns) what it writes, NaN until written.
    """

    spec: ConvSpec
    kind: str
    data: torch.Tensor
    out: torch.Tensor

    def input(self) -> torch.Tensor:
        """The tensor at the kernel's input pointer: the guarded image (conv3x3) or B (spmm)."""
        return guarded_image(self.data, self.spec) if self.kind == CONV3X3 else self.data

    def load(self, x: torch.Tensor) -> None:
        """Put x (N, C, H, W) contiguous, the tensor the operands were made from, where the kernel
        reads it (for spmm at N == 1 it is there already)."""
        spec = self.spec
        if self.kind == CONV3X3:
            guarded_image(self.data, spec).copy_(x)
        elif spec.N > 1:
            self.data.view(spec.C, spec.N, -1).copy_(x.view(spec.N, spec.C, -1).transpose(0, 1))

    def output(self) -> torch.Tensor:
        """The (N, K, P, Q) view of `out` (contiguous for N == 1)."""
        spec = self.spec
        return self.out.view(spec.K, spec.N, spec.P, spec.Q).transpose(0, 1)


def make_operands(x: torch.Tensor, spec: ConvSpec, guard: float = 0.0) -> Operands:
    """The operands of a supported layer, x (N, C, H, W) contiguous loaded, on x's device in its dtype.
    guard: the value of the conv3x3 buffer's guard floats (finite)."""
    kind = kernel_kind(spec)
    if kind == CONV3X3:
        data = guarded_buffer(spec, x.dtype, x.device, guard)
    elif spec.N == 1:
        data = x.view(spec.C, spec.H * spec.W)
    else:
        data = torch.empty(spec.C, columns(spec), dtype=x.dtype, device=x.device)
    operands = Operands(spec, kind, data, torch.full((spec.K, columns(spec)), math.nan, dtype=x.dtype,
                                                     device=x.device))
    operands.load(x)
    return operands


def torch_kernel(kind: str, matrix: torch.Tensor, data: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """Stand-in for a cubin (CPU tests only): its output (K, columns) in data's dtype, from the weight
    matrix (K, C*R*S) and `data` as `Operands.data`. conv3x3 reads every tap where the kernel does,
    guards and neighbouring rows included, and multiplies the border ones by 0, as its predicates do."""
    matrix = torch.where(matrix.abs() > WEIGHT_EPS, matrix, 0).to(data.dtype)
    if kind == SPMM:
        return matrix @ data
    h, w = spec.H, spec.W
    device = data.device
    pixel = torch.arange(h * w, device=device)
    tap = torch.arange(spec.C * 9, device=device)[:, None]  # (c, r, s) = (tap // 9, tap // 3 % 3, tap % 3)
    row, col = pixel // w + tap // 3 % 3 - 1, pixel % w + tap % 3 - 1  # (C*9, H*W) each
    address = guard_floats(spec) + tap // 9 * h * w + row * w + col
    inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
    return matrix @ (data[address] * inside.to(data.dtype))


# --- choosing a launch ------------------------------------------------------------------------------------
Runner = Callable[[Operands], Callable[[], object]]  # operands -> the call that fills operands.out
Build = Callable[[torch.Tensor, ConvSpec, Sequence[Launch]], Dict[Launch, Runner]]


def torch_build(matrix: torch.Tensor, spec: ConvSpec, launches: Sequence[Launch]) -> Dict[Launch, Runner]:
    """Stand-in for the compiler (CPU tests only): each launch runs `torch_kernel`."""
    def runner(operands: Operands) -> Callable[[], object]:
        return lambda: operands.out.copy_(torch_kernel(operands.kind, matrix, operands.data, operands.spec))

    return {launch: runner for launch in launches}


def fastest(calls: Dict[Launch, Callable[[], object]], device: torch.device) -> Tuple[Launch, Dict[Launch, float]]:
    """The launch whose call is fastest (median ms, TUNE_TIMING, CUDA events on CUDA), and every time."""
    times = {launch: benchmark(call, device, hide_launch=device.type == "cuda", **TUNE_TIMING)["median_ms"]
             for launch, call in calls.items()}
    return min(times, key=times.get), times


@dataclasses.dataclass(frozen=True)
class Choice:
    """The launch chosen for one weight: its runner, and the median ms of every candidate."""

    launch: Launch
    runner: Runner
    times: Dict[Launch, float]


class Tuner:
    """Builds the launch candidates of a weight, times them on its operands and keeps the fastest.
    Remembers the last weight's choice: the two variants bind one layer's weight in turn."""

    def __init__(self, build: Build):
        self._build = build
        self._last: Optional[Tuple[tuple, Choice]] = None

    def choose(self, matrix: torch.Tensor, operands: Operands) -> Choice:
        """The choice for weight matrix (K, C*R*S) float32, timed on `operands` if not remembered."""
        key = (operands.spec, hashlib.sha256(matrix.detach().cpu().numpy().tobytes()).hexdigest())
        if self._last is None or self._last[0] != key:
            runners = self._build(matrix, operands.spec, launch_candidates(operands.spec))
            launch, times = fastest({launch: runner(operands) for launch, runner in runners.items()},
                                    operands.out.device)
            self._last = (key, Choice(launch, runners[launch], times))
        return self._last[1]


# --- the compiler -----------------------------------------------------------------------------------------
class SparseRTCompiler:
    """sparsert_compile.py (`script`) run as a subprocess: `build` compiles a weight's launches in
    parallel into cubins, loaded with our cubin loader. commit, arch, nvcc: from the build's stamp."""

    def __init__(self, script: Path):
        self.script = Path(script)
        self.commit, self.arch, self.nvcc = build_stamp(self.script)

    def compile(self, weight_file: Path, spec: ConvSpec, launch: Launch, out: Path) -> bytes:
        """The cubin of the weight matrix in `weight_file` (.npy, (K, C*R*S) float32) for `launch`;
        RuntimeError carrying the script's stderr when it fails."""
        kind = kernel_kind(spec)
        size = spec.H if kind == CONV3X3 else columns(spec)  # the script's --cols: H (square) or N
        command = [sys.executable, str(self.script), kind, str(weight_file), "--cols", str(size),
                   "--A_blocks", str(launch.a_blocks), "--C_blocks", str(launch.c_blocks), "-o", str(out)]
        run = subprocess.run(command, check=False, capture_output=True, text=True)
        what = f"{self.script.name} {kind} K={spec.K} C={spec.C} cols={columns(spec)} {launch}"
        if run.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {run.returncode}):\n{run.stderr.strip() or run.stdout.strip()}")
        printed = json.loads(run.stdout.strip().splitlines()[-1])
        if (printed["kernel"], tuple(printed["grid"]), tuple(printed["block"])) != (KERNEL, launch.grid, launch.block):
            raise RuntimeError(f"{what} printed launch {printed}, expected {KERNEL} grid {launch.grid} "
                               f"block {launch.block}")
        return out.read_bytes()

    def build(self, matrix: torch.Tensor, spec: ConvSpec, launches: Sequence[Launch]) -> Dict[Launch, Runner]:
        """A runner per launch: its cubin compiled (in parallel, one process each) and launched on torch's stream."""
        with tempfile.TemporaryDirectory(prefix="sparsert-") as tmp:
            weight_file = Path(tmp) / "weight.npy"
            np.save(weight_file, matrix.detach().to("cpu", torch.float32).numpy())
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(launches), os.cpu_count() or 1)) as pool:
                cubins = list(pool.map(lambda i: self.compile(weight_file, spec, launches[i], Path(tmp) / f"{i}.cubin"),
                                       range(len(launches))))
        return {launch: cubin_runner(LazyKernels([cubin], KERNEL), launch) for launch, cubin in zip(launches, cubins)}


def cubin_runner(kernels: LazyKernels, launch: Launch) -> Runner:
    """The runner that launches `kernels` (of one cubin) with `launch` on torch's current stream of
    the operands' device."""
    def runner(operands: Operands) -> Callable[[], object]:
        device = operands.out.device
        with torch.cuda.device(device):
            kernel = kernels.kernels(device.index)[0]
        pointers = (operands.input().data_ptr(), operands.out.data_ptr())

        def run() -> None:
            with torch.cuda.device(device):
                kernel.launch(launch.grid, launch.block, pointers, (), torch.cuda.current_stream(device).cuda_stream)

        return run

    return runner


# --- the peer ---------------------------------------------------------------------------------------------
def make_peer(build: Build, commit: str = "", arch: str = "") -> Peer:
    """The Peer whose variants run the kernels `build` makes (a SparseRTCompiler's build, or
    torch_build in CPU tests). commit, arch: SparseRT's commit and the sm_ it was built for."""
    compiled = build is not torch_build
    tuner = Tuner(build)
    chosen: Dict[Tuple[str, ConvSpec, str], Choice] = {}  # the launch of each bound (variant, spec, dtype)

    def config(variant: str, spec: ConvSpec, dtype: str) -> dict:
        kind = kernel_kind(spec)
        row = {"part": "conv" if variant == "sparsert" else "kernel", "kind": kind,
               "input": "guarded copy" if kind == CONV3X3 else "as is" if spec.N == 1 else "permute",
               "a_blocks": None, "c_blocks": None, "threads": None, "candidates": None,
               "sparsert": commit or None, "arch": arch or None}
        choice = chosen.get((variant, spec, dtype))  # None until bound
        if choice is not None:
            row.update(dataclasses.asdict(choice.launch),
                       candidates=[[*dataclasses.astuple(launch), ms] for launch, ms in choice.times.items()])
        return row

    def bind(variant: str, weight: torch.Tensor, x: torch.Tensor, spec: ConvSpec,
             dtype: str) -> Callable[[], torch.Tensor]:
        operands = make_operands(x, spec)
        choice = tuner.choose(weight_matrix(weight), operands)
        chosen[(variant, spec, dtype)] = choice
        kernel = choice.runner(operands)
        # N == 1: out is the (1, K, P, Q) output itself; N > 1: permuted into `result`.
        result = torch.full(spec.output_shape, math.nan, dtype=x.dtype, device=x.device) if spec.N > 1 else None

        def kernel_alone() -> torch.Tensor:
            kernel()
            return operands.output()

        def convolution() -> torch.Tensor:
            operands.load(x)
            kernel()
            return operands.output() if result is None else result.copy_(operands.output())

        return kernel_alone if variant == "sparsert-kernel" else convolution

    return Peer(name="sparsert", variants=VARIANTS, dtypes=DTYPES,
                unsupported_reason=lambda spec, dtype, device: unsupported_reason(spec, dtype, device, compiled),
                config=config, bind=bind)


BUILD = "make it with benchmarks/peers/build_sparsert.sh (nvcc, ptxas, SparseRT's source) and point " \
        f"{settings.SPARSERT_COMPILE.name} at the sparsert_compile.py it prints"


def compile_script(path: Optional[Path] = None) -> Path:
    """`path`, else $SPARSECNN_SPARSERT_COMPILE; FileNotFoundError saying how to make it if neither."""
    path = path or settings.sparsert_compile()
    if path is None:
        raise FileNotFoundError(f"{settings.SPARSERT_COMPILE.name} is not set: {BUILD}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{settings.SPARSERT_COMPILE.name}={path}: no such file: {BUILD}")
    return Path(path)


def build_stamp(script: Path) -> Tuple[str, str, str]:
    """(SparseRT commit, "sm_<arch>", nvcc path) from the stamp build_sparsert.sh leaves beside
    `script` ("COMMIT ARCH NVCC"); FileNotFoundError when it is missing or malformed."""
    stamp = script.parent / ".stamp"
    fields = stamp.read_text().split() if stamp.is_file() else []
    if len(fields) != 3:
        raise FileNotFoundError(f"{script}: no build stamp {stamp} (\"COMMIT ARCH NVCC\"), not made by "
                                f"build_sparsert.sh: {BUILD}")
    commit, arch, nvcc = fields
    return commit, f"sm_{arch}", nvcc


def load_peer(path: Optional[Path] = None) -> Peer:
    """The SparseRT peer on the built generator (`path`, else $SPARSECNN_SPARSERT_COMPILE)."""
    compiler = SparseRTCompiler(compile_script(path))
    if not os.access(compiler.nvcc, os.X_OK):  # the generator runs the nvcc it was built with
        raise FileNotFoundError(f"{compiler.script} was built with {compiler.nvcc}, which this machine lacks: "
                                f"rebuild it here: {BUILD}")
    missing = missing_loader()
    if missing is not None:
        raise FileNotFoundError(f"the SparseRT peer loads cubins: {missing}")
    return make_peer(compiler.build, compiler.commit, compiler.arch)
