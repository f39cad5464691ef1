"""CUDA C for the direct-convolution template of paper 002 (Algorithm 1), NCHW; FFMA kernels.

This module writes the kernels that accumulate in fp32 (float32, and float16 with
accumulate="float"); half2.py writes the HFMA2 ones on the same skeleton. The tiling is plan.py's:
each thread computes bn x bh x bw x bk outputs, `bh` consecutive rows (their input windows overlap,
so each input is loaded once for all of them) and `bw` columns `tx` apart, so adjacent threads own
adjacent pixels (conflict-free shared loads, coalesced stores).

Input reuse. The block's input tile (with halo, zeros outside the image: padding is applied while
staging) is staged in shared memory `chunk_c` channels at a time, double-buffered: the next chunk's
global loads are issued into registers before the current chunk's FMAs and stored after them, so
one barrier per chunk. Per channel a thread loads its ((bh-1)*sh + R) x bw x S window into
registers once and multiplies it by every weight of its `bk` channels: all loops over
(k, c, r, s) are unrolled in the source, each weight is a literal (an FMA immediate in SASS),
and no index is ever loaded. float16 inputs are converted to fp32 as they are staged.

Groups of one tile have consecutive block ids (group index fastest), so they run together and read
the tile from DRAM once. Every register of the unrolled body is defined once, so the PTX is in the
SSA form Algorithm 2 relies on: the group switch is the outermost statement (block-uniform, so its
barriers are legal) and no value flows from one case into another.

Two sources come out of one plan:
  template (weights=None): every (k, c, r, s) x (image, row, column) FMA has its own placeholder
    weight, a distinct non-zero constant the rewrite maps back to the slot;
  emit (weights given): only the non-zero terms, with the real values.
Both keep the same FMA order per accumulator, so they compute bit-identical results.

Kernel signature (all): (const T* x (N, C, H, W), const T* bias (K,) or unused, T* y (N, K, P, Q),
int n_batch, int k0 (first channel of the slice), int reverse (walk the blocks backwards, so a
slice starts on the tiles the previous slice left in L2)); T is float, or unsigned short holding
float16 bits. fp16 conversions are helper functions of one PTX instruction each (HALF_HELPERS), so
the PTX has no multi-line asm blocks the rewrite would have to parse.
"""
from __future__ import annotations

import math
import struct
from typing import Iterator, List, Optional, Set, Tuple

import numpy as np

from sparsecnn.backends.codegen.plan import KernelPlan

KERNEL_NAME = "sparsecnn_codegen_conv"
# Placeholders are 2^37 * (1 + m / 2^23): huge, positive, never 0 and never a constant the compiler
# makes up (those are 0, +-1, small integers, infinities), one mantissa value per FMA slot.
PLACEHOLDER_BASE = 0x52000001
MAX_PLACEHOLDERS = 1 << 23
HALF_HELPERS = r"""static __device__ __forceinline__ float h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
static __device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
"""


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


def check_slice(plan: KernelPlan, weights: Optional[np.ndarray]) -> None:
    expected = (plan.slice_k, plan.spec.C, plan.spec.R, plan.spec.S)
    if weights is not None and tuple(weights.shape) != expected:
        raise ValueError(f"weights of one slice must be {expected}, got {tuple(weights.shape)}")


