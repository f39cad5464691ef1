"""Helpers of the codegen tests: toolkit and g++ markers, sparse weights, value maps, and a runner of
the emitted CUDA C on the CPU (float32 and float16 kernels); the masked weights and fp64 reference
with epilogue that the staged and unrolled tests share.

The CPU runner: kernels are compiled as C++ with the host g++ that nvcc needs anyway: one block at a time, its
threads as std::threads, __syncthreads as a std::barrier, __shared__ as a function static. The fp16
helpers (one PTX instruction each on the GPU) are replaced by C++ on _Float16 with the same
rounding: HFMA2 lanes as one fused multiply-add rounded once to half, conversions to nearest.
"""
import subprocess

import numpy as np
import torch

from sparsecnn.backends.codegen import generator as codegen
from sparsecnn.backends.codegen import half2, template
from sparsecnn.core.reference import reference_conv

from .common import needs
from .cpp import compiled_cpp

needs_gxx = needs("g++")  # skipped without g++ locally, failed in CI (helpers.common.require)
needs_tools = needs("nvcc", "ptxas", "g++")  # the CUDA toolkit's or NVIDIA's pip wheel's, and nvcc's host compiler


def masked_weight(spec, sparsity: float, seed: int = 0) -> torch.Tensor:
    """A (K, C, R, S) float32 CPU weight, normal values with a random mask of `sparsity`, and one
    channel fully pruned (its output is the bias alone)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(spec.weight_shape, generator=generator)
    weight *= torch.rand(spec.weight_shape, generator=generator) >= sparsity
    weight[min(7, spec.K - 1)] = 0
    return weight


def reference_with_epilogue(x, weight, bias, residual, relu, spec) -> torch.Tensor:
    """act(conv(x) + bias + residual) in float64 on the CPU tensors given."""
    ref = reference_conv(x, weight, bias, stride=spec.stride, padding=spec.padding, fp64=True)
    ref = ref + residual.double() if residual is not None else ref
    return ref.relu() if relu else ref


def sparse(shape, sparsity: float, seed: int = 0) -> np.ndarray:
    """Normal float32 weights with exactly round(sparsity * size) zeros at random places."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal(shape).astype(np.float32)
    weight.reshape(-1)[rng.permutation(weight.size)[:round(sparsity * weight.size)]] = 0
    return weight


def value_map(plan, weight: np.ndarray) -> dict:
    """placeholder bits -> real weight bits for the (single-slice) weight of `plan` (float16 plans:
    the weight rounded to half)."""
    padded = np.zeros((plan.slice_k, *weight.shape[1:]), np.float32)
    padded[:weight.shape[0]] = weight
    if plan.dtype == "float16":
        padded = padded.astype(np.float16).astype(np.float32)
    return dict(zip(codegen.placeholders(plan).tolist(), codegen.slot_weights(plan, padded).tolist()))

_SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>
struct Dim3 { unsigned x, y, z; };
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 gridDim;
static std::barrier<>* block_barrier;
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define __ldg(p) (*(p))
#define __fmaf_rn(a, b, c) fmaf((a), (b), (c))
static void __syncthreads() { block_barrier->arrive_and_wait(); }
typedef void (*Kernel)(const Elem*, const Elem*, Elem*, int, int, int);
"""
_HALF_HELPERS = r"""
static float h2f(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
static unsigned short f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }
"""
_HALF2_HELPERS = r"""
static unsigned short hfma(unsigned short v, unsigned short w, unsigned short a) {
  _Float16 r = (_Float16)std::fma((double)h2f(v), (double)h2f(w), (double)h2f(a));  // exact, then one rounding
  unsigned short h; std::memcpy(&h, &r, 2); return h; }
static unsigned hfma2(unsigned v, unsigned w, unsigned a) {
  return hfma(v & 0xFFFF, w & 0xFFFF, a & 0xFFFF) | ((unsigned)hfma(v >> 16, w >> 16, a >> 16) << 16); }
