"""PTX of the unrolled batch-innermost kernel (`kernel.py`): one layer's weights as immediates.

One thread owns one image at a run of `tq` output columns of one output row (tq = 1: one output
pixel) and the output channels of one group (at most `bk`); a block of `threads` threads owns
consecutive positions in batch-innermost order (image fastest: a warp's loads are 128 contiguous
bytes when N >= 32), blockIdx.y the group. With tq > 1 an input row's values are loaded once for
every tap and output column of the run that reads them (`tile_loads`). Per group, for every input column (c, r, s) holding a non-zero in one of the group's
channels, in (c, r, s) order: one load of the thread's input, then one FMA per non-zero with the
weight as an immediate. A loaded input feeds every non-zero of its column in the group (at 90% sparsity and
bk = 32 about 3 FMAs per load, against one for the Triton "batch" kernel), and no index or weight
is loaded. The input is read zero-padded ((C, H + 2 ph, W + 2 pw, N), packed by the launcher), so
no load is predicated: with a predicate per tap, ptxas took several times longer.

Why PTX and not CUDA C: nvcc's front end takes several times longer than ptxas on large layers;
the PTX is written here far faster. Every value is a
virtual register, so the text is what Algorithm 2 of paper 002 would leave after deleting the
zero FMAs.

Groups: channels dealt by decreasing non-zero count in snake order (`channel_groups`), so blocks
of different groups carry about the same work; a channel's place in its group is free (its
output offset is an immediate). A large layer is written as several modules, each a kernel over a
run of consecutive groups (`split_groups`), compiled at once and launched one after another.

Epilogue per channel: act(acc + bias + residual), stored at the output's strides (batch-innermost
or NCHW, the residual at the same strides); `flags` (bit 0 ReLU, 1 bias, 2 residual) chooses per
launch, so one compile serves every epilogue and layout. Two images per thread (64-bit loads,
twice the accumulators) was never the fastest config of a layer and compiled much longer.
Kernel parameters: (u64 x, u64 bias, u64 res, u64 y, u32 flags, u32 sn, sk, sp, sq), the strides
in elements of the (N, K, P, Q) output.

float16 (`kernel_ptx(..., half=True)`, `_HalfWriter`; the fp32 text is untouched by it): packed
pairs over two images. A thread owns images n0 = 2i and n0 + 1 of its position; the input is packed
as (C, Hp, Wp, Npad) float16 with Npad = N rounded up to even (an odd N gets a zero image, computed
and never stored: flags bit PHANTOM), so one aligned 32-bit load is the f16x2 pair of both images'
inputs, and each non-zero one `fma.rn.f16x2` with the weight rounded to float16 in both halves
(`mov.b32` of a .b32 immediate into a register: PTX takes no f16x2 immediate operand). Error: an
f16x2 partial sum rounds at every term, its error growing with the terms it holds (for F terms per
partial, about (F + 1) / 2 times the variance of rounding the output once, which is cuDNN's error
with its fp32 accumulation), so each accumulator's partial takes HALF_FLUSH_TERMS terms and is then
flushed: unpacked (`mov.b32 {lo, hi}`), each half converted and added to one of the pair's two fp32
sums, the next partial starting with a `mul.rn.f16x2`. F = 4 keeps the error within the project's
2x of cuDNN's; F = 8 would not. The epilogue (bias, residual, ReLU) runs in fp32 from float16 bias
and residual, and each image is stored as float16 (`cvt.rn.f16.f32`, two 16-bit stores at the
output's strides). One slice only (no shared-memory partials); tq as in fp32.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from sparsecnn.core.spec import ConvSpec

KERNEL_NAME = "sparsecnn_unrolled_conv"
PTX_VERSION = "8.0"   # >= what sm_80..sm_90 need (7.0..7.8); CUDA 12.0+ drivers take it
DEFAULT_ARCH = "90"   # the target when none is given (an H100/H200)
_LOAD_REGISTERS = 16   # rotating load destinations (ptxas renames anyway)
PARTIALS = "partials"   # shared memory: the partial sums of slices 1.. (slice-major, channel, thread)
OUTSIDE = 8   # flags bit: the thread's position is past the last one (it stores nothing)
PHANTOM = 16   # flags bit (float16): the pair's second image is past N (it is not stored)
HALF_FLUSH_TERMS = 4   # float16: f16x2 terms per partial sum before it is added to fp32 (docstring)
_WEIGHT_REGISTERS = 8   # float16: rotating f16x2 weight registers (each a mov of an immediate)


@dataclasses.dataclass(frozen=True)
class Column:
    """One input column (c, r, s) of a group: its element offset from the thread's window origin
    and the (accumulator slot, weight) pairs it feeds."""

    c: int
    r: int
    s: int
    offset: int
    terms: Tuple[Tuple[int, float], ...]


def channel_groups(weight: np.ndarray, bk: int) -> List[List[int]]:
    """Output channels dealt into ceil(K / bk) groups of at most bk: by decreasing non-zero count in
    snake order, so the groups (which run as different blocks) carry about the same work."""
    k = weight.shape[0]
    n_groups = -(-k // bk)
    counts = np.count_nonzero(weight.reshape(k, -1), axis=1)
    order = sorted(range(k), key=lambda channel: (-counts[channel], channel))
    groups: List[List[int]] = [[] for _ in range(n_groups)]
    for rank, channel in enumerate(order):
        lap, slot = divmod(rank, n_groups)
        groups[slot if lap % 2 == 0 else n_groups - 1 - slot].append(channel)
    return [sorted(group) for group in groups]


def group_columns(weight: np.ndarray, group: Sequence[int], spec: ConvSpec) -> List[Column]:
    """The non-empty columns of one group's channels, in (c, r, s) order; offsets in elements of the
    zero-padded batch-innermost input (C, H + 2 ph, W + 2 pw, N): c * Hp*Wp*N + r * Wp*N + s * N."""
    n, h, w = spec.N, spec.H + 2 * spec.padding[0], spec.W + 2 * spec.padding[1]
    block = weight[list(group)]
    flat = block.reshape(len(group), -1)
    columns = []
    for column in np.flatnonzero(np.any(flat != 0, axis=0)):
        c, rest = divmod(int(column), spec.R * spec.S)
        r, s = divmod(rest, spec.S)
        terms = tuple((int(j), float(flat[j, column])) for j in np.flatnonzero(flat[:, column]))
        columns.append(Column(c, r, s, c * h * w * n + r * w * n + s * n, terms))
    return columns


def f32_hex(value: float) -> str:
    """PTX float32 immediate (0fXXXXXXXX) of `value`, which must be finite."""
    if not math.isfinite(value):
        raise ValueError(f"weight {value} is not finite")
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def split_groups(weight: np.ndarray, groups: Sequence[Sequence[int]], max_fmas: int) -> List[List[List[int]]]:
    """`groups` cut into consecutive runs of at most `max_fmas` non-zeros of `weight` (K, C, R, S)
    each (a group alone over it makes a run of its own): one compiled module per run. ptxas time
    grows faster than the code: a large layer compiles faster in total as several modules than as
    one, and the modules compile at once."""
    counts = np.count_nonzero(weight.reshape(weight.shape[0], -1), axis=1)
    runs: List[List[List[int]]] = []
    total = 0
    for group in groups:
        fmas = int(counts[list(group)].sum())
        if not runs or total + fmas > max_fmas:
            runs.append([])
            total = 0
        runs[-1].append(list(group))
        total += fmas
    return runs


def slice_columns(columns: Sequence[Column], slices: int) -> List[List[Column]]:
    """`columns` cut into `slices` consecutive runs of about equal non-zeros (FMAs), one per warp row
    of a block (some may be empty)."""
    total = sum(len(column.terms) for column in columns)
    runs: List[List[Column]] = [[] for _ in range(slices)]
    done = 0
    for column in columns:
        index = min(slices - 1, done * slices // max(1, total))
        runs[index].append(column)
        done += len(column.terms)
    return runs


def tile_loads(columns: Sequence[Column], tq: int, sw: int) -> List[Tuple[Tuple[int, int], List[Column], List[int]]]:
    """`columns` of one group grouped by input row (c, r), in order, each with the input columns u a
    thread of `tq` output columns loads for it: u = t * sw + s for its output column t and each s
    of the row's columns, each loaded once however many (t, s) read it."""
    rows: List[Tuple[Tuple[int, int], List[Column], List[int]]] = []
    for column in columns:
        if not rows or rows[-1][0] != (column.c, column.r):
            rows.append(((column.c, column.r), [], []))
        rows[-1][1].append(column)
    return [(key, row, sorted({t * sw + c.s for c in row for t in range(tq)})) for key, row, _ in rows]


