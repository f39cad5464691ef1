#!/usr/bin/env bash
# Build libsputnik_spmm.so: Sputnik's SpMM (google-research/sputnik, Apache-2.0) plus our extern "C"
# shim (sputnik_shim.cu), for the `--peers sputnik` rows of `sparsecnn bench layers`.
#
# Sputnik's source never enters this repository: it is taken from SOURCE (a git directory, bare or
# not, or a URL git can clone) at the pinned COMMIT, extracted under $PEERS_DIR and compiled there
# with nvcc alone (no CMake). Only sputnik/spmm/cuda_spmm.cu.cc and the headers it includes are
# built; they need neither glog, abseil nor gtest (those are for Sputnik's tests and benchmarks).
# SASS only (no PTX), so no driver has to JIT it and no PTX ISA can be too new for the driver.
#
# Usage: benchmarks/peers/build_sputnik.sh [SOURCE [COMMIT]]
#   SOURCE  default $SPUTNIK_SOURCE, else https://github.com/google-research/sputnik
#   COMMIT  default $SPUTNIK_COMMIT, else the pinned commit below
#   env: PEERS_DIR (default /tmp/peers), SPUTNIK_ARCH (default 90: sm_90, H100), NVCC (default nvcc)
# Prints the library's path last; point SPARSECNN_SPUTNIK_LIB at it.
set -euo pipefail

PINNED=bbf5840ba5efccf01f862855c785f71bcc6ff1f0  # master of 2020-11-04, the newest commit
SOURCE=${1:-${SPUTNIK_SOURCE:-https://github.com/google-research/sputnik}}
COMMIT=${2:-${SPUTNIK_COMMIT:-$PINNED}}
PEERS_DIR=${PEERS_DIR:-/tmp/peers}
ARCH=${SPUTNIK_ARCH:-90}
NVCC=${NVCC:-nvcc}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=peer_source.sh
source "$HERE/peer_source.sh"

build=$PEERS_DIR/sputnik-${COMMIT:0:12}
src=$build/src
refuse_inside_repo build_sputnik.sh "$build" "$REPO"


mkdir -p "$build"
if [ ! -f "$src/.commit" ] || [ "$(cat "$src/.commit")" != "$COMMIT" ]; then
    rm -rf "$src" && mkdir -p "$src"
    gd=$(git_dir "$SOURCE" "$build")
    git --git-dir="$gd" archive "$COMMIT" LICENSE sputnik | tar -x -C "$src"
    echo "$COMMIT" >"$src/.commit"
fi

lib=$build/libsputnik_spmm.so
# -x cu: Sputnik names its CUDA sources .cu.cc. -DNDEBUG: no device asserts in the timed kernels.
# Static cudart (nvcc's default) makes the library self-contained; kernels still run in the
# process's primary context, on the stream torch hands over.
"$NVCC" -O3 -std=c++17 -DNDEBUG -DSPUTNIK_COMMIT="\"$COMMIT\"" -I"$src" \
    -gencode "arch=compute_${ARCH},code=sm_${ARCH}" \
    -Xcompiler -fPIC -shared \
    -x cu "$src/sputnik/spmm/cuda_spmm.cu.cc" "$HERE/sputnik_shim.cu" \
    -o "$lib.tmp"
mv "$lib.tmp" "$lib"
cp "$src/LICENSE" "$build/LICENSE.sputnik"  # Apache-2.0 travels with the binary
echo "$lib"
