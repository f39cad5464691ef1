"""HFMA2 kernels (float16, accumulate="half2") on template.py's skeleton; plan.py says why the two
lanes of each instruction are output rows p and p + ceil(P/2).

Lanes. Lane 0 of every half2 is an output row p < lane_rows = ceil(P/2), lane 1 is row
p + lane_rows; the grid covers lane 0's rows. Staging packs x[n, c, ih, iw] (low half) and
x[n, c, ih + lane_rows*sh, iw] (high half) into one 32-bit shared-memory word, so a window value is
one 32-bit load for both lanes and each term is one HFMA2 whose weight fills both halves.

Accumulation. a{k}_{n}_{i}_{j} (half2) sums `flush_terms` (c, r, s) terms starting from -0 (the
additive identity, also of +0); `flush2` then adds its halves into the fp32 sums
f{k}_{n}_{i}_{j}_{lane} (started at the bias) and the partial restarts from -0. The epilogue
flushes the last partial and stores the fp32 sums as half (one rounding). Emitting, a partial with
no non-zero term is not flushed; in the rewritten template its HFMA2s are deleted, so it is still
-0, and the rewrite drops the adds of -0 (ptx_rewrite.py): both modes add the same values in the
same order, so they agree bit for bit.

PTX shape the rewrite relies on: each HFMA2 is `fma.rn.f16x2 %rd, %rv, %rw, %ra` whose %rw is set by
`mov.u32 %rw, <placeholder>` (PTX has no f16x2 immediates; ptxas folds the constant into the
instruction: `HFMA2 R9, R6, 32.125, 32.125, R0`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from sparsecnn.backends.codegen.plan import KernelPlan
from sparsecnn.backends.codegen.template import HALF_HELPERS, Generator

NEG_ZERO_HALF2 = 0x80008000
HALF2_HELPERS = r"""static __device__ __forceinline__ unsigned hfma2(unsigned v, unsigned w, unsigned a) {
  unsigned d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(w), "r"(a)); return d; }
static __device__ __forceinline__ void flush2(float& lo, float& hi, unsigned a) {
  unsigned short l, h; asm("mov.b32 {%0, %1}, %2;" : "=h"(l), "=h"(h) : "r"(a)); lo += h2f(l); hi += h2f(h); }
static __device__ __forceinline__ unsigned pack2(unsigned short lo, unsigned short hi) {
  return (unsigned)lo | ((unsigned)hi << 16); }
