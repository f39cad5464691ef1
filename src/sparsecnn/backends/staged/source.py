"""The CUDA C of the staged-input sparse convolution (`staged.py` holds its configs and launcher).

One source per kernel size, stride and config: those are #defines (the tile, its input window,
the chunk of input channels, rows per warp, warps), so index arithmetic folds to constants; the
layer's sizes, strides and epilogue (`flags`) are arguments. The copy primitives are separate so
that tests can run the same code as C++ on the CPU with plain copies in their place.
"""
from __future__ import annotations

from sparsecnn.core.spec import ConvSpec

KERNEL_NAME = "sparsecnn_staged_conv"
IMAGES = 32          # images per block: 8 lanes x 4 floats
LANES_PER_POSITION = IMAGES // 4
# Blocks per SM the register allocation must allow (__launch_bounds__): 128 registers per thread for
# 8 warps, 168 for 4 (at 128, 4 x 4 tiles of 7x7 kernels spilled), more for smaller blocks.
MIN_BLOCKS_PER_SM = {1: 8, 2: 4, 4: 3, 8: 2}


def kernel_source(spec: ConvSpec, config) -> str:
    """CUDA C of the kernel for one geometry (R, S, stride) and config. The epilogue (bias,
    residual, ReLU, float4 stores, a 2x2 max pool) is chosen per launch by the `flags` argument
    (`staged.epilogue_flags`):
    uniform branches, run once per output, so one compile serves every layer of that geometry.
    config: a `staged.StagedConfig`."""
    halo_h, halo_w = config.halo(spec)
    pixel_offsets = ", ".join(
        str((((t * 4) // config.tile_w) * spec.stride[0] * halo_w + ((t * 4) % config.tile_w) * spec.stride[1])
            * LANES_PER_POSITION)
        for t in range(config.tile_h * config.tile_w // 4))
    defines = dict(TH=config.tile_h, TW=config.tile_w, SH=spec.stride[0], SW=spec.stride[1], HALO_H=halo_h,
                   HALO_W=halo_w, CC=config.chunk_c, CPW=config.rows_per_warp, WARPS=config.warps,
                   MIN_BLOCKS=MIN_BLOCKS_PER_SM[config.warps])
    header = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    return header + f"#define PIXEL_OFFSETS {{{pixel_offsets}}}\n" + COPY_PRIMITIVES + _BODY


# The asynchronous copies (cp.async: 16 bytes global -> shared, or 16 zero bytes when told to read
# 0) and their waits; tests swap these for plain copies to run the kernel as C++ on the CPU.
COPY_PRIMITIVES = r"""
static __device__ __forceinline__ void cp_async16(float4* dst, const void* src, int bytes) {
  const unsigned to = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(to), "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void cp_async8(int2* dst, const int2* src) {
  const unsigned to = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(to), "l"(src) : "memory");
}
static __device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
static __device__ __forceinline__ void cp_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
static __device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
"""

_BODY = r"""
#define PPL (TH * TW / 4)
#define LPP 8
#define STAGE_F4 (CC * HALO_H * HALO_W * LPP)
#define THREADS (WARPS * 32)
#define RB (CPW * WARPS)

// Stage input channels c0 .. c0 + CC - 1 of the tile's window: element i of the stage is
// ((c - c0) * HALO_H + hh) * HALO_W + ww) * LPP + q (q: the 16-byte quarter of the 32 images).
static __device__ __forceinline__ void stage_chunk(float4* dst, const float* __restrict__ x, int c0, int C, int H,
                                                   int W, int N, int ih0, int iw0, int n0) {
  for (int i = threadIdx.x; i < STAGE_F4; i += THREADS) {
    const int q = i % LPP, pos = i / LPP;
    const int ww = pos % HALO_W, rest = pos / HALO_W;
    const int hh = rest % HALO_H, cl = rest / HALO_H;
    const int c = c0 + cl, h = ih0 + hh, w = iw0 + ww;
    const bool inside = c < C && h >= 0 && h < H && w >= 0 && w < W;
    const float* src = inside ? x + ((((long long)c * H + h) * W + w) * N + n0 + q * 4) : x;
    cp_async16(dst + i, src, inside ? 16 : 0);   // 0 bytes read: the 16 are zero-filled
  }
}

// Stage the block's non-zeros of one chunk: entries lo .. hi - 1 (one contiguous segment).
static __device__ __forceinline__ void stage_entries(int2* dst, const int2* __restrict__ nz, int lo, int hi) {
  for (int i = threadIdx.x; i < hi - lo; i += THREADS) cp_async8(dst + i, nz + lo + i);
}

static __device__ __forceinline__ void store4(float* y, const float v[4], bool vec, int ys_n) {
  if (vec) {
    *reinterpret_cast<float4*>(y) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int u = 0; u < 4; ++u) y[(long long)u * ys_n] = v[u];
  }
}

// max as F.max_pool2d takes it: a NaN wins.
static __device__ __forceinline__ float pool_max(float a, float b) { return (b > a || b != b) ? b : a; }

static __device__ __forceinline__ float4 pool_max4(float4 a, float4 b) {
  return make_float4(pool_max(a.x, b.x), pool_max(a.y, b.y), pool_max(a.z, b.z), pool_max(a.w, b.w));
}

// The epilogue with a 2x2, stride-2 max pool: y is the pooled (N, K, P / 2, Q / 2) output. Accumulator t
// and t + TW / 4 hold vertically adjacent pixels (TH is even); lanes l and l ^ LPP horizontally adjacent
// ones, exchanged by a shuffle that every lane of the warp takes before any lane-dependent branch.
// The bias and ReLU come after the max: both are non-decreasing, so the result is bitwise that of
// pooling act(conv + bias).
static __device__ __forceinline__ void store_pooled(const float4 (&acc)[CPW][PPL], const int* __restrict__ channel,
                                                    const float* __restrict__ bias, float* __restrict__ y,
                                                    bool has_bias, bool relu, bool out_vec, int lane, int oh0,
                                                    int ow0, int n, int P, int Q, int ys_n, int ys_k, int ys_h,
                                                    int ys_w) {
#pragma unroll
  for (int i = 0; i < CPW; ++i) {
    const int k = __ldg(channel + i);
    const float b = (has_bias && k >= 0) ? __ldg(bias + k) : 0.f;
#pragma unroll
    for (int t = 0; t < PPL; ++t) {
      if (((t * 4) / TW) % 2 || t + TW / 4 >= PPL) continue;   // odd rows are taken with the even row above
      float4 m = pool_max4(acc[i][t], acc[i][t + TW / 4]);
      m = pool_max4(m, make_float4(__shfl_xor_sync(~0u, m.x, LPP), __shfl_xor_sync(~0u, m.y, LPP),
                                   __shfl_xor_sync(~0u, m.z, LPP), __shfl_xor_sync(~0u, m.w, LPP)));
      const int oh = oh0 + (t * 4) / TW, ow = ow0 + (t * 4) % TW + lane / LPP;
      if (k < 0 || (lane / LPP) % 2 || oh + 1 >= P || ow + 1 >= Q) continue;
      const long long at = (long long)k * ys_k + (long long)(oh / 2) * ys_h + (long long)(ow / 2) * ys_w +
                           (long long)n * ys_n;
      float v[4] = {m.x + b, m.y + b, m.z + b, m.w + b};
      if (relu) {
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = fmaxf(v[u], 0.f);
      }
      store4(y + at, v, out_vec, ys_n);
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
sparsecnn_staged_conv(const float* __restrict__ x, const int2* __restrict__ nz, const int* __restrict__ chunk_ptr,
                      const int* __restrict__ channel, const float* __restrict__ bias,
                      const float* __restrict__ res, float* __restrict__ y,
                      int C, int H, int W, int N, int P, int Q, int pad_h, int pad_w, int tiles_w, int groups,
                      int n_chunks, int max_segment, int ys_n, int ys_k, int ys_h, int ys_w, int flags) {
  const bool relu = flags & 1, has_bias = flags & 2, has_res = flags & 4, out_vec = flags & 8,
             pool = flags & 16;
  extern __shared__ float4 smem[];
  int2* const staged_nz = reinterpret_cast<int2*>(smem + 2 * STAGE_F4);   // two buffers of max_segment
  const int pixel_offset[PPL] = PIXEL_OFFSETS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = blockIdx.x % groups, tile = blockIdx.x / groups;
  const int oh0 = (tile / tiles_w) * TH, ow0 = (tile % tiles_w) * TW;
  const int n0 = blockIdx.y * 32;
  const int ih0 = oh0 * SH - pad_h, iw0 = ow0 * SW - pad_w;
  const int row0 = (group * WARPS + warp) * CPW;
  const int* const block_ptr = chunk_ptr + group * n_chunks * (RB + 1);   // (n_chunks, RB + 1) of this block
  const int lane_base = (lane / LPP) * SW * LPP + lane % LPP;

  float4 acc[CPW][PPL];
#pragma unroll
  for (int i = 0; i < CPW; ++i)
#pragma unroll
    for (int t = 0; t < PPL; ++t) acc[i][t] = make_float4(0.f, 0.f, 0.f, 0.f);

  // Pointers are loaded a chunk ahead (the segment bounds two ahead), so their latency hides behind
  // the current chunk's FMAs; the non-zeros themselves are read from shared memory.
  int lo = __ldg(block_ptr), next_lo = 0, next_hi = 0;
  stage_chunk(smem, x, 0, C, H, W, N, ih0, iw0, n0);
  stage_entries(staged_nz, nz, lo, __ldg(block_ptr + RB));
  cp_commit();
  if (n_chunks > 1) {
    next_lo = __ldg(block_ptr + RB + 1);
    next_hi = __ldg(block_ptr + 2 * RB + 1);
  }
  int row_ptr[CPW + 1], next_row_ptr[CPW + 1];
#pragma unroll
  for (int i = 0; i <= CPW; ++i) row_ptr[i] = __ldg(block_ptr + warp * CPW + i);
  for (int ch = 0; ch < n_chunks; ++ch) {
    const int chunk_lo = lo;
    if (ch + 1 < n_chunks) {
      const int buffer = (ch + 1) & 1;
      stage_chunk(smem + buffer * STAGE_F4, x, (ch + 1) * CC, C, H, W, N, ih0, iw0, n0);
      stage_entries(staged_nz + buffer * max_segment, nz, next_lo, next_hi);
      cp_commit();
      const int* const next = block_ptr + (ch + 1) * (RB + 1);
#pragma unroll
      for (int i = 0; i <= CPW; ++i) next_row_ptr[i] = __ldg(next + warp * CPW + i);
      lo = next_lo;
      if (ch + 2 < n_chunks) {
        next_lo = __ldg(next + RB + 1);
        next_hi = __ldg(next + 2 * RB + 1);
      }
      cp_wait_all_but_one();
    } else {
      cp_wait_all();
    }
    __syncthreads();
    const float4* tile_in = smem + (ch & 1) * STAGE_F4 + lane_base;
    const int2* chunk_nz = staged_nz + (ch & 1) * max_segment - chunk_lo;
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
#pragma unroll 2
      for (int j = row_ptr[i]; j < row_ptr[i + 1]; ++j) {
        const int2 e = chunk_nz[j];
        const float w = __int_as_float(e.x);
        const float4* p = tile_in + e.y;
#pragma unroll
        for (int t = 0; t < PPL; ++t) {
          const float4 v = p[pixel_offset[t]];
          acc[i][t].x = __fmaf_rn(w, v.x, acc[i][t].x);
          acc[i][t].y = __fmaf_rn(w, v.y, acc[i][t].y);
          acc[i][t].z = __fmaf_rn(w, v.z, acc[i][t].z);
          acc[i][t].w = __fmaf_rn(w, v.w, acc[i][t].w);
        }
      }
    }
#pragma unroll
    for (int i = 0; i <= CPW; ++i) row_ptr[i] = next_row_ptr[i];
    __syncthreads();   // the next iteration stages into the buffer just read
  }

  const int n = n0 + (lane % LPP) * 4;
  if (pool) {
    store_pooled(acc, channel + row0, bias, y, has_bias, relu, out_vec, lane, oh0, ow0, n, P, Q, ys_n, ys_k, ys_h,
                 ys_w);
    return;
  }
#pragma unroll
  for (int i = 0; i < CPW; ++i) {
    const int k = __ldg(channel + row0 + i);
    if (k < 0) continue;
    const float b = has_bias ? __ldg(bias + k) : 0.f;
#pragma unroll
    for (int t = 0; t < PPL; ++t) {
      const int oh = oh0 + (t * 4) / TW, ow = ow0 + (t * 4) % TW + lane / LPP;
      if (oh >= P || ow >= Q) continue;
      const long long at = (long long)k * ys_k + (long long)oh * ys_h + (long long)ow * ys_w + (long long)n * ys_n;
      float v[4] = {acc[i][t].x + b, acc[i][t].y + b, acc[i][t].z + b, acc[i][t].w + b};
      if (has_res) {
        if (out_vec) {
          const float4 r = *reinterpret_cast<const float4*>(res + at);
          v[0] += r.x; v[1] += r.y; v[2] += r.z; v[3] += r.w;
        } else {
#pragma unroll
          for (int u = 0; u < 4; ++u) v[u] += res[at + (long long)u * ys_n];
        }
      }
      if (relu) {
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = fmaxf(v[u], 0.f);
      }
      store4(y + at, v, out_vec, ys_n);
    }
  }
}
"""
