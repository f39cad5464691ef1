"""Tiling of the generated kernels: `CodegenConfig` (what a user or the autotuner picks), `KernelPlan`
(a config resolved for one layer shape and dtype), and the candidate configs per layer and dtype.

Work split (template.py says how the code does it). One kernel ("slice") computes `slice_k` output
channels, split into `groups` of `bk`. A block computes a (ty*bh) x (tx*bw) tile of output pixels
for `bn` images and one group of `bk` channels; each thread computes bn x bh x bw x bk outputs.

float16 has two accumulation modes (`CodegenConfig.accumulate`):
  "float" (the default): inputs converted to fp32 as they are staged, FFMA with fp32 immediates
    (the half-rounded weights), fp32 accumulators, one rounding to half at the store: the fp32
    kernel with half loads and stores, as accurate as cuDNN fp16 (which accumulates in fp32).
  "half2": HFMA2, each instruction computing two outputs that share the weight (both halves of the
    immediate are the weight): output row p (lane 0) and row p + ceil(P/2) (lane 1) of the same
    image, column and channel. The lanes are the top and bottom halves of the output, so a block
    stages one 32-bit word (two halves) per input position, loads each window value once for both
    lanes, and a zero weight deletes one whole HFMA2. Pairing images instead would waste half of
    every instruction at batch 1; pairing two channels (one input, two weights) could delete an
    HFMA2 only when both weights are zero (19% of pairs kept at 90% sparsity, not 10%).
    The sum runs in half2 partial sums of about `half_terms` non-zero terms each, added into fp32
    accumulators between partials.
Trade-off (the generated kernels run on the CPU with HFMA2's rounding, tests/codegen_helpers.py;
error relative to the exact result rounded to half once, which is what cuDNN's fp32 accumulation
gives): one half2 sum over a whole reduction grows like sqrt(non-zero terms) times worse (11.8x
at 288 terms), far outside the project's 2x; partials of 1, 2, 4 and 6 terms give 1.4-1.6x,
1.5-1.7x, 1.6-2.0x and 1.8-2.1x. A flush costs 4 instructions per HFMA2 accumulator (2 conversions, 2
FADD), so at half_terms=2 an output pair costs 2 HFMA2 + 4 per 2 terms against 4 FFMA, and at 4
terms the two break even: within the tolerance HFMA2 saves shared-memory loads and window
registers (one 32-bit word holds both lanes), not FMA-pipe instructions. Hence "float" by default
and "half2" (half_terms=2) as an autotuning candidate; half_terms=0 (one partial per output, twice
the FFMA rate) is there for users who accept the error.
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple, Union

import torch

from sparsecnn.core import device
from sparsecnn.core.checks import config_from_dict
from sparsecnn.core.spec import ConvSpec

MODES = ("rewrite", "emit")
ACCUMULATE = ("float", "half2")
DTYPES = {"float32": torch.float32, "float16": torch.float16}
SMEM_BYTES_MAX = 48 * 1024  # static shared memory per block
MAX_STAGE_REGS = 32  # prefetch registers per thread for one chunk (on top of the accumulators)
MAX_ACCUMULATOR_REGS = 128  # per thread; beyond this the accumulators alone spill
DEFAULT_MAX_KERNEL_FMAS = 40_000  # template FMAs per kernel: bounds nvcc time per slice
BLOCKS_PER_SM = 2  # what the default tiling aims for: two blocks per SM (264 on a 132-SM H100/H200)
MAX_BLOCKS_BOUND = 8  # largest __launch_bounds__ min-blocks the defaults ask for
HALF2_FLUSH_REGS = 3  # a flushed HFMA2 accumulator: its half2 partial + one fp32 sum per lane
DEFAULT_HALF_TERMS = 2


def target_blocks(props=None) -> int:
    """Blocks the default tiling aims for on `props` (`device.resolve`: None is the current GPU,
    an H100 without one): `BLOCKS_PER_SM` per SM."""
    return BLOCKS_PER_SM * device.resolve(props).sm_count


def dtype_name(dtype: Union[torch.dtype, str]) -> str:
    """"float32" or "float16" for a torch dtype or one of those names; ValueError otherwise."""
    for name, torch_dtype in DTYPES.items():
        if dtype in (name, torch_dtype):
            return name
    raise ValueError(f"codegen runs float32 or float16, got dtype {dtype!r}")


@dataclasses.dataclass(frozen=True)
class CodegenConfig:
    """Tiling of the generated kernel. Validated on construction (ValueError names the field).

    bh, bw, bn, bk: output rows, columns, images and channels per thread (with accumulate="half2"
      each of the bh rows is a pair of rows, one per half of the output);
    tx, ty: threads per block along output columns and rows (tx * ty a multiple of 32);
    chunk_c: input channels per shared-memory stage (0: as many as fit);
    slice_k: output channels per kernel, a multiple of bk (0: as many as the unroll cap allows);
    min_blocks: blocks per SM ptxas must fit in registers (__launch_bounds__; 0: no bound);
    mode: "rewrite" (PTX template + Algorithm 2) or "emit" (CUDA C with only the non-zero terms);
    accumulate: "float" (fp32 FFMA; the only choice for float32) or "half2" (float16 only: HFMA2);
    half_terms: with "half2", the non-zero terms expected per half2 partial sum before it is added
      into fp32 (0: the whole sum in half2); see the module docstring for the trade-off.
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
    accumulate: str = "float"
    half_terms: int = DEFAULT_HALF_TERMS

    def __post_init__(self):
        for name in ("bh", "bw", "bn", "bk", "tx", "ty"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CodegenConfig.{name} must be a positive int, got {value!r}")
        for name in ("chunk_c", "slice_k", "min_blocks", "half_terms"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CodegenConfig.{name} must be an int >= 0, got {value!r}")
        threads = self.tx * self.ty
        if threads % 32 or threads > 1024:
            raise ValueError(f"CodegenConfig.tx * ty must be a multiple of 32 and <= 1024, got {threads}")
        if self.mode not in MODES:
            raise ValueError(f"CodegenConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.accumulate not in ACCUMULATE:
            raise ValueError(f"CodegenConfig.accumulate must be one of {ACCUMULATE}, got {self.accumulate!r}")
        if self.accumulator_regs > MAX_ACCUMULATOR_REGS:
            raise ValueError(f"CodegenConfig.bk: bn*bh*bw*bk = {self.accumulators} accumulators per thread take "
                             f"{self.accumulator_regs} registers, over {MAX_ACCUMULATOR_REGS}")
        if self.slice_k % self.bk:
            raise ValueError(f"CodegenConfig.slice_k={self.slice_k} must be a multiple of bk={self.bk}")

    @property
    def accumulators(self) -> int:
        """Accumulator registers' count per thread: outputs (float) or output pairs (half2)."""
        return self.bn * self.bh * self.bw * self.bk

    @property
    def accumulator_regs(self) -> int:
        flushed = self.accumulate == "half2" and self.half_terms > 0
        return self.accumulators * (HALF2_FLUSH_REGS if flushed else 1)

    @classmethod
    def from_dict(cls, saved: dict) -> "CodegenConfig":
        """Rebuild from `dataclasses.asdict` output (unknown keys are an error)."""
        return config_from_dict(cls, saved)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One layer shape (any batch), dtype and config resolved into the numbers the generator uses."""

    spec: ConvSpec
    config: CodegenConfig
    relu: bool
    has_bias: bool
    slice_k: int
    chunk_c: int
    stage_slots: int  # staged plane positions per thread
    dtype: str = "float32"  # "float32" or "float16": x, bias and y
    flush_terms: int = 0  # half2: (c, r, s) template terms per half2 partial sum (0: one partial)

    @property
    def half2(self) -> bool:
        return self.config.accumulate == "half2"

    @property
    def lanes(self) -> int:
        """Outputs per FMA instruction."""
        return 2 if self.half2 else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def lane_rows(self) -> int:
        """Output rows of lane 0: half2 lane 1 computes row p + lane_rows for each lane-0 row p."""
        return -(-self.spec.P // 2) if self.half2 else self.spec.P

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
        """Output rows (of one lane) and columns of one block."""
        return self.config.ty * self.config.bh, self.config.tx * self.config.bw

    @property
    def tiles(self) -> Tuple[int, int]:
        (tp, tq), spec = self.tile, self.spec
        return -(-self.lane_rows // tp), -(-spec.Q // tq)

    @property
    def in_tile(self) -> Tuple[int, int]:
        """Input rows and columns (with halo) staged for one block (per lane)."""
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
    def buffer_words(self) -> int:
        """32-bit words of one stage: a float, or a half2 of both lanes, per position."""
        return self.config.bn * self.chunk_c * self.plane

    @property
    def smem_bytes(self) -> int:
        return 4 * self.buffer_words * (2 if len(self.chunks) > 1 else 1)

    @property
    def pixels(self) -> int:
        """FMA instructions per thread per weight (each HFMA2 covers two outputs)."""
        return self.config.bn * self.config.bh * self.config.bw

    @property
    def template_fmas(self) -> int:
        """FMAs (or HFMA2s) of one kernel's unrolled template (all threads run the same count)."""
        spec = self.spec
        return self.slice_k * spec.C * spec.R * spec.S * self.pixels

    def grid(self, n_batch: int) -> Tuple[int, int, int]:
        tiles_p, tiles_q = self.tiles
        return tiles_p * tiles_q * self.groups, -(-n_batch // self.config.bn), 1

    def block(self) -> Tuple[int, int, int]:
        return self.config.tx, self.config.ty, 1


def make_plan(spec: ConvSpec, config: CodegenConfig, relu: bool = False, has_bias: bool = True,
              max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS, dtype: Union[torch.dtype, str] = torch.float32,
              density: float = 1.0) -> KernelPlan:
    """Resolve `slice_k` and `chunk_c` for `spec` (groups 1, dilation 1); ValueError if it cannot fit.

    density: fraction of non-zero weights; with accumulate="half2" it sets how many (c, r, s) terms a
    half2 partial sum spans (`flush_terms`), so that about `half_terms` of them are non-zero.
    """
    name = dtype_name(dtype)
    if spec.groups != 1 or spec.dilation != (1, 1):
        raise ValueError(f"codegen needs groups=1 and dilation=1, got groups={spec.groups}, "
                         f"dilation={spec.dilation}")
    if config.accumulate == "half2" and name != "float16":
        raise ValueError(f"CodegenConfig.accumulate='half2' needs float16, got {name}")
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density!r}")
    per_channel = spec.C * spec.R * spec.S * config.bn * config.bh * config.bw
    slice_k = config.slice_k or _auto_slice_k(spec.K, config.bk, per_channel, max_kernel_fmas)
    probe = KernelPlan(spec, config, relu, has_bias, slice_k, 1, 0, name, _flush_terms(spec, config, density))
    stage_slots = -(-probe.plane // probe.threads)
    chunk_c = config.chunk_c or _auto_chunk_c(spec.C, config.bn, probe.plane, stage_slots * probe.lanes)
    plan = dataclasses.replace(probe, chunk_c=min(chunk_c, spec.C), stage_slots=stage_slots)
    if plan.smem_bytes > SMEM_BYTES_MAX:
        raise ValueError(f"input tile {plan.in_tile} x {plan.chunk_c} channels x {config.bn} images needs "
                         f"{plan.smem_bytes} B of shared memory (> {SMEM_BYTES_MAX}); use a smaller tile")
    if plan.template_fmas > max_kernel_fmas:
        raise ValueError(f"{plan.template_fmas} unrolled FMAs per kernel exceed the cap of {max_kernel_fmas} "
                         f"(bk * C*R*S * bn*bh*bw = {config.bk} * {spec.C * spec.R * spec.S} * {plan.pixels} "
                         "per group); lower bk, bh, bw or bn")
    return plan


def _flush_terms(spec: ConvSpec, config: CodegenConfig, density: float) -> int:
    """(c, r, s) terms per half2 partial: about half_terms / density; 0 when one partial holds the
    whole sum (float accumulation, half_terms 0, or a short or empty sum)."""
    terms = spec.C * spec.R * spec.S
    if config.accumulate != "half2" or config.half_terms == 0 or density * terms <= config.half_terms:
        return 0
    span = max(1, round(config.half_terms / density))
    return span if span < terms else 0


def candidate_configs(spec: ConvSpec, dtype: Union[torch.dtype, str] = torch.float32,
                      max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS, props=None) -> List[CodegenConfig]:
    """3-6 valid configs for `spec` at `dtype`, the expected fastest (`default_config`) first: then
    without the register bound (float16: the HFMA2 kernel instead), twice the rows per thread, half
    the channels per thread, and emit mode. props: the GPU sized for (`target_blocks`)."""
    name = dtype_name(dtype)
    default = default_config(spec, max_kernel_fmas, props=props)
    variants = [default, dataclasses.replace(default, min_blocks=0),
                _bounded(dataclasses.replace(default, bh=default.bh * 2)),
                _bounded(dataclasses.replace(default, bk=-(-default.bk // 2))),
                dataclasses.replace(default, mode="emit")]
    if name == "float16":
        variants[1] = default_config(spec, max_kernel_fmas, "half2", props)
    configs: List[CodegenConfig] = []
    for config in variants:
        if config in configs or config.accumulator_regs > MAX_ACCUMULATOR_REGS:
            continue
        try:
            make_plan(spec, config, max_kernel_fmas=max_kernel_fmas, dtype=name)
        except ValueError:
            continue
        configs.append(config)
    return configs


def _bounded(config: CodegenConfig) -> CodegenConfig:
    """`config` with min_blocks such that ptxas keeps to ~accumulator registers + 96 (room for
    the input window, prefetch and addresses: at + 64 resnet-conv1 already spills), so several
    blocks share an SM and one block's barrier or staging latency is hidden by another's FMAs.

    half2 kernels get no bound: each flush starts independent half2 chains, which ptxas 13.0
    schedules up to whatever register cap it is given and then spills (resnet-conv1: 255 registers
    and 336 B of spills at min_blocks 2, 194 registers and none unbounded; alexnet-conv2: 352 B at
    min_blocks 6, none at 115 registers unbounded)."""
    if config.accumulate == "half2":
        return dataclasses.replace(config, min_blocks=0)
    blocks = min(MAX_BLOCKS_BOUND, 65536 // (config.tx * config.ty * (config.accumulator_regs + 96)))
    return dataclasses.replace(config, min_blocks=blocks if blocks >= 2 else 0)


def default_config(spec: ConvSpec, max_kernel_fmas: int = DEFAULT_MAX_KERNEL_FMAS,
                   accumulate: str = "float", props=None) -> CodegenConfig:
    """The tiling expected fastest on an H100/H200 for `accumulate` (float32 and float16 both
    default to "float": see the module docstring for why HFMA2 is not expected to win).

    All K channels of a pixel in one thread when possible (bk up to 64 accumulators): each input
    loaded from shared memory feeds bk * R * density FMAs per row it touches (>= 4 FMAs per load at
    90% keeps the FMA pipe, not shared memory, the limit). Extra rows per thread (bh) add window
    reuse while all K still fits in one kernel under the unroll cap, within the accumulator
    registers (64, or ~96 for flushed HFMA2 accumulators). Then, while the grid would leave SMs
    idle (small batch: fewer than `target_blocks(props)`), fewer channels per thread (more
    groups) and narrower tiles.
    """
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    half2 = accumulate == "half2"
    # half2: 3 registers per accumulator, and room for the R x S window of half2 words
    max_accumulators = 64
    if half2:
        max_accumulators = min(32, max(8, (MAX_ACCUMULATOR_REGS - spec.R * spec.S) // HALF2_FLUSH_REGS))
    rows = -(-spec.P // 2) if half2 else spec.P
    crs = spec.C * spec.R * spec.S
    tx = 32 if spec.Q > 16 else 16 if spec.Q > 8 else 8
    ty = 128 // tx
    while ty > 1 and ty >= 2 * rows and (tx * ty // 2) % 32 == 0:
        ty //= 2  # a block taller than twice the output only idles threads
    # K is split into equal groups of bk; one group's template must fit the unroll cap.
    n_groups = max(-(-spec.K // max_accumulators), -(-spec.K * crs // max_kernel_fmas))
    bk = -(-spec.K // n_groups)
    bh = 1
    while bh < 4 and bk * bh * 2 <= max_accumulators and spec.K * crs * bh * 2 <= max_kernel_fmas \
            and rows >= ty * bh * 2:
        bh *= 2
    config = CodegenConfig(bh=bh, bk=bk, tx=tx, ty=ty, accumulate=accumulate)
    wanted = target_blocks(props)
    while _blocks(spec, config, rows) < wanted:
        if config.bk > 8:
            n_groups *= 2
            config = dataclasses.replace(config, bk=-(-spec.K // n_groups))
        elif config.tx > 8 and config.tx * config.ty > 64:
            config = dataclasses.replace(config, tx=config.tx // 2)
        else:
            break
    return _bounded(config)


def _blocks(spec: ConvSpec, config: CodegenConfig, rows: int) -> int:
    """Blocks of one kernel of all-K size (what the GPU has to spread over its SMs)."""
    tiles = -(-rows // (config.ty * config.bh)) * -(-spec.Q // (config.tx * config.bw))
    return tiles * -(-spec.N // config.bn) * -(-spec.K // config.bk)


def _auto_slice_k(k: int, bk: int, per_channel: int, max_kernel_fmas: int) -> int:
    """Fewest equal slices (multiples of bk) whose template stays within `max_kernel_fmas`."""
    k_padded = -(-k // bk) * bk
    fit = max(bk, max_kernel_fmas // per_channel // bk * bk)
    n_slices = -(-k_padded // fit)
    per_slice = -(-k_padded // n_slices)
    return -(-per_slice // bk) * bk


def _auto_chunk_c(c: int, bn: int, plane: int, stage_slots: int) -> int:
    """Most channels per stage within the shared-memory and prefetch-register budgets, balanced
    (stage_slots: prefetch registers per staged channel and image: half2 loads two lanes)."""
    by_smem = SMEM_BYTES_MAX // (2 * 4 * bn * plane)
    by_regs = MAX_STAGE_REGS // (bn * stage_slots)
    if c * bn * plane * 4 <= SMEM_BYTES_MAX and c * bn * stage_slots <= MAX_STAGE_REGS:
        return c  # one stage, one buffer
    chunk = max(1, min(by_smem, by_regs))
    n_chunks = -(-c // chunk)
    return -(-c // n_chunks)