class _Writer:
    IMAGES_PER_THREAD = 1   # consecutive images of one position a thread computes
    ELEMENT_BYTES = 4

    def __init__(self, weight: np.ndarray, spec: ConvSpec, groups: Sequence[Sequence[int]], threads: int,
                 arch: str = DEFAULT_ARCH, slices: int = 1, bk: int = 0, tq: int = 1):
        self.weight, self.spec, self.groups, self.threads, self.arch = weight, spec, groups, threads, arch
        self.slices, self.tq = slices, tq
        self.padded_n = spec.N + (-spec.N) % self.IMAGES_PER_THREAD   # images in the packed input
        self.bk = max([bk, *(len(group) for group in groups)])   # the partial sums' channel stride
        self.lines: List[str] = []

    def emit(self, *lines: str) -> None:
        self.lines.extend(lines)

    def source(self) -> str:
        groups, slices = self.groups, self.slices
        self.emit(f".version {PTX_VERSION}", f".target sm_{self.arch}", ".address_size 64", "")
        if slices > 1:
            self.emit(f".shared .align 4 .f32 {PARTIALS}[{(slices - 1) * self.bk * self.tq * self.threads}];", "")
        for index, group in enumerate(groups):
            columns = slice_columns(group_columns(self.weight, group, self.spec), slices)
            for part in range(slices):
                self._slice_function(index, part, group, columns[part])
        self.emit(f".visible .entry {KERNEL_NAME}(.param .u64 p_x, .param .u64 p_bias, .param .u64 p_res, "
                  ".param .u64 p_y, .param .u32 p_flags, .param .u32 p_sn, .param .u32 p_sk, .param .u32 p_sp, "
                  ".param .u32 p_sq)",
                  f".maxntid {self.threads}, {slices}, 1", "{",
                  ".reg .pred %p<2>; .reg .b32 %r<24>; .reg .b64 %rd<12>;")
        self._prologue()
        targets = [(index, part) for index in range(len(groups)) for part in range(slices)]
        self.emit(f"$TABLE: .branchtargets {', '.join(f'$G{i}_{j}' for i, j in targets)};",
                  "mov.u32 %r20, %ctaid.y;", "mov.u32 %r22, %tid.y;", f"mad.lo.s32 %r20, %r20, {slices}, %r22;",
                  "brx.idx %r20, $TABLE;")
        for index, part in targets:
            self.emit(f"$G{index}_{part}:",
                      f"call.uni group{index}_{part}, ({self._call_arguments()});",
                      "bra.uni $DONE;")
        self.emit("$DONE:", "ret;", "}")
        return "\n".join(self.lines) + "\n"

    def _call_arguments(self) -> str:
        """What the entry passes each group function (`_prologue` says what they hold)."""
        return "%rd4, %rd1, %rd6, %rd7, %r0, %r13, %r15"

    def _prologue(self) -> None:
        """m (the thread's position: image fastest, then its run of tq output columns, then the
        output row), the window origin in the padded input, and what each group takes: x at the
        origin (%rd4), bias (%rd1), residual and output at the run's first column (%rd6, %rd7:
        strides sn, sp, sq in elements), the channel and column strides sk, sq (%r13, %r15) and the
        flags (%r0) with bit 3 set past the last position. Such a thread computes the last position
        again and stores nothing: every warp of a block reaches the barrier of the partial sums."""
        spec, n, tq, per = self.spec, self.padded_n, self.tq, self.IMAGES_PER_THREAD
        sh, sw = spec.stride
        runs, owners = spec.Q // tq, n // per   # runs of tq output columns per row; threads per image set
        positions = spec.P * runs * owners
        for index, name in enumerate(("x", "bias", "res", "y")):
            self.emit(f"ld.param.u64 %rd{index}, [p_{name}];", f"cvta.to.global.u64 %rd{index}, %rd{index};")
        self.emit("ld.param.u32 %r0, [p_flags];", "ld.param.u32 %r12, [p_sn];", "ld.param.u32 %r13, [p_sk];",
                  "ld.param.u32 %r14, [p_sp];", "ld.param.u32 %r15, [p_sq];",
                  "mov.u32 %r1, %ctaid.x;", "mov.u32 %r2, %tid.x;",
                  f"mad.lo.s32 %r4, %r1, {self.threads}, %r2;",
                  f"setp.ge.s32 %p0, %r4, {positions};", f"selp.b32 %r21, {OUTSIDE}, 0, %p0;",
                  "or.b32 %r0, %r0, %r21;", f"min.s32 %r4, %r4, {positions - 1};",
                  f"div.s32 %r5, %r4, {owners};", f"mul.lo.s32 %r6, %r5, {owners};",
                  "sub.s32 %r6, %r4, %r6;")   # %r6: the thread's (first) image
        if per > 1:
            self.emit(f"mul.lo.s32 %r6, %r6, {per};")
        self.emit(f"div.s32 %r7, %r5, {runs};", f"mul.lo.s32 %r8, %r7, {runs};", "sub.s32 %r8, %r5, %r8;",  # p, run
                  f"mul.lo.s32 %r8, %r8, {tq};",  # q of the run's first column
                  f"mul.lo.s32 %r9, %r7, {sh};", f"mul.lo.s32 %r10, %r8, {sw};",
                  f"mul.lo.s32 %r11, %r9, {(spec.W + 2 * spec.padding[1]) * n};",
                  f"mad.lo.s32 %r11, %r10, {n}, %r11;",
                  "add.s32 %r11, %r11, %r6;",
                  f"mul.wide.s32 %rd4, %r11, {self.ELEMENT_BYTES};", "add.s64 %rd4, %rd0, %rd4;",
                  "mul.lo.s32 %r16, %r6, %r12;", "mad.lo.s32 %r16, %r7, %r14, %r16;",
                  "mad.lo.s32 %r16, %r8, %r15, %r16;",
                  f"mul.wide.s32 %rd5, %r16, {self.ELEMENT_BYTES};", "add.s64 %rd6, %rd2, %rd5;",
                  "add.s64 %rd7, %rd3, %rd5;")

    def _epilogue_predicates(self) -> None:
        """%p1 ReLU, %p2 bias, %p3 residual, %p4 the thread stores (flags bits 0, 1, 2, OUTSIDE)."""
        self.emit("and.b32 %r3, %r0, 1;", "setp.ne.s32 %p1, %r3, 0;",
                  "and.b32 %r3, %r0, 2;", "setp.ne.s32 %p2, %r3, 0;",
                  "and.b32 %r3, %r0, 4;", "setp.ne.s32 %p3, %r3, 0;",
                  f"and.b32 %r3, %r0, {OUTSIDE};", "setp.eq.s32 %p4, %r3, 0;")

    def _slice_function(self, index: int, part: int, group: Sequence[int], columns: Sequence[Column]) -> None:
        """Slice `part` of group `index` as a function of its own (ptxas allocates its registers on
        its own): its columns' FMAs into the group's accumulators. Slice 0 then adds the other
        slices' partial sums (shared memory, after the barrier) and stores; the others write theirs."""
        accumulators = len(group) * self.tq   # slot t * len(group) + j: output column t, channel j
        self.emit(f".func group{index}_{part}(.param .u64 xb, .param .u64 bias, .param .u64 resm, .param .u64 ym, "
                  ".param .u32 flags, .param .u32 sk, .param .u32 sq)", "{",
                  ".reg .pred %p<5>; .reg .b32 %r<6>; .reg .b64 %rd<8>;",
                  f".reg .f32 %v<{self._load_registers()}>; .reg .f32 %a<{max(1, accumulators)}>; .reg .f32 %o<3>;",
                  "ld.param.u64 %rd0, [xb];", "ld.param.u64 %rd1, [bias];", "ld.param.u64 %rd2, [resm];",
                  "ld.param.u64 %rd3, [ym];", "ld.param.u32 %r0, [flags];", "ld.param.u32 %r1, [sk];",
                  "ld.param.u32 %r2, [sq];")
        self.emit(*(f"mov.f32 %a{slot}, 0f00000000;" for slot in range(accumulators)))
        self._fmas(group, columns)
        if self.slices > 1:
            self.emit(f"mov.u32 %r4, {PARTIALS};", "mov.u32 %r5, %tid.x;", "mad.lo.s32 %r4, %r5, 4, %r4;")
            if part > 0:
                self.emit(*(f"st.shared.f32 [%r4+{self._partial_offset(part, a)}], %a{a};" for a in range(accumulators)),
                          "bar.sync 0;", "ret;", "}", "")
                return
            self.emit("bar.sync 0;")
            for a in range(accumulators):
                for other in range(1, self.slices):
                    self.emit(f"ld.shared.f32 %o0, [%r4+{self._partial_offset(other, a)}];",
                              f"add.f32 %a{a}, %a{a}, %o0;")
        self._epilogue_predicates()
        for t in range(self.tq):
            self.emit(f"mul.wide.s32 %rd6, %r2, {4 * t};")   # output column t of the run: t * sq elements
            for j, channel in enumerate(group):
                self._store(t * len(group) + j, channel)
        self.emit("ret;", "}", "")

    def _load_registers(self) -> int:
        """Load destinations: a rotating set, large enough for every input column one row of a
        thread's tq output columns reads ((tq - 1) * sw + S) to be live at once."""
        return max(_LOAD_REGISTERS, 2 * ((self.tq - 1) * self.spec.stride[1] + self.spec.S))

    LOAD = "ld.global.nc.f32"   # one thread's input value(s) at one input position

    def _tile_terms(self, group: Sequence[int], columns: Sequence[Column]) -> Iterator[Tuple[str, int, Column]]:
        """Per input row (c, r) of the slice's columns: each input column u a thread's tq output
        columns read, loaded once (emitted here), then (register, first accumulator slot, column)
        for each (column, output column t): a value loaded once feeds every tap s and output
        column t reading it (tq = 1: one load per column)."""
        registers, n, sw, next_register = self._load_registers(), self.padded_n, self.spec.stride[1], 0
        for _, row, loads in tile_loads(columns, self.tq, sw):
            base = self._packed_offset(row[0]) - row[0].s * n   # the row's element offset at s = 0
            held = {}
            for u in loads:
                held[u] = f"%v{next_register % registers}"
                next_register += 1
                self.emit(f"{self.LOAD} {held[u]}, [%rd0+{self.ELEMENT_BYTES * (base + u * n)}];")
            for column in row:
                for t in range(self.tq):
                    yield held[t * sw + column.s], t * len(group), column

    def _packed_offset(self, column: Column) -> int:
        """`column`'s element offset in the packed input (C, Hp, Wp, padded_n)."""
        spec, n = self.spec, self.padded_n
        wp = spec.W + 2 * spec.padding[1]
        return ((column.c * (spec.H + 2 * spec.padding[0]) + column.r) * wp + column.s) * n

    def _fmas(self, group: Sequence[int], columns: Sequence[Column]) -> None:
        """One exact fp32 FMA per non-zero and output column, the weight an immediate."""
        for register, first, column in self._tile_terms(group, columns):
            self.emit(*(f"fma.rn.f32 %a{first + j}, {register}, {f32_hex(value)}, %a{first + j};"
                        for j, value in column.terms))

    def _partial_offset(self, part: int, slot: int) -> int:
        """Byte offset of slice `part`'s partial sum of accumulator `slot` from the thread's first one."""
        return 4 * ((part - 1) * self.bk * self.tq + slot) * self.threads

    def _store(self, slot: int, channel: int) -> None:
        """act(acc + bias + residual) of accumulator `slot`, channel `channel`, at the output column
        whose offset from the run's first is in %rd6 (bytes); none past the last position."""
        self.emit(f"mul.wide.s32 %rd4, %r1, {4 * channel};", "add.s64 %rd4, %rd4, %rd6;", "add.s64 %rd5, %rd3, %rd4;",
                  "mov.f32 %o1, 0f00000000;", f"@%p2 ld.global.nc.f32 %o1, [%rd1+{4 * channel}];",
                  f"add.f32 %o0, %a{slot}, %o1;",
                  "add.s64 %rd4, %rd2, %rd4;", "@%p3 ld.global.f32 %o2, [%rd4+0];", "@%p3 add.f32 %o0, %o0, %o2;",
                  "@%p1 max.f32 %o0, %o0, 0f00000000;", "@%p4 st.global.f32 [%rd5+0], %o0;")