"""
# Placeholder m is the half2 (32 + (m >> 10) / 32, 32 + (m & 1023) / 32): both halves in [32, 64),
# non-zero and finite, one bit pattern per HFMA2 slot, far above any integer constant of the kernel.
PLACEHOLDER_HALF_BASE = 0x5000
MAX_PLACEHOLDERS = 1 << 20


def placeholder_bits(count: int) -> np.ndarray:
    """(count,) uint32: the placeholder half2 weight of each HFMA2 slot (low half varies fastest)."""
    if count > MAX_PLACEHOLDERS:
        raise ValueError(f"at most {MAX_PLACEHOLDERS} half2 placeholders, asked for {count}")
    return _placeholder(np.arange(count, dtype=np.uint32))


def _placeholder(slot):
    """Placeholder bits of HFMA2 slot(s) `slot` (int or uint32 array)."""
    return ((PLACEHOLDER_HALF_BASE + (slot >> 10)) << 16) | (PLACEHOLDER_HALF_BASE + (slot & 0x3FF))


def broadcast_bits(weights: np.ndarray) -> np.ndarray:
    """uint32 half2 bit patterns with each float32 weight (exact in fp16) in both halves."""
    halves = np.ascontiguousarray(weights, dtype=np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    return (halves << 16) | halves


def slot_weight_bits(plan: KernelPlan, weight_slice: np.ndarray) -> np.ndarray:
    """(template_fmas,) uint32: the real half2 weight of each HFMA2 slot (template.py's slot order)."""
    return np.repeat(broadcast_bits(weight_slice.reshape(-1)), plan.pixels)


class Half2Generator(Generator):
    """template.Generator with HFMA2 terms, packed lanes and fp32 flushes (module docstring)."""

    word = "unsigned"

    def __init__(self, plan: KernelPlan, weights: Optional[np.ndarray]):
        super().__init__(plan, weights)
        self.bits = None if self.weights is None else broadcast_bits(self.weights)
        self.dirty: Set[int] = set()  # channels of the group whose partial holds a term since its flush
        self.lane_offset = plan.lane_rows * plan.spec.stride[0]  # input rows from lane 0 to lane 1

    def _helpers(self) -> None:
        self._line(HALF_HELPERS + HALF2_HELPERS)

    def _staging_position(self, l: int) -> None:
        super()._staging_position(l)
        s = self.spec
        row = f"ih{l} + {self.lane_offset}"
        self._line(f"  const bool okb{l} = sok{l} && {row} >= 0 && {row} < {s.H} && iw{l} >= 0 && iw{l} < {s.W};")
        self._line(f"  const int goffb{l} = okb{l} ? ({row}) * {s.W} + iw{l} : 0;")

    def _row_guards(self) -> None:
        super()._row_guards()
        c, p = self.cfg, self.plan
        for i in range(c.bh):
            self._line(f"  const bool rokb{i} = p0 + threadIdx.y * {c.bh} + {i} + {p.lane_rows} < {self.spec.P};")

    def _init_accumulators(self, kk: int) -> None:
        self.dirty.discard(kk)
        for t, i, j in self._pixels():
            name = f"{kk}_{t}_{i}_{j}"
            self._line(f"  float f{name}_0 = b{kk}, f{name}_1 = b{kk};")
            self._line(f"  unsigned a{name} = {NEG_ZERO_HALF2:#010x}u;")

    def _staged_type(self) -> str:
        return self.word

    def _staged_word(self, name: str) -> str:
        return name

    def _staged_load(self, t: int, offset: int, l: int) -> str:
        low = f"(ok{l} && nok{t}) ? __ldg(xb + {offset} + goff{l}) : (unsigned short)0"
        high = f"(okb{l} && nok{t}) ? __ldg(xb + {offset} + goffb{l}) : (unsigned short)0"
        return f"pack2({low}, {high})"

    def _channel(self, g: int, ch: int, cl: int, buffer: int) -> None:
        """The HFMA2s of channel `ch` in (r, s) steps, flushing after every `flush_terms`-th step."""
        s = self.spec
        sh, steps = s.stride[0], s.R * s.S
        by_step: Dict[int, List[Tuple[int, int]]] = {}
        for kk, r, col, flat in self._weights_of(g, ch):
            by_step.setdefault(r * s.S + col, []).append((kk, flat))
        flushes = {step for step in range(steps) if self._flushes_after(ch * steps + step)}
        if not by_step and not (flushes and self.dirty):
            return
        self._line(f"  {{  // c = {ch}")
        self._window_loads(cl, buffer, {divmod(step, s.S) for step in by_step})
        for step in range(steps):
            r, col = divmod(step, s.S)
            for kk, flat in by_step.get(step, ()):
                for n, (t, i, j) in enumerate(self._pixels()):
                    acc = f"a{kk}_{t}_{i}_{j}"
                    self._line(f"    {acc} = hfma2(v{t}_{i * sh + r}_{j}_{col}, {self._literal(flat, n)}, {acc});")
                self.dirty.add(kk)
            if step in flushes:
                self._flush()
        self._line("  }")

    def _flushes_after(self, term: int) -> bool:
        """True if the partials are flushed after (c, r, s) term `term` (not after the last: the
        epilogue flushes that one)."""
        every = self.plan.flush_terms
        return bool(every) and (term + 1) % every == 0 and term + 1 < self.spec.C * self.spec.R * self.spec.S

    def _flush(self) -> None:
        for kk in sorted(self.dirty):
            for t, i, j in self._pixels():
                name = f"{kk}_{t}_{i}_{j}"
                self._line(f"    flush2(f{name}_0, f{name}_1, a{name}); a{name} = {NEG_ZERO_HALF2:#010x}u;")
        self.dirty.clear()

    def _literal(self, flat: int, pixel: int) -> str:
        if self.bits is None:
            return f"{_placeholder(flat * self.plan.pixels + pixel):#010x}u"
        return f"{int(self.bits[flat]):#010x}u"

    def _epilogue(self) -> None:
        p, s, c = self.plan, self.spec, self.cfg
        pq = s.P * s.Q
        self._line(f"  unsigned short* __restrict__ yb = y + ((long long)n0 * {s.K} + kb) * {pq}"
                   f" + (p0 + threadIdx.y * {c.bh}) * {s.Q} + q0 + threadIdx.x;")
        for kk in range(c.bk):
            if kk in self.dirty:
                for t, i, j in self._pixels():
                    name = f"{kk}_{t}_{i}_{j}"
                    self._line(f"  flush2(f{name}_0, f{name}_1, a{name});")
            self._line(f"  if (kb + {kk} < {s.K}) {{")
            for t, i, j in self._pixels():
                name = f"{kk}_{t}_{i}_{j}"
                offset = (t * s.K + kk) * pq + i * s.Q + j * c.tx
                for lane, guard, lane_offset in ((0, f"rok{i}", 0), (1, f"rokb{i}", p.lane_rows * s.Q)):
                    value = f"f{name}_{lane}"
                    if p.relu:
                        value = f"fmaxf({value}, 0.f)"
                    self._line(f"    if (nok{t} && {guard} && cok{j}) yb[{offset + lane_offset}] = f2h({value});")
            self._line("  }")
        self.dirty.clear()
