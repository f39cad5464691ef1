"""Run the unrolled kernel's PTX (`kernels/codegen/unrolled_source.py`) on the CPU.

A small interpreter of the PTX subset the writer emits, vectorised over the threads of one grid
row (blockIdx.y, the group: it selects the same function for all of them): integer address
arithmetic in int64, predicates, the exit branch (threads past the end leave), the jump table,
calls, float32 loads, FMAs (exact product and sum in float64, one rounding to float32, as
fma.rn), adds, max and stores, and the slices' shared memory (one array per block) and barrier.
The float16 kernel's ops too: f16x2 registers as uint32 bits (low half: the first image), 32-bit
loads of two float16 elements, 16-bit loads and stores, `mov.b32` of immediates and unpacking,
`mul.rn.f16x2` / `fma.rn.f16x2` per half (product and sum in float64, rounded once to float16;
exact for the product, and for the sum but where the addends' exponents are over 29 apart, far
from what the tests reach), and `cvt` between float16 and float32 (round to nearest even). A
block's warp rows (%tid.y, the slices) run one after another, slice 0 last: the writer has slices
1.. store their partial sums and reach the barrier as their last step, and slice 0 read them after
it. Buffers live at fake addresses, so every load and store checks it stays inside its buffer. An
instruction it does not know fails the test.
"""
import re

import numpy as np
import torch

from sparsecnn.backends.unrolled import kernel as unrolled
from sparsecnn.backends.unrolled import source as unrolled_source

_BASES = {"x": 1 << 40, "bias": 2 << 40, "res": 3 << 40, "y": 4 << 40, "smem": 5 << 40}


def _function_bodies(ptx: str):
    """name -> (parameter names, instruction lines) for the entry and every .func."""
    functions = {}
    for match in re.finditer(r"\.(?:func|visible \.entry) (\w+)\(([^)]*)\)[^{]*\{(.*?)\n\}", ptx, re.S):
        params = [p.split()[-1] for p in match.group(2).split(",")]
        lines = [line.strip() for line in match.group(3).split("\n")]
        functions[match.group(1)] = (params, [line for line in lines if line and not line.startswith(".reg")])
    return functions