static void flush2(float& lo, float& hi, unsigned a) { lo += h2f(a & 0xFFFF); hi += h2f(a >> 16); }
static unsigned pack2(unsigned short lo, unsigned short hi) { return (unsigned)lo | ((unsigned)hi << 16); }
"""
_MAIN = r"""
static std::vector<Elem> load(const char* path, size_t count) {
  std::vector<Elem> data(count);
  FILE* f = fopen(path, "rb");
  if (fread(data.data(), sizeof(Elem), count, f) != count) abort();
  fclose(f);
  return data;
}
int main(int argc, char** argv) {
  // argv: x.bin bias.bin y.bin x_count k_count y_count n_batch slice_k grid_x grid_y tx ty
  std::vector<Elem> x = load(argv[1], atol(argv[4])), bias = load(argv[2], atol(argv[5]));
  std::vector<Elem> y(atol(argv[6]), kUnwritten);
  int n = atoi(argv[7]), slice_k = atoi(argv[8]);
  gridDim = {(unsigned)atoi(argv[9]), (unsigned)atoi(argv[10]), 1};
  unsigned tx = atoi(argv[11]), ty = atoi(argv[12]);
  for (int s = 0; s < (int)(sizeof(kernels) / sizeof(kernels[0])); ++s)
    for (unsigned by = 0; by < gridDim.y; ++by)
      for (unsigned bx = 0; bx < gridDim.x; ++bx) {
        std::barrier<> barrier(tx * ty);
        block_barrier = &barrier;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < tx * ty; ++t)
          threads.emplace_back([&, t] {
            threadIdx = {t % tx, t / tx, 0};
            blockIdx = {bx, by, 0};
            kernels[s](x.data(), bias.data(), y.data(), n, s * slice_k, s % 2);
          });
        for (auto& thread : threads) thread.join();
      }
  FILE* f = fopen(argv[3], "wb");
  fwrite(y.data(), sizeof(Elem), y.size(), f);
  fclose(f);
  return 0;
}
"""
# Element type and the value an unwritten output keeps (NaN), per plan dtype.
_ELEMENTS = {"float32": ("typedef float Elem;\nstatic const Elem kUnwritten = __builtin_nanf(\"\");", np.float32),
             "float16": ("typedef unsigned short Elem;\nstatic const Elem kUnwritten = 0x7E00;", np.float16)}


def cpu_source(plan, weight: np.ndarray) -> str:
    """One C++ program running every slice kernel of `plan` (emit mode) for `weight` (K, C, R, S)."""
    padded = np.zeros((plan.n_slices * plan.slice_k, *weight.shape[1:]), np.float32)
    padded[:weight.shape[0]] = weight
    if plan.dtype == "float16":
        padded = padded.astype(np.float16).astype(np.float32)
    parts = [_ELEMENTS[plan.dtype][0], _SHIM, _HALF_HELPERS + _HALF2_HELPERS if plan.dtype == "float16" else ""]
    for s in range(plan.n_slices):
        source = codegen.kernel_source(plan, padded[s * plan.slice_k:(s + 1) * plan.slice_k])
        source = source.replace(template.HALF_HELPERS, "").replace(half2.HALF2_HELPERS, "")
        parts.append(source.replace(template.KERNEL_NAME, f"kernel{s}"))
    parts.append(f"static Kernel kernels[] = {{{', '.join(f'kernel{s}' for s in range(plan.n_slices))}}};")
    return "\n".join(parts) + _MAIN


def run_emitted_on_cpu(plan, weight: np.ndarray, x: np.ndarray, bias: np.ndarray, tmp_path) -> np.ndarray:
    """y (N, K, P, Q) in the plan's dtype from the emit-mode kernels of `plan`, run on the CPU.

    x (N, C, H, W), bias (K,) (or any (1,) array when the plan has none): cast to the plan's dtype.
    """
    element = _ELEMENTS[plan.dtype][1]
    runner = compiled_cpp(cpu_source(plan, weight))
    n, spec = x.shape[0], plan.spec
    x.astype(element).tofile(tmp_path / "x.bin")
    bias.astype(element).tofile(tmp_path / "bias.bin")
    grid = plan.grid(n)
    y_count = n * spec.K * spec.P * spec.Q
    subprocess.run([str(runner), "x.bin", "bias.bin", "y.bin", str(x.size), str(bias.size), str(y_count), str(n),
                    str(plan.slice_k), str(grid[0]), str(grid[1]), str(plan.config.tx), str(plan.config.ty)],
                   cwd=tmp_path, check=True)
    return np.fromfile(tmp_path / "y.bin", dtype=element).reshape(n, spec.K, spec.P, spec.Q)


def assert_graph_replay_equals_eager(backend, packed, x, bias, spec) -> None:
    """Capture `backend.run` in a CUDA graph (after an eager run that compiles and loads the
    kernels, and a warm-up on a side stream), replay it on new input, compare with eager."""
    import torch

    backend.run(x, packed, bias, spec, None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.run(x, packed, bias, spec, None)
    torch.cuda.current_stream().wait_stream(stream)
    assert_graph_replay_matches(lambda: backend.run(x, packed, bias, spec, None), x)


def assert_graph_replay_matches(run, x) -> None:
    """Capture run() (reading the CUDA tensor x; run eagerly before, so its kernels are loaded) in a
    CUDA graph, replay it on new values of x, and compare with an eager run on them."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_static, run())
