"""Run the staged kernel's CUDA C (`kernels/codegen/staged.py`) as C++ on the CPU.

Its copy primitives (cp.async, waits) become plain 16-byte copies or zero fills, each block runs
alone with its threads as std::threads, __syncthreads is a std::barrier, the dynamic shared memory
a function static, and a warp shuffle an exchange through a block-wide array between two barriers
(every thread of a block takes the same shuffles): the index arithmetic (staging windows with
padding and strides, chunk pointers, per-lane pixel offsets, the epilogue's strides and pooling) is
the one the GPU runs.
"""
import subprocess

import numpy as np

from sparsecnn.backends.staged import kernel as staged
from sparsecnn.backends.staged import source as staged_source

from .cpp import compiled_cpp

_SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
struct Dim3 { unsigned x, y, z; };
struct float4 { float x, y, z, w; };
struct int2 { int x, y; };
static float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static thread_local Dim3 threadIdx, blockIdx;
static std::barrier<>* block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
static float shuffle_slots[1024];
static float __shfl_xor_sync(unsigned, float value, int lane_mask) {
  shuffle_slots[threadIdx.x] = value;
  __syncthreads();
  const float other = shuffle_slots[threadIdx.x ^ lane_mask];
  __syncthreads();
  return other;
}
#define __global__
#define __device__
#define __forceinline__
#define __launch_bounds__(...)
#define __ldg(p) (*(p))
#define __fmaf_rn(a, b, c) fmaf((a), (b), (c))
static void cp_async16(float4* dst, const void* src, int bytes) {
  if (bytes) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
static void cp_async8(int2* dst, const int2* src) { *dst = *src; }
static void cp_commit() {}
static void cp_wait_all_but_one() {}
static void cp_wait_all() {}
"""
_MAIN = r"""
template <class T> static std::vector<T> load(const char* path) {
  FILE* f = fopen(path, "rb");
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fseek(f, 0, SEEK_SET);
  std::vector<T> data(size / sizeof(T) + 1);
  if (size && fread(data.data(), 1, size, f) != (size_t)size) abort();
  fclose(f);
  return data;
}
int main(int argc, char** argv) {
  // argv: x nz chunk_ptr channel bias res y.out y_count grid_x grid_y has_bias has_res ints...
  auto x = load<float>(argv[1]); auto nz = load<int2>(argv[2]); auto ptr = load<int>(argv[3]);
  auto channel = load<int>(argv[4]); auto bias = load<float>(argv[5]); auto res = load<float>(argv[6]);
  std::vector<float> y(atol(argv[8]), __builtin_nanf(""));
  unsigned gx = atoi(argv[9]), gy = atoi(argv[10]);
  int v[17];
  for (int i = 0; i < 17; ++i) v[i] = atoi(argv[13 + i]);
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      std::barrier<> barrier(THREADS);
      block_barrier = &barrier;
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < THREADS; ++t)
        threads.emplace_back([&, t] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          sparsecnn_staged_conv(x.data(), nz.data(), ptr.data(), channel.data(), atoi(argv[11]) ? bias.data() : 0,
                                atoi(argv[12]) ? res.data() : 0, y.data(), v[0], v[1], v[2], v[3], v[4], v[5], v[6],
                                v[7], v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15], v[16]);
        });
      for (auto& thread : threads) thread.join();
    }
  FILE* f = fopen(argv[7], "wb");
  fwrite(y.data(), sizeof(float), y.size(), f);
  fclose(f);
  return 0;
}
"""


def cpu_source(gpu_source: str) -> str:
    """The kernel's CUDA C as a C++ program (see the module docstring)."""
    body = gpu_source.replace(staged_source.COPY_PRIMITIVES, "")
    body = body.replace('extern "C" ', "").replace("extern __shared__ float4 smem[];",
                                                   "static float4 smem[2 * STAGE_F4 + 4096];")
    return _SHIM + body + _MAIN


def run_staged_on_cpu(x, packed, spec, config, bias, residual, relu, out_strides, tmp_path, pool=0) -> np.ndarray:
    """The kernel's output for x (N, C, H, W) float32 numpy (any N that is a multiple of 32),
    `packed` (`pack_weight(weight, config)` on the CPU), bias (K,) or None, residual (N, K, P, Q) or None, pool
    (`staged.POOL_WINDOWS`), written at `out_strides` (elements, (N, K, P', Q') order, P' x Q' the pooled size)
    into a buffer of NaNs: returns that (N, K, P', Q') view as a dense array (NaN where nothing was written)."""
    out_vectors = out_strides[0] == 1 and all(s % 4 == 0 for s in out_strides[1:])
    runner = compiled_cpp(cpu_source(staged.kernel_source(spec, config)))
    n, k, p, q = staged.pooled_shape(spec.output_shape, pool)
    size = 1 + sum((extent - 1) * stride for extent, stride in zip((n, k, p, q), out_strides))
    np.ascontiguousarray(x.transpose(1, 2, 3, 0), dtype=np.float32).tofile(tmp_path / "x.bin")
    packed.entries(*config.halo(spec), staged.LANES_PER_POSITION).numpy().tofile(tmp_path / "nz.bin")
    packed.chunk_ptr.numpy().tofile(tmp_path / "ptr.bin")
    packed.channel.numpy().tofile(tmp_path / "channel.bin")
    (bias if bias is not None else np.zeros(1, np.float32)).astype(np.float32).tofile(tmp_path / "bias.bin")
    res_buffer = np.zeros(size, np.float32)
    if residual is not None:
        np.lib.stride_tricks.as_strided(res_buffer, residual.shape, [4 * s for s in out_strides])[...] = residual
    staged.check_pool(pool, config, spec, residual is not None)
    res_buffer.tofile(tmp_path / "res.bin")
    assert packed.max_segment <= 4096, "the CPU runner's shared memory holds two segments of 4096 non-zeros"
    flags = staged.epilogue_flags(relu, bias is not None, residual is not None, out_vectors, bool(pool))
    grid, ints = staged.launch_geometry(spec, config, packed.channel.numel(), packed.n_chunks, packed.max_segment,
                                        out_strides, flags)
    subprocess.run([str(runner), "x.bin", "nz.bin", "ptr.bin", "channel.bin", "bias.bin", "res.bin", "y.bin", str(size),
                    str(grid[0]), str(grid[1]), str(int(bias is not None)), str(int(residual is not None)),
                    *map(str, ints)], cwd=tmp_path, check=True)
    y = np.fromfile(tmp_path / "y.bin", dtype=np.float32)
    return np.lib.stride_tricks.as_strided(y, (n, k, p, q), [4 * s for s in out_strides]).copy()