def half2_hex(value: float) -> str:
    """PTX .b32 immediate (0xHHHHHHHH) of the f16x2 pair with `value` rounded to float16 in both
    halves; ValueError unless that is finite."""
    with np.errstate(over="ignore"):
        half = np.float16(value)
    if not np.isfinite(half):
        raise ValueError(f"weight {value} is not finite in float16")
    bits = int(np.array(half).view(np.uint16))
    return "0x%08X" % (bits << 16 | bits)


class _HalfWriter(_Writer):
    """The float16 kernel (module docstring, "float16"): a thread owns images n0 = 2i and n0 + 1 of
    its position; the input is packed with Npad = N rounded up to even images (an odd N's last
    pair holds a zero image that is computed and never stored), so one aligned 32-bit load is the
    f16x2 pair of both images' inputs."""

    IMAGES_PER_THREAD = 2
    ELEMENT_BYTES = 2
    LOAD = "ld.global.nc.b32"   # the f16x2 pair of both images

    def __init__(self, weight: np.ndarray, spec: ConvSpec, groups: Sequence[Sequence[int]], threads: int,
                 arch: str = DEFAULT_ARCH, slices: int = 1, bk: int = 0, tq: int = 1, flush: int = HALF_FLUSH_TERMS):
        if slices != 1:
            raise ValueError(f"the float16 unrolled kernel runs one slice, got slices={slices}")
        if flush < 1:
            raise ValueError(f"flush must be a positive number of terms, got {flush}")
        super().__init__(weight, spec, groups, threads, arch, slices, bk, tq)
        self.flush = flush

    def _call_arguments(self) -> str:
        return "%rd4, %rd1, %rd6, %rd7, %r0, %r13, %r15, %r17"

    def _prologue(self) -> None:
        """`_Writer._prologue` over image pairs (m: pair fastest; byte offsets of 2-byte elements),
        then %r17: the second image's offset from the first in the output (sn elements; 0 for a
        pair whose second image is past N, which also sets flags bit PHANTOM)."""
        super()._prologue()
        spec = self.spec
        self.emit("mov.u32 %r17, %r12;")
        if spec.N % 2:
            self.emit(f"setp.ge.s32 %p1, %r6, {spec.N - 1};", f"selp.b32 %r21, {PHANTOM}, 0, %p1;",
                      "or.b32 %r0, %r0, %r21;", "selp.b32 %r17, 0, %r12, %p1;")

    def _slice_function(self, index: int, part: int, group: Sequence[int], columns: Sequence[Column]) -> None:
        """Group `index`'s f16x2 FMAs (`_fmas`) into its fp32 accumulators %a (2 per slot: the pair's
        images), then the epilogue per slot and image (`_store`)."""
        slots = len(group) * self.tq   # slot t * len(group) + j: output column t, channel j
        self.emit(f".func group{index}_{part}(.param .u64 xb, .param .u64 bias, .param .u64 resm, .param .u64 ym, "
                  ".param .u32 flags, .param .u32 sk, .param .u32 sq, .param .u32 sn)", "{",
                  ".reg .pred %p<6>; .reg .b32 %r<5>; .reg .b64 %rd<9>; .reg .b16 %h<4>;",
                  f".reg .b32 %v<{self._load_registers()}>; .reg .b32 %w<{_WEIGHT_REGISTERS}>; "
                  f".reg .b32 %s<{max(1, slots)}>; .reg .f32 %a<{max(1, 2 * slots)}>; .reg .f32 %o<4>;",
                  "ld.param.u64 %rd0, [xb];", "ld.param.u64 %rd1, [bias];", "ld.param.u64 %rd2, [resm];",
                  "ld.param.u64 %rd3, [ym];", "ld.param.u32 %r0, [flags];", "ld.param.u32 %r1, [sk];",
                  "ld.param.u32 %r2, [sq];", "ld.param.u32 %r4, [sn];", "mul.wide.s32 %rd8, %r4, 2;")
        self.emit(*(f"mov.f32 %a{a}, 0f00000000;" for a in range(2 * slots)))
        self._fmas(group, columns)
        self._epilogue_predicates()
        self.emit(f"and.b32 %r3, %r0, {OUTSIDE | PHANTOM};", "setp.eq.s32 %p5, %r3, 0;")   # second image stores
        for t in range(self.tq):
            self.emit(f"mul.wide.s32 %rd6, %r2, {2 * t};")   # output column t of the run: t * sq elements
            for j, channel in enumerate(group):
                self._store(t * len(group) + j, channel)
        self.emit("ret;", "}", "")

    def _fmas(self, group: Sequence[int], columns: Sequence[Column]) -> None:
        """`_Writer._fmas` in f16x2: each load is the pair's two inputs, each term one
        `fma.rn.f16x2` with the weight in both halves (a `mov.b32` into a rotating register: PTX
        has no f16x2 immediates; ptxas folds the constant into the HFMA2). A slot's f16x2 partial
        %s starts with a `mul.rn.f16x2` and is flushed to its two fp32 accumulators after every
        `flush` terms and at the end."""
        next_weight = 0
        pending = {}   # slot -> terms in its partial since its last flush
        for register, first, column in self._tile_terms(group, columns):
            for j, value in column.terms:
                slot, weight = first + j, f"%w{next_weight % _WEIGHT_REGISTERS}"
                next_weight += 1
                self.emit(f"mov.b32 {weight}, {half2_hex(value)};")
                if pending.get(slot, 0):
                    self.emit(f"fma.rn.f16x2 %s{slot}, {register}, {weight}, %s{slot};")
                else:
                    self.emit(f"mul.rn.f16x2 %s{slot}, {register}, {weight};")
                pending[slot] = pending.get(slot, 0) + 1
                if pending[slot] == self.flush:
                    self._flush(slot)
                    pending[slot] = 0
        for slot in sorted(slot for slot, count in pending.items() if count):
            self._flush(slot)

    def _flush(self, slot: int) -> None:
        """Slot `slot`'s f16x2 partial added to its two fp32 accumulators (low half: image n0)."""
        self.emit(f"mov.b32 {{%h0, %h1}}, %s{slot};",
                  "cvt.f32.f16 %o0, %h0;", f"add.f32 %a{2 * slot}, %a{2 * slot}, %o0;",
                  "cvt.f32.f16 %o0, %h1;", f"add.f32 %a{2 * slot + 1}, %a{2 * slot + 1}, %o0;")

    def _store(self, slot: int, channel: int) -> None:
        """act(acc + bias + residual) of slot `slot`'s two images in fp32, stored as float16 (one
        rounding) at the output column whose byte offset from the run's first is in %rd6, the
        second image sn elements after the first (%rd8 bytes); none past the last position, and
        the second none past N (%p5)."""
        first, second = 2 * slot, 2 * slot + 1
        self.emit(f"mul.wide.s32 %rd4, %r1, {2 * channel};", "add.s64 %rd4, %rd4, %rd6;", "add.s64 %rd5, %rd3, %rd4;",
                  "mov.f32 %o1, 0f00000000;", f"@%p2 ld.global.nc.b16 %h2, [%rd1+{2 * channel}];",
                  "@%p2 cvt.f32.f16 %o1, %h2;",
                  f"add.f32 %o0, %a{first}, %o1;", f"add.f32 %o3, %a{second}, %o1;",
                  "add.s64 %rd4, %rd2, %rd4;",
                  "@%p3 ld.global.b16 %h2, [%rd4+0];", "@%p3 cvt.f32.f16 %o2, %h2;", "@%p3 add.f32 %o0, %o0, %o2;",
                  "add.s64 %rd4, %rd4, %rd8;",
                  "@%p3 ld.global.b16 %h2, [%rd4+0];", "@%p3 cvt.f32.f16 %o2, %h2;", "@%p3 add.f32 %o3, %o3, %o2;",
                  "@%p1 max.f32 %o0, %o0, 0f00000000;", "@%p1 max.f32 %o3, %o3, 0f00000000;",
                  "cvt.rn.f16.f32 %h2, %o0;", "@%p4 st.global.b16 [%rd5+0], %h2;",
                  "add.s64 %rd5, %rd5, %rd8;",
                  "cvt.rn.f16.f32 %h3, %o3;", "@%p5 st.global.b16 [%rd5+0], %h3;")