class Generator:
    """Writes one slice kernel line by line (FFMA, fp32 accumulators); half2.py subclasses it.

    Names: a{k}_{n}_{i}_{j} accumulators, v{n}_{a}_{j}_{s} window values, st{n}_{c}_{l} prefetched
    inputs, goff{l}/ok{l}/pos{l} this thread's staging positions. weights: (slice_k, C, R, S)
    float32 of the slice (exactly representable in the plan's dtype), or None for the template.
    """

    word = "float"  # one staged shared-memory position

    def __init__(self, plan: KernelPlan, weights: Optional[np.ndarray]):
        check_slice(plan, weights)
        self.plan, self.spec, self.cfg = plan, plan.spec, plan.config
        self.weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
        self.half = plan.dtype == "float16"
        self.io = "unsigned short" if self.half else "float"
        self.lines: List[str] = []

    def source(self) -> str:
        self._helpers()
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

    def _helpers(self) -> None:
        if self.half:
            self._line(HALF_HELPERS)

    def _load(self, pointer: str) -> str:
        """A global load as a float (fp16 converted)."""
        return f"h2f(__ldg({pointer}))" if self.half else f"__ldg({pointer})"

    def _store(self, value: str) -> str:
        return f"f2h({value})" if self.half else value

    # --- block and thread coordinates --------------------------------------------------------

    def _prologue(self) -> None:
        p, s, c = self.plan, self.spec, self.cfg
        (_, in_w), (tile_p, tile_q), (_, tiles_q) = p.in_tile, p.tile, p.tiles
        sh, sw = s.stride
        mode = "template" if self.weights is None else "emit"
        self._line(f"// sparsecnn codegen ({mode}, {p.dtype}): C={s.C} K={s.K} H={s.H} W={s.W} R={s.R} S={s.S} "
                   f"stride={s.stride} padding={s.padding} config={c} slice_k={p.slice_k} "
                   f"chunk_c={p.chunk_c} flush_terms={p.flush_terms} relu={p.relu} bias={p.has_bias}")
        bounds = f"{p.threads}, {c.min_blocks}" if c.min_blocks else f"{p.threads}"
        io = self.io
        self._line(f'extern "C" __global__ void __launch_bounds__({bounds}) {KERNEL_NAME}(')
        self._line(f"    const {io}* __restrict__ x, const {io}* __restrict__ bias, {io}* __restrict__ y,")
        self._line("    int n_batch, int k0, int reverse) {")
        self._line(f"  __shared__ {self.word} smem[{p.smem_bytes // 4}];")
        self._line(f"  const int tid = threadIdx.y * {c.tx} + threadIdx.x;")
        self._line("  const int bx = reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;")
        self._line("  const int by = reverse ? gridDim.y - 1 - blockIdx.y : blockIdx.y;")
        if p.groups > 1:
            self._line(f"  const int g = bx % {p.groups};  // a tile's groups run together: its input leaves DRAM once")
        self._line(f"  const int tile = bx / {p.groups};")
        self._line(f"  const int p0 = (tile / {tiles_q}) * {tile_p};")
        self._line(f"  const int q0 = (tile % {tiles_q}) * {tile_q};")
        self._line(f"  const int n0 = by * {c.bn};")
        self._line(f"  const {io}* __restrict__ xb = x + (long long)n0 * {s.C * s.H * s.W};")
        for t in range(c.bn):
            self._line(f"  const bool nok{t} = n0 + {t} < n_batch;")
        for l in range(p.stage_slots):
            self._staging_position(l)
        self._line(f"  const int toff = threadIdx.y * {c.bh * sh * in_w} + threadIdx.x * {sw};")
        self._row_guards()
        for j in range(c.bw):
            self._line(f"  const bool cok{j} = q0 + threadIdx.x + {j * c.tx} < {s.Q};")

    def _staging_position(self, l: int) -> None:
        """pos{l}: the plane position this thread stages in slot l; goff{l}: its offset in a plane."""
        p, s = self.plan, self.spec
        in_w = p.in_tile[1]
        self._line(f"  const int pos{l} = tid + {l * p.threads};")
        self._line(f"  const int ih{l} = p0 * {s.stride[0]} - {s.padding[0]} + pos{l} / {in_w};")
        self._line(f"  const int iw{l} = q0 * {s.stride[1]} - {s.padding[1]} + pos{l} % {in_w};")
        self._line(f"  const bool sok{l} = pos{l} < {p.plane};")
        self._line(f"  const bool ok{l} = sok{l} && ih{l} >= 0 && ih{l} < {s.H} && iw{l} >= 0 && iw{l} < {s.W};")
        self._line(f"  const int goff{l} = ok{l} ? ih{l} * {s.W} + iw{l} : 0;")

    def _row_guards(self) -> None:
        for i in range(self.cfg.bh):
            self._line(f"  const bool rok{i} = p0 + threadIdx.y * {self.cfg.bh} + {i} < {self.plan.lane_rows};")

    # --- one group of bk channels: init, chunks, epilogue ------------------------------------

    def _group(self, g: int) -> None:
        c, s = self.cfg, self.spec
        self._line(f"  const int kb = k0 + {g * c.bk};")
        for kk in range(c.bk):
            init = f"(kb + {kk} < {s.K}) ? {self._load(f'bias + kb + {kk}')} : 0.f" if self.plan.has_bias else "0.f"
            self._line(f"  const float b{kk} = {init};")
            self._init_accumulators(kk)
        chunks = self.plan.chunks
        max_chunk = max(end - begin for begin, end in chunks)
        for t in range(c.bn):
            for cl in range(max_chunk):
                for l in range(self.plan.stage_slots):
                    self._line(f"  {self._staged_type()} st{t}_{cl}_{l};")
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

    def _init_accumulators(self, kk: int) -> None:
        for t, i, j in self._pixels():
            self._line(f"  float a{kk}_{t}_{i}_{j} = b{kk};")

    def _pixels(self) -> Iterator[Tuple[int, int, int]]:
        c = self.cfg
        for t in range(c.bn):
            for i in range(c.bh):
                for j in range(c.bw):
                    yield t, i, j

    def _staged_type(self) -> str:
        """A prefetched input between its global load and its shared-memory store (fp16 is
        converted at the store, so the load's register is the only one it takes)."""
        return self.io

    def _staged_word(self, name: str) -> str:
        """The shared-memory word of prefetched input `name`."""
        return f"h2f({name})" if self.half else name

    def _stage_loads(self, begin: int, end: int) -> None:
        s = self.spec
        for t in range(self.cfg.bn):
            for ch in range(begin, end):
                for l in range(self.plan.stage_slots):
                    value = self._staged_load(t, (t * s.C + ch) * s.H * s.W, l)
                    self._line(f"  st{t}_{ch - begin}_{l} = {value};")

    def _staged_load(self, t: int, offset: int, l: int) -> str:
        """The value image t's staging slot l loads from the input element at `offset` (0 outside)."""
        zero = "(unsigned short)0" if self.half else "0.f"
        return f"(ok{l} && nok{t}) ? __ldg(xb + {offset} + goff{l}) : {zero}"

    def _stage_stores(self, begin: int, end: int, buffer: int) -> None:
        p = self.plan
        for t in range(self.cfg.bn):
            for cl in range(end - begin):
                base = buffer * p.buffer_words + (t * p.chunk_c + cl) * p.plane
                for l in range(p.stage_slots):
                    guard = f"if (sok{l}) " if (l + 1) * p.threads > p.plane else ""
                    self._line(f"  {guard}smem[{base} + pos{l}] = {self._staged_word(f'st{t}_{cl}_{l}')};")

    # --- the unrolled FMAs of one input channel ----------------------------------------------

    def _weights_of(self, g: int, ch: int) -> Iterator[Tuple[int, int, int, int]]:
        """(kk, r, s, flat index in the slice) of channel `ch`'s weights in chain order (r, s, kk):
        all of them in the template, the non-zero ones when emitting."""
        s, c = self.spec, self.cfg
        for r in range(s.R):
            for col in range(s.S):
                for kk in range(c.bk):
                    flat = (((g * c.bk + kk) * s.C + ch) * s.R + r) * s.S + col
                    if self.weights is None or self.weights[flat] != 0:
                        yield kk, r, col, flat

    def _window_loads(self, cl: int, buffer: int, taps: Set[Tuple[int, int]]) -> None:
        """Load the window values the (r, s) `taps` of channel slot `cl` read, once each."""
        p, s, c = self.plan, self.spec, self.cfg
        sh, sw = s.stride
        in_w = p.in_tile[1]
        loads = sorted({(t, i * sh + r, j, col) for r, col in taps for t, i, j in self._pixels()})
        for t, a, j, col in loads:
            offset = buffer * p.buffer_words + (t * p.chunk_c + cl) * p.plane + a * in_w + j * c.tx * sw + col
            self._line(f"    const {self.word} v{t}_{a}_{j}_{col} = smem[{offset} + toff];")

    def _channel(self, g: int, ch: int, cl: int, buffer: int) -> None:
        """Load this thread's input window of channel `ch` once, then every FMA that uses it."""
        sh = self.spec.stride[0]
        weights = list(self._weights_of(g, ch))
        if not weights:
            return
        self._line(f"  {{  // c = {ch}")
        self._window_loads(cl, buffer, {(r, col) for _, r, col, _ in weights})
        for kk, r, col, flat in weights:
            for n, (t, i, j) in enumerate(self._pixels()):
                acc = f"a{kk}_{t}_{i}_{j}"
                literal = self._literal(flat, n)
                self._line(f"    {acc} = __fmaf_rn(v{t}_{i * sh + r}_{j}_{col}, {literal}, {acc});")
        self._line("  }")

    def _literal(self, flat: int, pixel: int) -> str:
        """The weight operand of FMA slot (flat, pixel): its placeholder, or the real weight."""
        if self.weights is None:
            return f32_literal(PLACEHOLDER_BASE + flat * self.plan.pixels + pixel)
        return f32_literal(int(self.weights[flat:flat + 1].view(np.uint32)[0]))

    def _epilogue(self) -> None:
        p, s, c = self.plan, self.spec, self.cfg
        pq = s.P * s.Q
        self._line(f"  {self.io}* __restrict__ yb = y + ((long long)n0 * {s.K} + kb) * {pq}"
                   f" + (p0 + threadIdx.y * {c.bh}) * {s.Q} + q0 + threadIdx.x;")
        for kk in range(c.bk):
            self._line(f"  if (kb + {kk} < {s.K}) {{")
            for t, i, j in self._pixels():
                value = f"a{kk}_{t}_{i}_{j}"
                if p.relu:
                    value = f"fmaxf({value}, 0.f)"
                offset = (t * s.K + kk) * pq + i * s.Q + j * c.tx
                self._line(f"    if (nok{t} && rok{i} && cok{j}) yb[{offset}] = {self._store(value)};")
            self._line("  }")
