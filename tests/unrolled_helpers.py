"""Run the unrolled kernel's CUDA C (`kernels/codegen/unrolled_source.py`) as C++ on the CPU.

The kernel has no shared memory, barriers or shuffles, so each (block, thread) runs alone, one
after the other; vector types are plain structs and `__ldg` a load: the index arithmetic (groups,
padding masks, strides, batch-innermost offsets) and the FMA order are the ones the GPU runs.
"""
import subprocess

import numpy as np

from sparsecnn.kernels.codegen import unrolled_source

_SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
struct Dim3 { unsigned x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static float2 make_float2(float a, float b) { return {a, b}; }
static float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static Dim3 threadIdx, blockIdx;
#define __global__
#define __device__
#define __noinline__
#define __launch_bounds__(...)
#define __ldg(p) (*(p))
"""
_MAIN = r"""
static std::vector<float> load(const char* path, long count) {
  std::vector<float> data(count + 4);
  FILE* f = fopen(path, "rb");
  if (!f || fread(data.data(), sizeof(float), count, f) != (size_t)count) abort();
  fclose(f);
  return data;
}
int main(int argc, char** argv) {
  // argv: x x_count bias bias_count res res_count y.out y_count grid_x grid_y threads flags
  auto x = load(argv[1], atol(argv[2])); auto bias = load(argv[3], atol(argv[4]));
  auto res = load(argv[5], atol(argv[6]));
  std::vector<float> y(atol(argv[8]), __builtin_nanf(""));
  unsigned gx = atoi(argv[9]), gy = atoi(argv[10]), threads = atoi(argv[11]);
  int flags = atoi(argv[12]);
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx)
      for (unsigned t = 0; t < threads; ++t) {
        blockIdx = {bx, by, 0};
        threadIdx = {t, 0, 0};
        sparsecnn_unrolled_conv(x.data(), bias.data(), res.data(), y.data(), flags);
      }
  FILE* f = fopen(argv[7], "wb");
  fwrite(y.data(), sizeof(float), y.size(), f);
  fclose(f);
  return 0;
}
"""


def run_unrolled_on_cpu(x, weight, spec, config, bias, residual, relu, tmp_path) -> np.ndarray:
    """The kernel's (N, K, P, Q) output for x (N, C, H, W) and weight (K, C, R, S) float32 numpy,
    bias (K,) or None, residual (N, K, P, Q) or None; NaN where the kernel wrote nothing."""
    source = unrolled_source.kernel_source(weight, spec, config.bk, config.vec, config.threads)
    (tmp_path / "run.cpp").write_text(_SHIM + source + _MAIN)
    subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-w", "run.cpp", "-o", "run"],
                   cwd=tmp_path, check=True)
    n, k, p, q = spec.output_shape
    arrays = {"x": np.ascontiguousarray(x.transpose(1, 2, 3, 0)),
              "bias": np.zeros(1) if bias is None else bias,
              "res": np.zeros(1) if residual is None else np.ascontiguousarray(residual.transpose(1, 2, 3, 0))}
    for name, array in arrays.items():
        np.asarray(array, dtype=np.float32).tofile(tmp_path / f"{name}.bin")
    positions = p * q * n // config.vec
    grid = (-(-positions // config.threads), -(-k // config.bk))
    flags = int(relu) | int(bias is not None) << 1 | int(residual is not None) << 2
    subprocess.run(["./run", "x.bin", str(arrays["x"].size), "bias.bin", str(np.size(arrays["bias"])), "res.bin",
                    str(np.size(arrays["res"])), "y.bin", str(n * k * p * q), str(grid[0]), str(grid[1]),
                    str(config.threads), str(flags)], cwd=tmp_path, check=True)
    y = np.fromfile(tmp_path / "y.bin", dtype=np.float32).reshape(k, p, q, n)
    return y.transpose(3, 0, 1, 2)