def kernel_ptx(weight: np.ndarray, spec: ConvSpec, bk: int, threads: int,
               groups: Optional[Sequence[Sequence[int]]] = None, arch: str = DEFAULT_ARCH, slices: int = 1,
               tq: int = 1, half: bool = False, flush: int = 0) -> str:
    """PTX of the kernel for one layer: weight (K, C, R, S) float32 (zeros pruned), spec the layer at
    its input shape; groups: the channel groups this module computes, blockIdx.y indexing them
    (default: `channel_groups(weight, bk)`, the whole layer in one module); arch: the `.target`
    ("90": sm_90; plain fp32 PTX, nothing arch-specific); slices: warp rows per block, each taking a
    share of every group's columns (partial sums added through shared memory); tq: output columns
    per thread (a divisor of Q), each loaded input value serving every one reading it; half: the
    float16 kernel (one slice; weights rounded to float16, which must leave them finite), flush its
    f16x2 terms per partial (0: HALF_FLUSH_TERMS; tests change it)."""
    if tuple(weight.shape) != spec.weight_shape:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the layer's {spec.weight_shape}")
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    groups = channel_groups(weight, bk) if groups is None else groups
    if tq < 1 or spec.Q % tq:
        raise ValueError(f"tq must divide the layer's {spec.Q} output columns, got {tq}")
    if half:
        return _HalfWriter(weight, spec, groups, threads, arch, slices, bk, tq, flush or HALF_FLUSH_TERMS).source()
    return _Writer(weight, spec, groups, threads, arch, slices, bk, tq).source()