class _Machine:
    def __init__(self, ptx: str, buffers: dict, grid_x: int, threads: int, group: int, part: int = 0,
                 shared_bytes: int = 0):
        self.functions = _function_bodies(ptx)
        self.buffers = buffers
        count = grid_x * threads
        ids = np.arange(count, dtype=np.int64)
        self.special = {"%ctaid.x": ids // threads, "%tid.x": ids % threads, "%ctaid.y": np.full(count, group),
                        "%tid.y": np.full(count, part)}
        self.shared_bytes = shared_bytes

    def value(self, regs, token):
        if token in regs:
            return regs[token]
        if token in self.special:
            return self.special[token]
        if token == unrolled_source.PARTIALS:   # this block's shared array
            return _BASES["smem"] + self.special["%ctaid.x"] * self.shared_bytes
        if token.startswith("0f"):
            return np.float32(np.frombuffer(bytes.fromhex(token[2:])[::-1], dtype=np.float32)[0])
        if token.startswith("0x"):
            return np.uint32(int(token, 16))
        return np.int64(int(token))

    def address(self, regs, operand, width=4):
        """(buffer, element index) of a `width`-byte access at `operand`, inside the buffer and aligned."""
        match = re.fullmatch(r"\[(%\w+)\+(-?\d+)\]", operand)
        addr = regs[match.group(1)] + int(match.group(2))
        for name, base in _BASES.items():
            size = self.buffers[name].itemsize
            if np.all((addr >= base) & (addr + width <= base + size * self.buffers[name].size)):
                if np.any((addr - base) % width):
                    raise AssertionError(f"unaligned access {operand}")
                return self.buffers[name], (addr - base) // size
        raise AssertionError(f"access {operand} outside every buffer")

    def run(self, name, args):
        params, lines = self.functions[name]
        regs = {}
        labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\$\w+:", line)}
        pc = 0
        while pc < len(lines):
            line = lines[pc].rstrip(";")
            pc += 1
            if line.endswith(":") or ".branchtargets" in line:
                continue
            predicate = None
            if line.startswith("@"):
                predicate, line = line.split(" ", 1)
                predicate = ~regs[predicate[2:]] if predicate.startswith("@!") else regs[predicate[1:]]
            op, _, rest = line.partition(" ")
            operands = [o.strip() for o in re.split(r",(?![^{]*\})", rest)] if rest else []
            if op == "ret":
                return
            if op in ("bra", "bra.uni"):
                if predicate is None:
                    pc = labels[operands[0]]
                elif predicate.all():
                    return
                elif predicate.any():   # the exit branch: those threads leave
                    regs = {k: (v[~predicate] if isinstance(v, np.ndarray) and v.shape else v) for k, v in regs.items()}
                    self.special = {k: v[~predicate] for k, v in self.special.items()}
                continue
            if op == "brx.idx":
                table = next(line for line in lines if line.startswith(operands[1] + ":"))
                targets = [t.strip() for t in table.split(".branchtargets")[1].rstrip(";").split(",")]
                index = np.unique(regs[operands[0]])
                assert index.size == 1, "brx.idx on a non-uniform index"
                pc = labels[targets[int(index[0])]]
                continue
            if op == "call.uni":
                callee = operands[0]
                values = [regs[a.strip("() ")] for a in rest.split(",", 1)[1].split(",")]
                self.run(callee, dict(zip(self.functions[callee][0], values)))
                continue
            self.execute(op, operands, regs, predicate, args)

    def execute(self, op, operands, regs, predicate, args):
        if predicate is not None and not predicate.any():
            return   # predicated off for every thread (no bias, residual or ReLU): touches nothing
        dest = operands[0] if operands else None
        if op.startswith("ld.param"):
            regs[dest] = args[operands[1].strip("[]")]
        elif op == "cvta.to.global.u64" or op == "mov.u32":
            regs[dest] = self.value(regs, operands[1])
        elif op == "mov.f32":
            regs[dest] = np.full(len(self.special["%tid.x"]), self.value(regs, operands[1]), dtype=np.float32)
        elif op in ("mad.lo.s32", "mul.lo.s32", "sub.s32", "add.s32", "div.s32", "mul.wide.s32", "add.s64",
                    "and.b32", "or.b32", "min.s32"):
            a, b = (self.value(regs, o) for o in operands[1:3])
            result = {"mad.lo.s32": lambda: a * b + self.value(regs, operands[3]), "mul.lo.s32": lambda: a * b,
                      "sub.s32": lambda: a - b, "add.s32": lambda: a + b, "div.s32": lambda: np.sign(a) * (abs(a) // b),
                      "mul.wide.s32": lambda: a * b, "add.s64": lambda: a + b, "and.b32": lambda: a & b,
                      "or.b32": lambda: a | b, "min.s32": lambda: np.minimum(a, b)}[op]()
            regs[dest] = np.asarray(result, dtype=np.int64)
        elif op == "selp.b32":
            a, b = (self.value(regs, o) for o in operands[1:3])
            regs[dest] = np.where(regs[operands[3]], a, b).astype(np.int64)
        elif op == "bar.sync":
            pass   # slices run in turn (see the module docstring)
        elif op.startswith("setp."):
            a, b = (self.value(regs, o) for o in operands[1:3])
            compare = {"ge": np.greater_equal, "ne": np.not_equal, "eq": np.equal, "lt": np.less}[op.split(".")[1]]
            regs[dest] = np.broadcast_to(compare(a, b), self.special["%tid.x"].shape).copy()
        elif op in ("ld.global.nc.b32", "ld.global.nc.b16", "ld.global.b16"):   # float16 buffers
            assert predicate is None or predicate.all(), "the writer predicates loads uniformly"
            assert self.buffers["x"].dtype == np.float16
            buffer, index = self.address(regs, operands[1], 4 if op.endswith("b32") else 2)
            bits = buffer.view(np.uint16)
            regs[dest] = (bits[index].astype(np.uint32) | bits[index + 1].astype(np.uint32) << 16
                          if op.endswith("b32") else bits[index].copy())
        elif op.startswith(("ld.global", "ld.shared")):
            assert predicate is None or predicate.all(), "the writer predicates loads uniformly"
            buffer, index = self.address(regs, operands[1])
            for e, name in enumerate(dest.strip("{}").split(", ")):
                regs[name] = buffer[index + e].astype(np.float32)
        elif op == "mov.b32" and dest.startswith("{"):   # unpack an f16x2: low half first
            bits = regs[operands[1]]
            low, high = dest.strip("{}").split(", ")
            regs[low], regs[high] = (bits & 0xFFFF).astype(np.uint16), (bits >> 16).astype(np.uint16)
        elif op == "mov.b32":
            regs[dest] = np.full(len(self.special["%tid.x"]), self.value(regs, operands[1]), dtype=np.uint32)
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            lanes = [_halves(self.value(regs, o)) for o in operands[1:]]
            result = []
            for lane in range(2):
                a, b, *c = (halves[lane].astype(np.float64) for halves in lanes)
                result.append((a * b + (c[0] if c else 0.0)).astype(np.float16))
            regs[dest] = _pack(*result)
        elif op == "cvt.f32.f16":
            result = regs[operands[1]].view(np.float16).astype(np.float32)
            regs[dest] = result if predicate is None else np.where(predicate, result, regs.get(dest, result))
        elif op == "cvt.rn.f16.f32":
            regs[dest] = regs[operands[1]].astype(np.float32).astype(np.float16).view(np.uint16)
        elif op == "st.global.b16":
            if predicate is not None:
                regs = {name: value[predicate] if isinstance(value, np.ndarray) and value.shape else value
                        for name, value in regs.items()}
            buffer, index = self.address(regs, operands[0], 2)
            buffer.view(np.uint16)[index] = regs[operands[1]]
        elif op == "fma.rn.f32":
            a, w, c = (self.value(regs, o) for o in operands[1:4])
            regs[dest] = (a.astype(np.float64) * np.float64(w) + c.astype(np.float64)).astype(np.float32)
        elif op in ("add.f32", "max.f32"):
            a, b = (self.value(regs, o) for o in operands[1:3])
            result = (a + b) if op == "add.f32" else np.maximum(a, b)
            regs[dest] = result.astype(np.float32) if predicate is None else np.where(predicate, result, regs[dest])
        elif op.startswith(("st.global", "st.shared")):
            if predicate is not None:   # only the threads whose predicate holds store
                regs = {name: value[predicate] if isinstance(value, np.ndarray) and value.shape else value
                        for name, value in regs.items()}
            buffer, index = self.address(regs, operands[0])
            for e, name in enumerate(operands[1].strip("{}").split(", ")):
                buffer[index + e] = regs[name]
        else:
            raise AssertionError(f"the interpreter does not know {op}")


def _halves(bits):
    """(low, high) float16 halves of f16x2 bits."""
    bits = np.asarray(bits, dtype=np.uint32)
    return (bits & 0xFFFF).astype(np.uint16).view(np.float16), (bits >> 16).astype(np.uint16).view(np.float16)


def _pack(low, high):
    """f16x2 bits of float16 halves."""
    return low.view(np.uint16).astype(np.uint32) | high.view(np.uint16).astype(np.uint32) << 16


def run_unrolled_on_cpu(x, weight, spec, config, bias, residual, relu, part_fmas=None, half=False,
                        flush=0) -> np.ndarray:
    """The kernel's (N, K, P, Q) output for x (N, C, H, W) and weight (K, C, R, S) float32 numpy,
    bias (K,) or None, residual (N, K, P, Q) or None, written in config.out_layout (the residual
    read in it too); NaN where the kernel wrote nothing. Every module of the layer runs
    (`unrolled.layer_modules` with `part_fmas`), each with its own grid rows, as the launcher runs them.
    half: the float16 kernel (`flush` passed to the writer), x, bias, residual and output float16
    (x packed with a zero image after an odd N's last, as the launcher packs it)."""
    modules = unrolled.layer_modules(weight, config, part_fmas)
    n, k, p, q = spec.output_shape
    ph, pw = spec.padding
    dtype = np.float16 if half else np.float32
    padded = np.pad(x, ((0, n % 2 if half else 0), (0, 0), (ph, ph), (pw, pw)))
    batch_inner = config.out_layout == "batch_inner"
    order = (1, 2, 3, 0) if batch_inner else (0, 1, 2, 3)   # memory order of the output's dims
    sizes = dict(zip("nkpq", (n, k, p, q)))
    strides, step = {}, 1
    for dim in reversed([("n", "k", "p", "q")[i] for i in order]):
        strides[dim], step = step, step * sizes[dim]
    buffers = {"x": np.ascontiguousarray(padded.transpose(1, 2, 3, 0), dtype=dtype).ravel(),
               "bias": np.zeros(1, dtype) if bias is None else np.asarray(bias, dtype),
               "res": (np.zeros(1, dtype) if residual is None
                       else np.ascontiguousarray(residual.transpose(order), dtype=dtype).ravel()),
               "y": np.full(n * k * p * q, np.nan, dtype=dtype)}
    torch_dtype = torch.float16 if half else torch.float32
    grid_x = -(-unrolled.thread_positions(spec, config, torch_dtype) // config.threads)
    flags = int(relu) | int(bias is not None) << 1 | int(residual is not None) << 2
    args = {f"p_{name}": np.int64(base) for name, base in _BASES.items()}
    args.update(p_flags=np.int64(flags), p_sn=np.int64(strides["n"]), p_sk=np.int64(strides["k"]),
                p_sp=np.int64(strides["p"]), p_sq=np.int64(strides["q"]))
    for groups in modules:
        ptx = unrolled_source.kernel_ptx(weight, spec, config.bk, config.threads, groups, slices=config.slices,
                                         tq=config.tq, half=half, flush=flush)
        declared = re.search(rf"\.shared \.align 4 \.f32 {unrolled_source.PARTIALS}\[(\d+)\];", ptx)
        shared_floats = int(declared.group(1)) if declared else 0
        assert (shared_floats > 0) == (config.slices > 1)
        for group in range(len(groups)):
            buffers["smem"] = np.full(max(1, grid_x * shared_floats), np.nan, dtype=np.float32)   # unwritten: NaN
            for part in (*range(1, config.slices), 0):
                _Machine(ptx, buffers, grid_x, config.threads, group, part, 4 * shared_floats).run(
                    unrolled_source.KERNEL_NAME, args)
    memory_shape = [(n, k, p, q)[i] for i in order]
    return buffers["y"].reshape(memory_shape).transpose(np.argsort(order))
