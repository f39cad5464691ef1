"""Algorithm 2 of paper 002: the PTX of one sparse weight, from the placeholder template.

valueMap (`value_map`) sends each placeholder weight (float32 bits) to the real weight. One pass
over the PTX: an FMA whose weight is a placeholder gets the real weight as an immediate; when the
real weight is zero the FMA is deleted and regMap records that its destination equals its addend
(`%f3 -> %f2` in the paper's Figure 4). Every later source operand, in any instruction (the next
FMA of the chain, max for ReLU, st.global), is read through regMap, so a chain of deleted FMAs
resolves to the last kept value, or to the chain's start (the bias register, or the
`mov.f32 %f, 0f00000000` of a chain without bias).

nvcc 13 rarely puts constants in FMAs itself: it materialises each with `mov.f32 %fP, 0f...` and
the FMA reads %fP. Such movs of a placeholder are dropped and the weight folded into the FMA as an
immediate (ptxas would fold it anyway). Chains that start from a constant are handled too: a
zero-weight FMA whose addend is an immediate becomes `mov.f32 %fD, <addend>`, and a zero-weight
`mul.f32` becomes `mov.f32 %fD, 0f00000000`.

HFMA2 (`fma.rn.f16x2`, half2.py): PTX has no f16x2 immediates, so the weight is always a register
set by `mov.u32 %rW, <placeholder as an integer>`. That mov is dropped; a kept HFMA2 gets
`mov.b32 %rW, 0x<real half2>` right before it (ptxas folds it into the instruction's immediate), a
deleted one is forwarded like an FMA. Deleting every HFMA2 of a half2 partial sum leaves the
partial at its start value -0 (both halves); the rewrite tracks registers known to hold -0 through
the partial's unpack (`mov.b32 {%rsL, %rsH}, %r`) and conversion (`cvt.f32.f16`) and deletes each
`add.f32 %fD, %fA, <-0>`, forwarding %fD to %fA (x + -0 == x for every x, so this is exact; ptxas
would keep those adds).

The rewrite is only sound if a register that regMap forwards to is never redefined while the
mapping is live (PTX from straight-line code is SSA); that is checked, as is that every
placeholder is used once, by one FMA or mul, as its weight operand.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Dict, List, Mapping, Optional, Tuple

_IMMEDIATE = re.compile(r"^0[fF]([0-9A-Fa-f]{8})$")
_INTEGER = re.compile(r"^(-?)(0[xX][0-9A-Fa-f]+|0[0-7]*|[1-9][0-9]*)[uU]?$")
_INTEGER_MOVS = ("mov.u32", "mov.b32", "mov.s32")
_EXACT_ADDS = ("add.f32", "add.rn.f32")  # no .ftz/.sat: x + -0 is x only then
NEGATIVE_ZERO = {"f32": 0x80000000, "f16": 0x8000, "f16x2": 0x80008000}
_INSTRUCTION = re.compile(r"^(\s*)(@!?%[\w$]+\s+)?([A-Za-z][\w.]*)(?:(\s+)(.*?))?\s*;\s*(//.*)?$")
_REGISTER = re.compile(r"%[A-Za-z_$][\w$]*")
# Instructions without a destination operand (the first operand of st/red is an address).
_NO_DESTINATION = ("st.", "st ", "red.", "bar", "bra", "ret", "exit", "membar", "fence", "prefetch", "trap")


class RewriteError(ValueError):
    """The template does not have the shape the rewrite relies on (or does not match the value map)."""


@dataclasses.dataclass
class RewriteStats:
    """Counts of one rewrite: FMAs (or muls) carrying a placeholder, how many were deleted (weight 0:
    forwarded to their addend, or replaced by a constant mov) and kept (real weight substituted)."""

    fmas: int = 0
    deleted: int = 0
    kept: int = 0
    forwarded: int = 0  # deletions handled by regMap (the rest became a constant mov)
    zero_adds: int = 0  # add.f32 of a known -0 deleted (flushes of fully deleted half2 partials)
    seconds: float = 0.0


@dataclasses.dataclass
class _Instruction:
    indent: str
    predicate: str
    opcode: str
    separator: str
    operands: List[str]

    def render(self) -> str:
        if not self.operands:
            return f"{self.indent}{self.predicate}{self.opcode};"
        return f"{self.indent}{self.predicate}{self.opcode}{self.separator or ' '}{', '.join(self.operands)};"

    @property
    def destinations(self) -> List[str]:
        if not self.operands or self.opcode.startswith(_NO_DESTINATION):
            return []
        return _REGISTER.findall(self.operands[0])


def _parse(line: str) -> Optional[_Instruction]:
    """An instruction line, or None for directives, labels, braces, comments and blank lines."""
    stripped = line.strip()
    if not stripped or stripped[0] in "./{}" or stripped.endswith(":"):
        return None
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    indent, predicate, opcode, separator, operands, _ = match.groups()
    return _Instruction(indent, predicate or "", opcode, separator or "", _split_operands(operands or ""))


def _split_operands(text: str) -> List[str]:
    """Split at commas outside {...} and [...] (addresses never hold commas; vectors do)."""
    if "{" not in text:
        return [part.strip() for part in text.split(",")] if text else []
    parts, depth, current = [], 0, []
    for char in text:
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if current or parts:
        parts.append("".join(current).strip())
    return parts


def immediate_bits(operand: str) -> Optional[int]:
    """The float32 bits of a PTX immediate `0fXXXXXXXX`, else None."""
    match = _IMMEDIATE.match(operand)
    return int(match.group(1), 16) if match else None


def integer_bits(operand: str) -> Optional[int]:
    """The 32-bit pattern of a PTX integer immediate (decimal, 0x hex, 0 octal, maybe negative), else None."""
    match = _INTEGER.match(operand)
    if match is None:
        return None
    sign, digits = match.groups()
    base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") and len(digits) > 1 else 10
    value = int(digits, base)
    return (-value if sign else value) & 0xFFFFFFFF


def immediate(bits: int) -> str:
    return f"0f{bits & 0xFFFFFFFF:08X}"


def _is_weighted(opcode: str) -> bool:
    """fma/mul on f32, fma on f16x2: the instructions a placeholder weight may feed."""
    if opcode.endswith(".f32"):
        return opcode.startswith("fma.") or opcode.startswith("mul.")
    return opcode.endswith(".f16x2") and opcode.startswith("fma.")


def _constant_bits(inst: _Instruction) -> Optional[int]:
    """The bits a `mov.f32 %f, 0f...` or `mov.{u,b,s}32 %r, <integer>` puts in its register, else None."""
    if len(inst.operands) != 2:
        return None
    if inst.opcode == "mov.f32":
        return immediate_bits(inst.operands[1])
    if inst.opcode in _INTEGER_MOVS:
        return integer_bits(inst.operands[1])
    return None


def _placeholder_mov(inst: _Instruction, placeholders) -> Optional[int]:
    """The placeholder bits of a `mov.f32 %fP, 0f<placeholder>` or `mov.u32 %rP, <placeholder>`, else None."""
    bits = _constant_bits(inst)
    return bits if bits is not None and bits in placeholders else None


def _placeholder_operand(operand: str, placeholders) -> Optional[int]:
    """The placeholder bits of an immediate operand (float or integer form), else None."""
    bits = immediate_bits(operand)
    if bits is None:
        bits = integer_bits(operand)
    return bits if bits is not None and bits in placeholders else None


def placeholder_sites(ptx: str, placeholders) -> Dict[int, int]:
    """{placeholder bits: number of FMA/mul weight operands it feeds} over the whole PTX.

    A placeholder may appear as an immediate weight operand, or in a `mov.f32` / `mov.u32` whose
    register is then a weight operand. RewriteError if one appears anywhere else (an addend, a store, an
    unrelated instruction): the rewrite could not account for it.
    """
    registers: Dict[str, int] = {}  # defined before use: the code has no loops
    sites: Dict[int, int] = {}
    for number, line in enumerate(ptx.splitlines(), 1):
        inst = _parse(line)
        if inst is None:
            continue
        held = _placeholder_mov(inst, placeholders)
        if held is not None:
            registers[inst.operands[0]] = held
            continue
        weight_slots = (1, 2) if _is_weighted(inst.opcode) else ()
        for position, operand in enumerate(inst.operands):
            bits = _placeholder_operand(operand, placeholders)
            if bits is None:
                for register in _REGISTER.findall(operand):
                    if register in registers and position != 0:
                        bits = registers[register]
            if bits is None:
                continue
            if position not in weight_slots:
                raise RewriteError(f"PTX line {number}: placeholder {immediate(bits)} used outside an FMA "
                                   f"weight operand: {line.strip()}")
            sites[bits] = sites.get(bits, 0) + 1
    return sites


class _Rewriter:
    def __init__(self, value_map: Mapping[int, int]):
        self.value_map = value_map
        self.registers: Dict[str, int] = {}  # placeholder movs (dropped, folded into their FMA)
        self.reg_map: Dict[str, str] = {}  # deleted FMA's destination -> the register holding its value
        self.targets: Dict[str, int] = {}  # register -> live regMap entries pointing at it
        self.constants: Dict[str, int] = {}  # register -> the bits it is known to hold
        self.seen: Dict[int, int] = {}
        self.stats = RewriteStats()

    def line(self, line: str) -> Optional[str]:
        """The rewritten line(s), or None when it is deleted."""
        inst = _parse(line)
        if inst is None:
            return line
        held = _placeholder_mov(inst, self.value_map)
        if held is not None:
            self.registers[inst.operands[0]] = held
            return None  # the placeholder is folded into its FMA
        weight = self._weight_position(inst)
        changed = self._forward_sources(inst, skip=weight)
        if weight is not None:
            return self._weighted(inst, weight)
        kept = self._operand_besides_negative_zero(inst)
        if kept is not None:
            self._forward(inst, kept)
            self.stats.zero_adds += 1
            return None
        self._define(inst)
        self._track_constants(inst)
        return inst.render() if changed else line

    def _weight_position(self, inst: _Instruction) -> Optional[int]:
        if not _is_weighted(inst.opcode) or len(inst.operands) < 3:
            return None
        for position in (1, 2):
            operand = inst.operands[position]
            if _placeholder_operand(operand, self.value_map) is not None or operand in self.registers:
                return position
        return None

    def _forward_sources(self, inst: _Instruction, skip: Optional[int]) -> bool:
        """Read every source operand but the weight (`skip`) through regMap; True if one changed."""
        first = 0 if inst.opcode.startswith(_NO_DESTINATION) else 1
        changed = False
        for position in range(first, len(inst.operands)):
            operand = inst.operands[position]
            if "%" not in operand or position == skip:
                continue
            if self.registers and any(r in self.registers for r in _REGISTER.findall(operand)):
                raise RewriteError(f"placeholder register read outside a weight operand: {inst.render().strip()}")
            new = _REGISTER.sub(lambda m: self.reg_map.get(m.group(0), m.group(0)), operand)
            if new != operand:
                inst.operands[position] = new
                changed = True
        return changed

    def _define(self, inst: _Instruction) -> None:
        for register in inst.destinations:
            if self.targets.get(register):
                raise RewriteError(f"register {register} is redefined while forwarded to (PTX not in SSA form): "
                                   f"{inst.render().strip()}")
            old = self.reg_map.pop(register, None)  # Algorithm 2: a redefinition ends the forwarding
            if old is not None:
                self.targets[old] -= 1
            self.constants.pop(register, None)

    def _forward(self, inst: _Instruction, source: str) -> None:
        """Delete `inst`: later reads of its destination read `source` (already resolved)."""
        destination = inst.operands[0]
        self._define(inst)
        self.reg_map[destination] = source
        self.targets[source] = self.targets.get(source, 0) + 1

    def _track_constants(self, inst: _Instruction) -> None:
        """Follow the -0 of a fully deleted half2 partial: constant movs, the unpack of a half2 into
        two halves, and the conversion of a half to f32."""
        bits = _constant_bits(inst)
        if bits is None and inst.opcode in ("mov.b16", "mov.u16", "mov.s16") and len(inst.operands) == 2:
            bits = integer_bits(inst.operands[1])
            bits = None if bits is None else bits & 0xFFFF
        if bits is not None:
            self.constants[inst.operands[0]] = bits
            return
        if len(inst.operands) != 2 or inst.operands[1] not in self.constants:
            return
        source = self.constants[inst.operands[1]]
        halves = inst.destinations
        if inst.opcode == "mov.b32" and inst.operands[0].startswith("{") and len(halves) == 2:
            self.constants[halves[0]], self.constants[halves[1]] = source & 0xFFFF, source >> 16
        elif inst.opcode == "cvt.f32.f16" and source == NEGATIVE_ZERO["f16"]:
            self.constants[inst.operands[0]] = NEGATIVE_ZERO["f32"]

    def _operand_besides_negative_zero(self, inst: _Instruction) -> Optional[str]:
        """For `add.f32 %d, %a, %b` with %b (or %a) known to be -0: %a (or %b), the value of %d."""
        if inst.opcode not in _EXACT_ADDS or inst.predicate or len(inst.operands) != 3:
            return None
        first, second = inst.operands[1], inst.operands[2]
        for zero, other in ((second, first), (first, second)):
            bits = self.constants.get(zero, immediate_bits(zero))
            if bits == NEGATIVE_ZERO["f32"] and _REGISTER.fullmatch(other):
                return other
        return None

    def _weighted(self, inst: _Instruction, position: int) -> Optional[str]:
        if inst.predicate:
            raise RewriteError(f"predicated weight FMA cannot be deleted safely: {inst.render().strip()}")
        operand = inst.operands[position]
        placeholder = self.registers.get(operand)
        if placeholder is None:
            placeholder = _placeholder_operand(operand, self.value_map)
        self.seen[placeholder] = self.seen.get(placeholder, 0) + 1
        real = int(self.value_map[placeholder]) & 0xFFFFFFFF
        half2 = inst.opcode.endswith(".f16x2")
        self.stats.fmas += 1
        if real & (0x7FFF7FFF if half2 else 0x7FFFFFFF):  # non-zero: substitute the weight
            self.stats.kept += 1
            self._define(inst)
            if not half2:
                inst.operands[position] = immediate(real)
                return inst.render()
            if operand not in self.registers:
                raise RewriteError(f"f16x2 weight operand is not a register: {inst.render().strip()}")
            return f"{inst.indent}mov.b32{inst.separator or ' '}{operand}, 0x{real:08X};\n{inst.render()}"
        self.stats.deleted += 1
        addend = inst.operands[3] if inst.opcode.startswith("fma.") else immediate(0)
        if _REGISTER.fullmatch(addend):
            self._forward(inst, addend)  # the addend is already resolved: no chains to follow later
            self.stats.forwarded += 1
            return None
        destination = inst.operands[0]
        self._define(inst)
        return f"{inst.indent}mov.{'b32' if half2 else 'f32'}{inst.separator or ' '}{destination}, {addend};"


def rewrite_ptx(ptx: str, value_map: Mapping[int, int]) -> Tuple[str, RewriteStats]:
    """Algorithm 2: `ptx` (the template) with every placeholder replaced by its real weight.

    value_map: {placeholder bits: real weight bits} (float32 bits, or half2 bits for HFMA2 templates),
    one entry per placeholder of the template (every placeholder must be used exactly once).
    Returns the PTX and its counts.
    """
    start = time.perf_counter()
    rewriter = _Rewriter(value_map)
    out = []
    for line in ptx.splitlines():
        new = rewriter.line(line)
        if new is not None:
            out.append(new)
    missing = len(value_map) - len(rewriter.seen)
    repeated = [bits for bits, count in rewriter.seen.items() if count != 1]
    if missing or repeated:
        raise RewriteError(f"template and value map disagree: {missing} placeholders not found, "
                           f"{len(repeated)} used more than once")
    rewriter.stats.seconds = time.perf_counter() - start
    return "\n".join(out) + "\n", rewriter.stats
