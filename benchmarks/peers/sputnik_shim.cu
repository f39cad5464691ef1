// extern "C" entry points into Sputnik's SpMM (google-research/sputnik, Apache-2.0) for ctypes.
// Our code; Sputnik's own sources are never in this repository: build_sputnik.sh compiles this file
// together with sputnik/spmm/cuda_spmm.cu.cc taken from a pinned commit, outside the checkout.
//
// Both functions compute C = A * B with A sparse (m x k, CSR), B dense (k x n, row-major) and
// C dense (m x n, row-major), every pointer a device pointer, launched on `stream` (a cudaStream_t
// passed as void* so that Python needs no CUDA types). They return the cudaError_t as an int
// (0: launched); nothing is synchronised or allocated.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "sputnik/spmm/cuda_spmm.h"

#ifndef SPUTNIK_COMMIT
#define SPUTNIK_COMMIT "unknown"  // build_sputnik.sh defines it: the commit the library was built from
#endif

extern "C" {

// Version of this C interface: sputnik.py checks it, so a stale library fails loudly.
int sputnik_shim_version() { return 1; }

// The Sputnik commit compiled in, recorded in the benchmark rows.
const char* sputnik_commit() { return SPUTNIK_COMMIT; }

const char* sputnik_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// fp32. row_indices: m ints, the rows in the order thread blocks take them (Sputnik's load
// balancing: sorted by decreasing length); row_offsets: m + 1 ints; column_indices and values:
// nonzeros each. Sputnik's float kernels read the sparse operands with 16-byte vector loads, so
// values and column_indices must start 16-byte aligned (any fresh torch allocation is).
int sputnik_spmm_f32(int m, int k, int n, int nonzeros, const int* row_indices,
                     const float* values, const int* row_offsets,
                     const int* column_indices, const float* dense,
                     float* output, void* stream) {
  return static_cast<int>(sputnik::CudaSpmm(
      m, k, n, nonzeros, row_indices, values, row_offsets, column_indices,
      dense, output, static_cast<cudaStream_t>(stream)));
}

// fp16 operands, fp32 accumulation (Sputnik's half2 kernels). values: nonzeros halves;
// column_indices: nonzeros int16 (so k <= 32767); row_offsets in elements. Sputnik works on pairs
// (half2 / short2), so every row length and n must be even: the caller pads each odd row with one
// explicit zero. dense (k x n) and output (m x n) are halves.
int sputnik_spmm_f16(int m, int k, int n, int nonzeros, const int* row_indices,
                     const void* values, const int* row_offsets,
                     const void* column_indices, const void* dense,
                     void* output, void* stream) {
  return static_cast<int>(sputnik::CudaSpmm(
      m, k, n, nonzeros, row_indices, static_cast<const half2*>(values),
      row_offsets, static_cast<const short2*>(column_indices),
      static_cast<const half2*>(dense), static_cast<half2*>(output),
      static_cast<cudaStream_t>(stream)));
}

}  // extern "C"
