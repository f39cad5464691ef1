"""CUDA C for the direct-convolution template of paper 002 (Algorithm 1), fp32 NCHW.

Work split. One kernel ("slice") computes `slice_k` output channels, split into `groups` of `bk`.
A block computes a (ty*bh) x (tx*bw) tile of output pixels for `bn` images and one group of `bk`
channels; each thread computes bn x bh x bw x bk outputs: `bh` consecutive rows (their input
windows overlap, so each input is loaded once for all of them) and `bw` columns `tx` apart, so
adjacent threads own adjacent pixels (conflict-free shared loads, coalesced stores).

Input reuse. The block's input tile (with halo, zeros outside the image: padding is applied while
staging) is staged in shared memory `chunk_c` channels at a time, double-buffered: the next chunk's
global loads are issued into registers before the current chunk's FMAs and stored after them, so
one barrier per chunk. Per channel a thread loads its ((bh-1)*sh + R) x bw x S window into
registers once and multiplies it by every weight of its `bk` channels: all loops over
(k, c, r, s) are unrolled in the source, each weight is a literal float (an FMA immediate in SASS),
and no index is ever loaded.

Groups of one tile have consecutive block ids (group index fastest), so they run together and read
the tile from DRAM once. Every register of the unrolled body is defined once, so the PTX is in the
SSA form Algorithm 2 relies on: the group switch is the outermost statement (block-uniform, so its
barriers are legal) and no value flows from one case into another.

Two sources come out of one plan:
  template (weights=None): every (k, c, r, s) x (image, row, column) FMA has its own placeholder
    weight, a distinct non-zero float (`placeholder_bits`) the rewrite maps back to the slot;
  emit (weights given): only the non-zero terms, with the real values.
Both keep the same FMA order per accumulator, so they compute bit-identical results.

Kernel signature (both): (const float* x (N, C, H, W), const float* bias (K,) or unused,
float* y (N, K, P, Q), int n_batch, int k0 (first channel of the slice), int reverse (walk the
blocks backwards, so a slice starts on the tiles the previous slice left in L2)).
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Iterator, List, Optional, Tuple

import numpy as np

from ...layers import ConvSpec
from ..configs import config_from_dict

KERNEL_NAME = "sparsecnn_codegen_conv"
MODES = ("rewrite", "emit")
SMEM_BYTES_MAX = 48 * 1024  # static shared memory per block
MAX_STAGE_REGS = 32  # prefetch registers per thread for one chunk (on top of the accumulators)
MAX_ACCUMULATORS = 128  # bn*bh*bw*bk per thread; beyond this the accumulators alone spill
DEFAULT_MAX_KERNEL_FMAS = 40_000  # template FMAs per kernel: bounds nvcc time per slice (~10 s)
TARGET_BLOCKS = 264  # two blocks per SM of an H100/H200 (132 SMs)
MAX_BLOCKS_BOUND = 8  # largest __launch_bounds__ min-blocks the defaults ask for
# Placeholders are 2^37 * (1 + m / 2^23): huge, positive, never 0 and never a constant the compiler
# makes up (those are 0, +-1, small integers, infinities), one mantissa value per FMA slot.
PLACEHOLDER_BASE = 0x52000001
MAX_PLACEHOLDERS = 1 << 23


@dataclasses.dataclass(frozen=True)
class CodegenConfig:
    """Tiling of the generated kernel. Validated on construction (ValueError names the field).

    bh, bw, bn, bk: output rows, columns, images and channels per thread;
    tx, ty: threads per block along output columns and rows (tx * ty a multiple of 32);
    chunk_c: input channels per shared-memory stage (0: as many as fit);
    slice_k: output channels per kernel, a multiple of bk (0: as many as the unroll cap allows);
    min_blocks: blocks per SM ptxas must fit in registers (__launch_bounds__; 0: no bound);
    mode: "rewrite" (PTX template + Algorithm 2) or "emit" (CUDA C with only the non-zero terms).
    """

    bh: int = 2
    bw: int = 1
    bn: int = 1
    bk: int = 32
    tx: int = 32
    ty: int = 4
    chunk_c: int = 0
    slice_k: int = 0
    min_blocks: int = 0
    mode: str = "rewrite"

    def __post_init__(self):
        for name in ("bh", "bw", "bn", "bk", "tx", "ty"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CodegenConfig.{name} must be a positive int, got {value!r}")
        for name in ("chunk_c", "slice_k", "min_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CodegenConfig.{name} must be an int >= 0, got {value!r}")
        threads = self.tx * self.ty
        if threads % 32 or threads > 1024:
            raise ValueError(f"CodegenConfig.tx * ty must be a multiple of 32 and <= 1024, got {threads}")
        if self.accumulators > MAX_ACCUMULATORS:
            raise ValueError(f"CodegenConfig.bk: bn*bh*bw*bk = {self.accumulators} accumulators per thread "
                             f"exceeds {MAX_ACCUMULATORS}")
        if self.slice_k % self.bk:
            raise ValueError(f"CodegenConfig.slice_k={self.slice_k} must be a multiple of bk={self.bk}")
        if self.mode not in MODES:
            raise ValueError(f"CodegenConfig.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def accumulators(self) -> int:
        return self.bn * self.bh * self.bw * self.bk

    @classmethod
    def from_dict(cls, saved: dict) -> "CodegenConfig":
        """Rebuild from `dataclasses.asdict` output (unknown keys are an error)."""
        return config_from_dict(cls, saved)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One layer shape (any batch) + config resolved into the numbers the generator uses."""

    spec: ConvSpec
    config: CodegenConfig
    relu: bool
    has_bias: bool
    slice_k: int
    chunk_c: int
    stage_slots: int  # staged plane positions per thread

    @property
    def n_slices(self) -> int:
        return -(-self.spec.K // self.slice_k)

    @property
    def groups(self) -> int:
        return self.slice_k // self.config.bk

    @property
    def threads(self) -> int:
        return self.config.tx * self.config.ty

    @property
    def tile(self) -> Tuple[int, int]:
        """Output rows and columns of one block."""
        return self.config.ty * self.config.bh, self.config.tx * self.config.bw

    @property
    def tiles(self) -> Tuple[int, int]:
        (tp, tq), spec = self.tile, self.spec
        return -(-spec.P // tp), -(-spec.Q // tq)

    @property
    def in_tile(self) -> Tuple[int, int]:
        """Input rows and columns (with halo) staged for one block."""
        (tp, tq), spec = self.tile, self.spec
        return (tp - 1) * spec.stride[0] + spec.R, (tq - 1) * spec.stride[1] + spec.S

    @property
    def plane(self) -> int:
        in_h, in_w = self.in_tile
        return in_h * in_w

    @property
    def chunks(self) -> List[Tuple[int, int]]:
        """[c_begin, c_end) of each shared-memory stage."""
        return [(c, min(c + self.chunk_c, self.spec.C)) for c in range(0, self.spec.C, self.chunk_c)]

    @property
    def buffer_floats(self) -> int:
        return self.config.bn * self.chunk_c * self.plane

    @property
    def smem_bytes(self) -> int:
        return 4 * self.buffer_floats * (2 if len(self.chunks) > 1 else 1)

    @property
    def pixels(self) -> int:
        """Outputs per thread per channel."""
        return self.config.bn * self.config.bh * self.config.bw

    @property
    def template_fmas(self) -> int:
        """FMAs of one kernel's unrolled template (all threads run the same count)."""
        spec = self.spec
        return self.slice_k * spec.C * spec.R * spec.S * self.pixels

    def grid(self, n_batch: int) -> Tuple[int, int, int]:
        tiles_p, tiles_q = self.tiles
        return tiles_p * tiles_q * self.groups, -(-n_batch // self.config.bn), 1

    def block(self) -> Tuple[int, int, int]:
        return self.config.tx, self.config.ty, 1


def make_plan(spec: ConvSpec, config: CodegenConfig, relu: bool = False, has_bias: bool = True,
              max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS) -> KernelPlan:
    """Resolve `slice_k` and `chunk_c` for `spec` (groups 1, dilation 1); ValueError if it cannot fit."""
    if spec.groups != 1 or spec.dilation != (1, 1):
        raise ValueError(f"codegen needs groups=1 and dilation=1, got groups={spec.groups}, "
                         f"dilation={spec.dilation}")
    per_channel = spec.C * spec.R * spec.S * config.bn * config.bh * config.bw
    slice_k = config.slice_k or _auto_slice_k(spec.K, config.bk, per_channel, max_kernel_fmas)
    probe = KernelPlan(spec, config, relu, has_bias, slice_k, 1, 0)
    stage_slots = -(-probe.plane // probe.threads)
    chunk_c = config.chunk_c or _auto_chunk_c(spec.C, config.bn, probe.plane, stage_slots)
    plan = dataclasses.replace(probe, chunk_c=min(chunk_c, spec.C), stage_slots=stage_slots)
    if plan.smem_bytes > SMEM_BYTES_MAX:
        raise ValueError(f"input tile {plan.in_tile} x {plan.chunk_c} channels x {config.bn} images needs "
                         f"{plan.smem_bytes} B of shared memory (> {SMEM_BYTES_MAX}); use a smaller tile")
    if plan.template_fmas > max_kernel_fmas:
        raise ValueError(f"{plan.template_fmas} unrolled FMAs per kernel exceed the cap of {max_kernel_fmas} "
                         f"(bk * C*R*S * bn*bh*bw = {config.bk} * {spec.C * spec.R * spec.S} * {plan.pixels} "
                         "per group); lower bk, bh, bw or bn")
    return plan


def candidate_configs(spec: ConvSpec, max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS) -> List[CodegenConfig]:
    """3-6 valid configs for `spec`, the expected fastest (`default_config`) first: then without
    the register bound, twice the rows per thread, half the channels per thread, and emit mode."""
    default = default_config(spec, max_kernel_fmas)
    variants = [default, dataclasses.replace(default, min_blocks=0),
                _bounded(dataclasses.replace(default, bh=default.bh * 2)),
                _bounded(dataclasses.replace(default, bk=-(-default.bk // 2))),
                dataclasses.replace(default, mode="emit")]
    configs: List[CodegenConfig] = []
    for config in variants:
        if config in configs or config.accumulators > MAX_ACCUMULATORS:
            continue
        try:
            make_plan(spec, config, max_kernel_fmas=max_kernel_fmas)
        except ValueError:
            continue
        configs.append(config)
    return configs


def _bounded(config: CodegenConfig) -> CodegenConfig:
    """`config` with min_blocks such that ptxas keeps to ~accumulators + 96 registers (room for
    the input window, prefetch and addresses: at + 64 resnet-conv1 already spills), so several
    blocks share an SM and one block's barrier or staging latency is hidden by another's FMAs."""
    blocks = min(MAX_BLOCKS_BOUND, 65536 // (config.tx * config.ty * (config.accumulators + 96)))
    return dataclasses.replace(config, min_blocks=blocks if blocks >= 2 else 0)


def default_config(spec: ConvSpec, max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS) -> CodegenConfig:
    """The tiling expected fastest on an H100/H200.

    All K channels of a pixel in one thread when possible (bk up to 64): each input loaded from
    shared memory feeds bk * R * density FMAs per row it touches (>= 4 FMAs per load at 90% keeps
    the FMA pipe, not shared memory, the limit). Extra rows per thread (bh) add window reuse while
    all K still fits in one kernel under the unroll cap, with at most 64 accumulators. Then, while
    the grid would leave SMs idle (small batch), fewer channels per thread (more groups) and
    narrower tiles.
    """
    crs = spec.C * spec.R * spec.S
    tx = 32 if spec.Q > 16 else 16 if spec.Q > 8 else 8
    ty = 128 // tx
    while ty > 1 and ty >= 2 * spec.P and (tx * ty // 2) % 32 == 0:
        ty //= 2  # a block taller than twice the output only idles threads
    # K is split into equal groups of bk; one group's template must fit the unroll cap.
    n_groups = max(-(-spec.K // 64), -(-spec.K * crs // max_kernel_fmas))
    bk = -(-spec.K // n_groups)
    bh = 1
    while bh < 4 and bk * bh * 2 <= 64 and spec.K * crs * bh * 2 <= max_kernel_fmas and spec.P >= ty * bh * 2:
        bh *= 2
    config = CodegenConfig(bh=bh, bk=bk, tx=tx, ty=ty)
    while _blocks(spec, config) < TARGET_BLOCKS:
        if config.bk > 8:
            n_groups *= 2
            config = dataclasses.replace(config, bk=-(-spec.K // n_groups))
        elif config.tx > 8 and config.tx * config.ty > 64:
            config = dataclasses.replace(config, tx=config.tx // 2)
        else:
            break
    return _bounded(config)


def _blocks(spec: ConvSpec, config: CodegenConfig) -> int:
    """Blocks of one kernel of all-K size (what the GPU has to spread over its SMs)."""
    tiles = -(-spec.P // (config.ty * config.bh)) * -(-spec.Q // (config.tx * config.bw))
    return tiles * -(-spec.N // config.bn) * -(-spec.K // config.bk)


def _auto_slice_k(k: int, bk: int, per_channel: int, max_kernel_fmas: int) -> int:
    """Fewest equal slices (multiples of bk) whose template stays within `max_kernel_fmas`."""
    k_padded = -(-k // bk) * bk
    fit = max(bk, max_kernel_fmas // per_channel // bk * bk)
    n_slices = -(-k_padded // fit)
    per_slice = -(-k_padded // n_slices)
    return -(-per_slice // bk) * bk


def _auto_chunk_c(c: int, bn: int, plane: int, stage_slots: int) -> int:
    """Most channels per stage within the shared-memory and prefetch-register budgets, balanced."""
    by_smem = SMEM_BYTES_MAX // (2 * 4 * bn * plane)
    by_regs = MAX_STAGE_REGS // (bn * stage_slots)
    if c * bn * plane * 4 <= SMEM_BYTES_MAX and c * bn * stage_slots <= MAX_STAGE_REGS:
        return c  # one stage, one buffer
    chunk = max(1, min(by_smem, by_regs))
    n_chunks = -(-c // chunk)
    return -(-c // n_chunks)


def placeholder_bits(count: int) -> np.ndarray:
    """(count,) uint32: the placeholder weight of each FMA slot, as float32 bit patterns."""
    if count > MAX_PLACEHOLDERS:
        raise ValueError(f"at most {MAX_PLACEHOLDERS} placeholders, asked for {count}")
    return np.arange(count, dtype=np.uint32) + np.uint32(PLACEHOLDER_BASE)


def slot_weight_bits(plan: KernelPlan, weight_slice: np.ndarray) -> np.ndarray:
    """(template_fmas,) uint32: the real weight of each FMA slot of the template.

    weight_slice: (slice_k, C, R, S) float32, zero rows past K. Slot order is
    (k, c, r, s, image, row, column), so slot // pixels is the weight's flat index.
    """
    flat = np.ascontiguousarray(weight_slice, dtype=np.float32).reshape(-1).view(np.uint32)
    return np.repeat(flat, plan.pixels)


def f32_literal(bits: int) -> str:
    """Exact C literal of the float32 with bit pattern `bits` (hex float, e.g. 0x1.8p+0f)."""
    value = struct.unpack("<f", struct.pack("<I", int(bits)))[0]
    if not math.isfinite(value):
        raise ValueError(f"weight {value} is not finite")
    return value.hex() + "f"


def kernel_source(plan: KernelPlan, weights: Optional[np.ndarray] = None) -> str:
    """CUDA C of one slice kernel: the placeholder template (weights None) or the emitted sparse
    kernel for `weights`, (slice_k, C, R, S) float32 of this slice (zero rows past K)."""
    if weights is not None and tuple(weights.shape) != (plan.slice_k, plan.spec.C, plan.spec.R, plan.spec.S):
        raise ValueError(f"weights of one slice must be {(plan.slice_k, plan.spec.C, plan.spec.R, plan.spec.S)}, "
                         f"got {tuple(weights.shape)}")
    return _Generator(plan, weights).source()


class _Generator:
    """Writes the kernel line by line; names: a{k}_{n}_{i}_{j} accumulators, v{n}_{a}_{j}_{s} window
    values, st{n}_{c}_{l} prefetched inputs, goff{l}/ok{l}/pos{l} this thread's staging positions."""

    def __init__(self, plan: KernelPlan, weights: Optional[np.ndarray]):
        self.plan, self.spec, self.cfg = plan, plan.spec, plan.config
        self.bits = None if weights is None else \
            np.ascontiguousarray(weights, dtype=np.float32).reshape(-1).view(np.uint32)
        self.lines: List[str] = []

    def source(self) -> str:
        self._prologue()
        if self.plan.groups == 1:
            self._group(0)
        else:
            self._line("switch (g) {")
            for g in range(self.plan.groups):
                self._line(f"case {g}: {{")
                self._group(g)
                self._line("} break;")
            self._line("}")
        self._line("}")
        return "\n".join(self.lines) + "\n"

    def _line(self, text: str) -> None:
        self.lines.append(text)

    # --- block and thread coordinates --------------------------------------------------------

    def _prologue(self) -> None:
        p, s, c = self.plan, self.spec, self.cfg
        (_, in_w), (tile_p, tile_q), (_, tiles_q) = p.in_tile, p.tile, p.tiles
        sh, sw = s.stride
        ph, pw = s.padding
        mode = "template" if self.bits is None else "emit"
        self._line(f"// sparsecnn codegen ({mode}): C={s.C} K={s.K} H={s.H} W={s.W} R={s.R} S={s.S} "
                   f"stride={s.stride} padding={s.padding} config={c} slice_k={p.slice_k} "
                   f"chunk_c={p.chunk_c} relu={p.relu} bias={p.has_bias}")
        bounds = f"{p.threads}, {c.min_blocks}" if c.min_blocks else f"{p.threads}"
        self._line(f'extern "C" __global__ void __launch_bounds__({bounds}) {KERNEL_NAME}(')
        self._line("    const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ y,")
        self._line("    int n_batch, int k0, int reverse) {")
        self._line(f"  __shared__ float smem[{p.smem_bytes // 4}];")
        self._line(f"  const int tid = threadIdx.y * {c.tx} + threadIdx.x;")
        self._line("  const int bx = reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;")
        self._line("  const int by = reverse ? gridDim.y - 1 - blockIdx.y : blockIdx.y;")
        if p.groups > 1:
            self._line(f"  const int g = bx % {p.groups};  // a tile's groups run together: its input leaves DRAM once")
        self._line(f"  const int tile = bx / {p.groups};")
        self._line(f"  const int p0 = (tile / {tiles_q}) * {tile_p};")
        self._line(f"  const int q0 = (tile % {tiles_q}) * {tile_q};")
        self._line(f"  const int n0 = by * {c.bn};")
        self._line(f"  const float* __restrict__ xb = x + (long long)n0 * {s.C * s.H * s.W};")
        for t in range(c.bn):
            self._line(f"  const bool nok{t} = n0 + {t} < n_batch;")
        for l in range(p.stage_slots):
            self._line(f"  const int pos{l} = tid + {l * p.threads};")
            self._line(f"  const int ih{l} = p0 * {sh} - {ph} + pos{l} / {in_w};")
            self._line(f"  const int iw{l} = q0 * {sw} - {pw} + pos{l} % {in_w};")
            self._line(f"  const bool sok{l} = pos{l} < {p.plane};")
            self._line(f"  const bool ok{l} = sok{l} && ih{l} >= 0 && ih{l} < {s.H} && iw{l} >= 0 && iw{l} < {s.W};")
            self._line(f"  const int goff{l} = ok{l} ? ih{l} * {s.W} + iw{l} : 0;")
        self._line(f"  const int toff = threadIdx.y * {c.bh * sh * in_w} + threadIdx.x * {sw};")
        for i in range(c.bh):
            self._line(f"  const bool rok{i} = p0 + threadIdx.y * {c.bh} + {i} < {s.P};")
        for j in range(c.bw):
            self._line(f"  const bool cok{j} = q0 + threadIdx.x + {j * c.tx} < {s.Q};")

    # --- one group of bk channels: init, chunks, epilogue ------------------------------------

    def _group(self, g: int) -> None:
        c, s = self.cfg, self.spec
        self._line(f"  const int kb = k0 + {g * c.bk};")
        for kk in range(c.bk):
            init = f"(kb + {kk} < {s.K}) ? __ldg(bias + kb + {kk}) : 0.f" if self.plan.has_bias else "0.f"
            self._line(f"  const float b{kk} = {init};")
            for t, i, j in self._pixels():
                self._line(f"  float a{kk}_{t}_{i}_{j} = b{kk};")
        chunks = self.plan.chunks
        max_chunk = max(end - begin for begin, end in chunks)
        for t in range(c.bn):
            for cl in range(max_chunk):
                for l in range(self.plan.stage_slots):
                    self._line(f"  float st{t}_{cl}_{l};")
        self._stage_loads(*chunks[0])
        self._stage_stores(*chunks[0], buffer=0)
        self._line("  __syncthreads();")
        for index, (begin, end) in enumerate(chunks):
            last = index + 1 == len(chunks)
            if not last:
                self._stage_loads(*chunks[index + 1])  # in flight during this chunk's FMAs
            for ch in range(begin, end):
                self._channel(g, ch, ch - begin, buffer=index % 2)
            if not last:
                self._stage_stores(*chunks[index + 1], buffer=(index + 1) % 2)
                self._line("  __syncthreads();")
        self._epilogue()

    def _pixels(self) -> Iterator[Tuple[int, int, int]]:
        c = self.cfg
        for t in range(c.bn):
            for i in range(c.bh):
                for j in range(c.bw):
                    yield t, i, j

    def _stage_loads(self, begin: int, end: int) -> None:
        s = self.spec
        for t in range(self.cfg.bn):
            for ch in range(begin, end):
                for l in range(self.plan.stage_slots):
                    offset = (t * s.C + ch) * s.H * s.W
                    self._line(f"  st{t}_{ch - begin}_{l} = (ok{l} && nok{t}) ? __ldg(xb + {offset} + goff{l}) : 0.f;")

    def _stage_stores(self, begin: int, end: int, buffer: int) -> None:
        p = self.plan
        for t in range(self.cfg.bn):
            for cl in range(end - begin):
                base = buffer * p.buffer_floats + (t * p.chunk_c + cl) * p.plane
                for l in range(p.stage_slots):
                    guard = f"if (sok{l}) " if (l + 1) * p.threads > p.plane else ""
                    self._line(f"  {guard}smem[{base} + pos{l}] = st{t}_{cl}_{l};")

    # --- the unrolled FMAs of one input channel ----------------------------------------------

    def _channel(self, g: int, ch: int, cl: int, buffer: int) -> None:
        """Load this thread's input window of channel `ch` once, then every FMA that uses it."""
        p, s, c = self.plan, self.spec, self.cfg
        sh, sw = s.stride
        in_w = p.in_tile[1]
        terms = list(self._terms(g, ch))
        if not terms:
            return
        self._line(f"  {{  // c = {ch}")
        loads = sorted({(t, i * sh + r, j, col) for _, t, i, j, r, col, _ in terms})
        for t, a, j, col in loads:
            offset = buffer * p.buffer_floats + (t * p.chunk_c + cl) * p.plane + a * in_w + j * c.tx * sw + col
            self._line(f"    const float v{t}_{a}_{j}_{col} = smem[{offset} + toff];")
        for kk, t, i, j, r, col, literal in terms:
            acc = f"a{kk}_{t}_{i}_{j}"
            self._line(f"    {acc} = __fmaf_rn(v{t}_{i * sh + r}_{j}_{col}, {literal}, {acc});")
        self._line("  }")

    def _terms(self, g: int, ch: int) -> Iterator[Tuple[int, int, int, int, int, int, str]]:
        """(kk, image, row, column, r, s, weight literal) of each FMA of channel `ch`, in chain order."""
        p, s, c = self.plan, self.spec, self.cfg
        for r in range(s.R):
            for col in range(s.S):
                for kk in range(c.bk):
                    k_rel = g * c.bk + kk
                    flat = ((k_rel * s.C + ch) * s.R + r) * s.S + col
                    if self.bits is not None:
                        bits = int(self.bits[flat])
                        if bits & 0x7FFFFFFF == 0:
                            continue
                        literal = f32_literal(bits)
                    for n, (t, i, j) in enumerate(self._pixels()):
                        if self.bits is None:
                            literal = f32_literal(PLACEHOLDER_BASE + flat * p.pixels + n)
                        yield kk, t, i, j, r, col, literal

    def _epilogue(self) -> None:
        p, s, c = self.plan, self.spec, self.cfg
        pq = s.P * s.Q
        self._line(f"  float* __restrict__ yb = y + ((long long)n0 * {s.K} + kb) * {pq}"
                   f" + (p0 + threadIdx.y * {c.bh}) * {s.Q} + q0 + threadIdx.x;")
        for kk in range(c.bk):
            self._line(f"  if (kb + {kk} < {s.K}) {{")
            for t, i, j in self._pixels():
                value = f"a{kk}_{t}_{i}_{j}"
                if p.relu:
                    value = f"fmaxf({value}, 0.f)"
                offset = (t * s.K + kk) * pq + i * s.Q + j * c.tx
                self._line(f"    if (nok{t} && rok{i} && cok{j}) yb[{offset}] = {value};")
            self._line("  }")
