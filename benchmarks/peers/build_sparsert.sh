#!/usr/bin/env bash
# Set up SparseRT (marsupialtail/gpu-sparsert, MIT; Wang, PACT'20) for the `--peers sparsert` rows of
# `sparsecnn bench layers`: its per-weight code generator, patched for CUDA 13 / sm_90, plus
# sparsert_compile.py, which turns one sparse weight into one cubin (SASS only, no PTX to JIT).
#
# SparseRT is no library: for every weight matrix its Python generator writes a CUDA stub, has nvcc
# lower it to PTX, and splices one fma.rn.f32 per non-zero (the value an immediate) into that PTX;
# ptxas then assembles it. Only sparsednn/ (the generator) is taken, from SOURCE (a git directory,
# bare or not, or a URL git can clone) at the pinned COMMIT, extracted under $PEERS_DIR; SparseRT's
# code never enters this repository. Its test drivers (driver_conv.cu, driver_spmm.cpp) are not
# used: they do not build on CUDA 13 (3-argument cuCtxCreate) nor cuDNN >= 8
# (cudnnGetConvolutionForwardAlgorithm).
#
# Patches (our text, applied to the extracted copy; each must match exactly once):
#  * the generators' nvcc line: -arch=sm_75 -> sm_$ARCH, --std=c++11 -> c++17 (CUDA 13's
#    cooperative_groups.h needs C++17), our stub headers instead of cnpy/cuDNN/cuBLAS (the stub's
#    host main() only includes them), and a failed nvcc is an error, not a missing file later.
#  * the conv stub marks the registers of its pixel (row, column) for the generator, which else
#    finds them only where nvcc happens to emit "mad.lo.s32 _, row, H, column" (never for H = 8,
#    16, 32: ptxas then fails on "Unknown symbol 'pred_00'").
#  * sparsert_compile.py moves the generator's own `.reg` declarations to the top of the kernel:
#    SparseRT declares load_reg inside thread block 0's code, and nvcc 13 lays block 0 out last
#    (ptxas: "Label expected for forward reference of 'load_reg'").
# fp32 only: the --half paths do not assemble with ptxas 13 (f16x2 ops on .f32 registers).
#
# Usage: benchmarks/peers/build_sparsert.sh [SOURCE [COMMIT]]
#   SOURCE  default $SPARSERT_SOURCE, else https://github.com/marsupialtail/gpu-sparsert
#   COMMIT  default $SPARSERT_COMMIT, else the pinned commit below
#   env: PEERS_DIR (default /tmp/peers), SPARSERT_ARCH (default 90: sm_90, H100), NVCC (default
#        nvcc), PTXAS (default ptxas), PYTHON (default python3; needs numpy), SPARSERT_SMOKE (default
#        1: generate and assemble one 3x3 and one 1x1 layer)
# Needs no GPU. Prints sparsert_compile.py's path last (run it with --help).
set -euo pipefail

PINNED=97540e4b03735463a52365eaa5c5217000b88413  # main of 2020-10-16, the newest commit
SOURCE=${1:-${SPARSERT_SOURCE:-https://github.com/marsupialtail/gpu-sparsert}}
COMMIT=${2:-${SPARSERT_COMMIT:-$PINNED}}
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
ARCH=${SPARSERT_ARCH:-90}
NVCC=$(command -v "${NVCC:-nvcc}")
PTXAS=$(command -v "${PTXAS:-ptxas}")
PYTHON=$(command -v "${PYTHON:-python3}")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=peer_source.sh
source "$HERE/peer_source.sh"

build=$(realpath -m "$PEERS_DIR/sparsert-${COMMIT:0:12}-sm_$ARCH")
src=$build/src
refuse_inside_repo build_sparsert.sh "$build" "$REPO"


mkdir -p "$build"
stamp="$COMMIT $ARCH $NVCC"
if [ ! -f "$src/.stamp" ] || [ "$(cat "$src/.stamp")" != "$stamp" ]; then
    rm -rf "$src" && mkdir -p "$src"
    gd=$(git_dir "$SOURCE" "$build")
    # Only LICENSE and the generator, read as subtrees: the repository's large .npy blobs are not
    # needed (and are missing from some mirrors, which a whole-tree archive would trip on).
    git --git-dir="$gd" archive --prefix=sparsednn/ "$COMMIT:sparsednn" | tar -x -C "$src"
    git --git-dir="$gd" show "$COMMIT:LICENSE" >"$src/LICENSE"
    rm -rf "$src/sparsednn/__pycache__"

    # Stub headers: the generated stub's host main() includes them; only its kernel is compiled.
    mkdir -p "$src/stub_include"
    cat >"$src/stub_include/cnpy.h" <<'EOF'
// Stub (sparsecnn): declarations the SparseRT stub's host main() names; never called.
#pragma once
#include <cstddef>
#include <string>
#include <vector>
namespace cnpy {
struct NpyArray {
    std::vector<size_t> shape;
    size_t word_size = 0;
    template <typename T> T* data() { return nullptr; }
};
inline NpyArray npy_load(const std::string&) { return NpyArray(); }
template <typename T>
void npy_save(const std::string&, const T*, const std::vector<size_t>, const std::string& = "w") {}
}  // namespace cnpy
EOF
    echo '// Stub (sparsecnn): included by the SparseRT stub, nothing used.' >"$src/stub_include/cublas_v2.h"
    printf '%s\n' '// Stub (sparsecnn): included by the SparseRT stub; only checkCUDNN names these.' \
        '#pragma once' 'typedef int cudnnStatus_t;' >"$src/stub_include/cudnn.h"

    NVCC="$NVCC" ARCH="$ARCH" INC="$src/stub_include" "$PYTHON" - "$src/sparsednn" <<'EOF'
import os, re, shlex, sys
gen = sys.argv[1]
cmd = (f"{shlex.quote(os.environ['NVCC'])} -arch=sm_{os.environ['ARCH']} -I {shlex.quote(os.environ['INC'])}"
       " -w -O3 -ptx --std=c++17 --compiler-options=-fsingle-precision-constant -o ")
for name in ("code_gen_conv_ptx.py", "code_gen_ptx.py"):
    path = os.path.join(gen, name)
    text = open(path).read()
    line = re.compile(r'^(\s*)os\.system\("nvcc -arch=sm_75 .*--std=c\+\+11 .*\)$', re.M)
    assert len(line.findall(text)) == 1, f"{name}: the nvcc line to patch is not there once"
    text = line.sub(lambda m: m.group(1) + "assert 0 == os.system(" + repr(cmd)
                    + " + temp_ptx_file_name + ' ' + temp_cu_file_name)"
                    + "  # sparsecnn: sm_ARCH, C++17, stub headers", text)
    open(path, "w").write(text)
# The conv generator finds the registers of the pixel (c_x, c_y) at the first PTX line
# "mad.lo.s32 _, X, <H>, Y" and inserts its border predicates there; for a power-of-two H nvcc
# writes shifts, no such line, and ptxas fails on "Unknown symbol 'pred_00'". A marker in the stub
# (an asm comment of that form, on c_x and c_y themselves) makes one always exist.
path = os.path.join(gen, "code_fragments.py")
text = open(path).read()
anchor = "int c_y  = C_idx % IMAGE_DIM;\n"
assert text.count(anchor) == 1, "code_fragments.py: the c_y line to patch is not there once"
text = text.replace(anchor, anchor + 'asm volatile("// sparsecnn: mad.lo.s32 _, %0, IMAGE_DIM_P, %1;"'
                    ' :: "r"(c_x), "r"(c_y));\n')
open(path, "w").write(text)
EOF

    cat >"$src/sparsert_compile.py" <<'EOF'
#!/usr/bin/env python3
"""One sparse weight -> one SparseRT cubin (sparsecnn's driver of SparseRT's generator).

conv3x3: weight (K, C*9) .npy, columns in (c, r, s) order (weight.reshape(K, -1)); a 3x3, stride 1,
  pad 1 convolution of ONE fp32 image (C, H, H) -> (K, H, H), NCHW, no bias, no ReLU.
spmm: weight (K, C) .npy; (K, C) x B (C, N) -> (K, N), row-major fp32 (a 1x1 conv: N = H*W).
Kernel _Z2mmPKfPf(const float* input, float* output): grid (A_blocks, C_blocks, 1), block
(cols / C_blocks, 1, 1) with cols = H*H (conv3x3) or N (spmm), no shared memory. conv3x3 reads up to
H+1 floats before and after the image (border taps, multiplied by 0): keep them finite.
Prints the launch configuration as JSON.
"""
import argparse, json, os, re, subprocess, sys, tempfile
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ARCH, PTXAS = "@ARCH@", "@PTXAS@"


def hoist_regs(ptx: str) -> str:
    """Move `.reg` lines met after the first inline asm up to nvcc's own declarations."""
    lines = ptx.split("\n")
    first = next(i for i, l in enumerate(lines) if "begin inline asm" in l)
    top = max(i for i, l in enumerate(lines[:first]) if l.strip().startswith(".reg"))
    is_reg = re.compile(r"\s*\.reg\b").match
    moved = ["\t" + l.strip() for l in lines[first:] if is_reg(l)]
    rest = [l for l in lines[first:] if not is_reg(l)]
    return "\n".join(lines[:top + 1] + moved + lines[top + 1:first] + rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["conv3x3", "spmm"])
    ap.add_argument("weight", help=".npy, (K, C*9) for conv3x3, (K, C) for spmm")
    ap.add_argument("--cols", type=int, required=True, help="conv3x3: H (square image); spmm: N")
    ap.add_argument("--A_blocks", type=int, required=True, help="thread blocks along K (divides K)")
    ap.add_argument("--C_blocks", type=int, required=True, help="thread blocks along the columns")
    ap.add_argument("-o", "--out", required=True, help="the cubin to write")
    ap.add_argument("--ptx", help="also keep the PTX given to ptxas here")
    a = ap.parse_args()
    w = np.load(a.weight).astype(np.float32)
    k, b = w.shape
    cols = a.cols * a.cols if a.kind == "conv3x3" else a.cols
    threads = cols // a.C_blocks
    if k % a.A_blocks or cols % a.C_blocks or not 0 < threads <= 1024 or (a.kind == "conv3x3" and b % 9):
        sys.exit(f"sparsert_compile: unsupported K={k} B={b} cols={cols} A_blocks={a.A_blocks} C_blocks={a.C_blocks}")
    gen = os.path.join(HERE, "sparsednn")
    with tempfile.TemporaryDirectory() as tmp:  # the generator writes temp_stub*.cu/.ptx into its cwd
        np.save(os.path.join(tmp, "w.npy"), np.ascontiguousarray(w.T))
        if a.kind == "conv3x3":
            cmd = [os.path.join(gen, "code_gen_conv_ptx.py"), f"--IC={b // 9}", f"--OC={k}", f"--IMAGE_DIM={a.cols}"]
        else:
            cmd = [os.path.join(gen, "code_gen_ptx.py"), f"--A_dim={k}", f"--B_dim={b}", f"--C_dim={cols}"]
        cmd = [sys.executable] + cmd + ["--Gy=1", f"--A_blocks={a.A_blocks}", f"--C_blocks={a.C_blocks}",
                                        "--infile=w.npy", "--outfile=k.ptx"]
        run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if run.returncode or not os.path.exists(os.path.join(tmp, "k.ptx")):  # it exit()s 0 on some errors
            sys.exit(f"sparsert_compile: generator failed ({run.returncode}):\n{run.stdout}{run.stderr}")
        with open(os.path.join(tmp, "k.ptx")) as f:
            ptx = hoist_regs(f.read())
        with open(os.path.join(tmp, "k_hoisted.ptx"), "w") as f:
            f.write(ptx)
        if a.ptx:
            with open(a.ptx, "w") as f:
                f.write(ptx)
        out = os.path.abspath(a.out)
        subprocess.run([PTXAS, f"-arch=sm_{ARCH}", "-O3", os.path.join(tmp, "k_hoisted.ptx"), "-o", out + ".tmp"],
                       check=True)
        os.replace(out + ".tmp", out)
    print(json.dumps({"cubin": out, "kernel": "_Z2mmPKfPf", "grid": [a.A_blocks, a.C_blocks, 1],
                      "block": [threads, 1, 1], "shared_bytes": 0, "nnz": int(np.count_nonzero(w))}))


if __name__ == "__main__":
    main()
EOF
    sed -i "s|@ARCH@|$ARCH|; s|@PTXAS@|$PTXAS|" "$src/sparsert_compile.py"
    chmod +x "$src/sparsert_compile.py"
    echo "$stamp" >"$src/.stamp"
fi
cp "$src/LICENSE" "$build/LICENSE.sparsert"  # MIT travels with the generated kernels

if [ "${SPARSERT_SMOKE:-1}" = 1 ]; then  # one 3x3 (C=K=64, 56x56) and one 1x1 layer, 90% sparse
    smoke=$build/smoke && mkdir -p "$smoke"
    "$PYTHON" - "$smoke" <<'EOF'
import sys, numpy as np
rng = np.random.default_rng(0)
for name, shape in (("w3x3", (64, 64 * 9)), ("w1x1", (64, 64))):
    w = rng.standard_normal(shape).astype(np.float32)
    w[rng.random(shape) < 0.9] = 0
    np.save(f"{sys.argv[1]}/{name}.npy", w)
EOF
    "$PYTHON" "$src/sparsert_compile.py" conv3x3 "$smoke/w3x3.npy" --cols 56 --A_blocks 2 --C_blocks 56 \
        -o "$smoke/conv3x3.cubin" >&2
    "$PYTHON" "$src/sparsert_compile.py" spmm "$smoke/w1x1.npy" --cols 3136 --A_blocks 8 --C_blocks 64 \
        -o "$smoke/spmm.cubin" >&2
fi
echo "$src/sparsert_compile.py"
