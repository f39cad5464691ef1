"""Sputnik (google-research/sputnik, Apache-2.0; Gale et al., SC'20) as a peer of
`sparsecnn bench layers --peers sputnik`: its CUDA SpMM on our layers, masks and inputs.

A convolution becomes one SpMM, as Sputnik's own CNN use does: the weight (K, C, R, S) as a CSR
matrix A (K x C*R*S), the input as im2col columns B (C*R*S x N*P*Q, row-major; for 1x1 stride-1
layers x permuted to (C, N*H*W), no unfold), C = A * B (K x N*P*Q) turned back into (N, K, P, Q).
Two row variants per layer:

* "sputnik": the whole convolution on our contract (NCHW in, NCHW out): im2col, SpMM, layout.
* "sputnik-spmm": the SpMM kernel alone on B prepared ahead (output left as a (N, K, P, Q) view of
  the K x N*P*Q result): what Sputnik itself computes, a lower bound on its convolution time.

The library is built outside the repository by `build_sputnik.sh` (Sputnik's code is never
committed here) and found through SPARSECNN_SPUTNIK_LIB. fp32, and fp16 (Sputnik's half2 kernels:
fp16 operands, fp32 accumulation). `torch_spmm` is a pure-torch stand-in for the library, used by
the CPU tests of the data preparation (CSR, row swizzle, im2col) only.
"""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from sparsecnn import settings
from sparsecnn.bench.peers import Peer, common_unsupported_reason
from sparsecnn.core.spec import ConvSpec

LIBRARY = "libsputnik_spmm.so"
SHIM_VERSION = 1  # sputnik_shim.cu's sputnik_shim_version()
INT16_MAX = 32767  # fp16 column indices are int16 (Sputnik's short2)
INT32_MAX = 2**31 - 1
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
VARIANTS = ("sputnik", "sputnik-spmm")


@dataclasses.dataclass(frozen=True)
class SputnikCSR:
    """A (M x K) sparse matrix as Sputnik's SpMM takes it, every tensor on one device.

    values: (nnz,) float32 / float16 (or float64 for the torch stand-in); column_indices: (nnz,)
    int32, int16 for float16; row_offsets: (M + 1,) int32; row_indices: (M,) int32, the rows in the
    order thread blocks take them (decreasing length, Sputnik's load balancing). nnz counts the
    explicit zeros that pad odd rows for float16 (Sputnik's half2 kernels read rows in pairs).
    """

    values: torch.Tensor
    column_indices: torch.Tensor
    row_offsets: torch.Tensor
    row_indices: torch.Tensor
    shape: Tuple[int, int]

    @property
    def nnz(self) -> int:
        return self.values.numel()


def weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(K, C, R, S) -> (K, C*R*S), columns in (c, r, s) order: the order of im2col's rows."""
    return weight.reshape(weight.shape[0], -1)


def row_swizzle(row_offsets: torch.Tensor) -> torch.Tensor:
    """(M + 1,) int32 offsets -> (M,) int32: rows by decreasing length (stable, so deterministic),
    Sputnik's SortedRowSwizzle: thread blocks of long rows start first."""
    lengths = row_offsets[1:] - row_offsets[:-1]
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def to_csr(matrix: torch.Tensor, pair_rows: bool = False) -> SputnikCSR:
    """CSR of `matrix` (M, K) with zeros: its non-zeros row by row, columns ascending, in its dtype
    and on its device. pair_rows: each odd-length row gets one explicit zero at its end (column: the
    row's last one, in bounds), as Sputnik's half2 kernels need even rows; int16 columns then."""
    m, k = matrix.shape
    if pair_rows and k > INT16_MAX + 1:
        raise ValueError(f"int16 column indices hold at most {INT16_MAX + 1} columns, got {k}")
    rows, cols = (matrix != 0).nonzero(as_tuple=True)  # row-major: rows ascending, columns within
    lengths = torch.bincount(rows, minlength=m)
    padded = lengths + lengths % 2 if pair_rows else lengths
    offsets = torch.zeros(m + 1, dtype=torch.int64, device=matrix.device)
    offsets[1:] = padded.cumsum(0)
    # Slot of each non-zero: its row's start plus its rank within the row.
    rank = torch.arange(rows.numel(), device=matrix.device) - (lengths.cumsum(0) - lengths)[rows]
    slots = offsets[rows] + rank
    total = int(offsets[-1])
    values = torch.zeros(total, dtype=matrix.dtype, device=matrix.device)
    columns = torch.zeros(total, dtype=torch.int64, device=matrix.device)
    values[slots], columns[slots] = matrix[rows, cols], cols
    pad_rows = (padded != lengths).nonzero(as_tuple=True)[0]
    pad_slots = offsets[pad_rows + 1] - 1
    columns[pad_slots] = columns[pad_slots - 1]  # a padded row has >= 1 real entry just before
    offsets = offsets.to(torch.int32)
    index_dtype = torch.int16 if pair_rows else torch.int32
    return SputnikCSR(values, columns.to(index_dtype), offsets, row_swizzle(offsets), (m, k))


def csr_rows(csr: SputnikCSR) -> torch.Tensor:
    """(nnz,) int64: the row of each stored entry, from the row offsets."""
    lengths = (csr.row_offsets[1:] - csr.row_offsets[:-1]).long()
    return torch.repeat_interleave(torch.arange(csr.shape[0], device=lengths.device), lengths)


def csr_to_dense(csr: SputnikCSR) -> torch.Tensor:
    """The (M, K) matrix `csr` holds (padding zeros add nothing), in its values' dtype."""
    dense = torch.zeros(csr.shape, dtype=csr.values.dtype, device=csr.values.device)
    return dense.index_put_((csr_rows(csr), csr.column_indices.long()), csr.values, accumulate=True)


def is_pointwise(spec: ConvSpec) -> bool:
    """1x1, stride 1, no padding: B is x itself, permuted, no im2col."""
    return (spec.R, spec.S) == (1, 1) and spec.stride == (1, 1) and spec.padding == (0, 0)


def im2col(x: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """x (N, C, H, W) -> B (C*R*S, N*P*Q) contiguous, in x's dtype: B[(c, r, s), (n, p, q)] is the
    input under filter tap (c, r, s) for output (n, p, q)."""
    n = x.shape[0]
    if is_pointwise(spec):
        return x.transpose(0, 1).reshape(spec.C, n * spec.H * spec.W).contiguous()
    # One strided copy for the whole batch (plus the padding's), not F.unfold: PyTorch's CUDA unfold
    # launches one kernel per image, which at N=64 cost more than Sputnik's SpMM.
    (pad_h, pad_w), (step_h, step_w) = spec.padding, spec.stride
    padded = F.pad(x, (pad_w, pad_w, pad_h, pad_h))
    stride_n, stride_c, stride_h, stride_w = padded.stride()
    taps = padded.as_strided((spec.C, spec.R, spec.S, n, spec.P, spec.Q),
                             (stride_c, stride_h, stride_w, stride_n, step_h * stride_h, step_w * stride_w))
    return taps.contiguous().view(spec.C * spec.R * spec.S, n * spec.P * spec.Q)


def output_view(out: torch.Tensor, spec: ConvSpec, n: int) -> torch.Tensor:
    """C (K, N*P*Q) -> its (N, K, P, Q) view (not contiguous)."""
    return out.view(spec.K, n, spec.P, spec.Q).transpose(0, 1)


Spmm = Callable[[SputnikCSR, torch.Tensor], torch.Tensor]  # (A (M x K), B (K x n)) -> C (M x n)


def torch_spmm(csr: SputnikCSR, dense: torch.Tensor) -> torch.Tensor:
    """Stand-in for the library (CPU tests only): C (M x n) = A * B for B (K x n), in B's dtype,
    straight from the CSR arrays (each stored entry scales its row of B into its row of C)."""
    products = csr.values.to(dense.dtype)[:, None] * dense[csr.column_indices.long()]  # (nnz, n)
    out = torch.zeros(csr.shape[0], dense.shape[1], dtype=dense.dtype, device=dense.device)
    return out.index_add_(0, csr_rows(csr), products)


class SputnikLibrary:
    """libsputnik_spmm.so through ctypes: `spmm(csr, dense)` launches Sputnik's CudaSpmm on torch's
    current stream of dense's device (no synchronisation, no allocation but the output)."""

    def __init__(self, path: Path):
        rebuild = "rebuild it with benchmarks/peers/build_sputnik.sh"
        try:  # FileNotFoundError throughout: what the CLI reports as a missing piece, not a bug
            lib = ctypes.CDLL(str(path))
            version = lib.sputnik_shim_version()
        except (OSError, AttributeError) as error:
            raise FileNotFoundError(f"{path}: not a loadable Sputnik shim ({error}): {rebuild}") from None
        if version != SHIM_VERSION:
            raise FileNotFoundError(f"{path}: shim version {version}, this adapter needs {SHIM_VERSION}: {rebuild}")
        lib.sputnik_error_string.restype = ctypes.c_char_p
        lib.sputnik_commit.restype = ctypes.c_char_p
        for fn in (lib.sputnik_spmm_f32, lib.sputnik_spmm_f16):
            fn.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 7
            fn.restype = ctypes.c_int
        self.path = Path(path)
        self.commit = lib.sputnik_commit().decode()
        self._lib = lib

    def spmm(self, csr: SputnikCSR, dense: torch.Tensor) -> torch.Tensor:
        """C (M x n) = A * B for B (K x n) contiguous on CUDA, of A's dtype (float32 or float16)."""
        m, k = csr.shape
        n = dense.shape[1]
        out = torch.empty(m, n, dtype=dense.dtype, device=dense.device)
        if n == 0:  # Sputnik would launch an empty grid, an error
            return out
        fn = self._lib.sputnik_spmm_f16 if dense.dtype == torch.float16 else self._lib.sputnik_spmm_f32
        stream = torch.cuda.current_stream(dense.device).cuda_stream
        code = fn(m, k, n, csr.nnz, csr.row_indices.data_ptr(), csr.values.data_ptr(), csr.row_offsets.data_ptr(),
                  csr.column_indices.data_ptr(), dense.data_ptr(), out.data_ptr(), stream)
        if code != 0:
            raise RuntimeError(f"Sputnik SpMM ({m}x{k} * {k}x{n}, {dense.dtype}): "
                               f"{self._lib.sputnik_error_string(code).decode()}")
        return out


class SputnikConv:
    """One convolution prepared for Sputnik: `weight` (K, C, R, S) dense with zeros, float32 or
    float16 (float64 with the torch stand-in), as CSR on its device; `conv(x)` and `spmm(b)` run it.
    spmm: SputnikLibrary(...).spmm, or torch_spmm for the CPU tests."""

    def __init__(self, weight: torch.Tensor, spec: ConvSpec, spmm: Spmm):
        self.spec = spec
        self.csr = to_csr(weight_matrix(weight), pair_rows=weight.dtype == torch.float16)
        self._spmm = spmm

    def spmm(self, columns: torch.Tensor) -> torch.Tensor:
        """C (K, N*P*Q) = A * B for B = im2col(x) (C*R*S, N*P*Q)."""
        return self._spmm(self.csr, columns)

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, C, H, W) contiguous -> (N, K, P, Q) contiguous, in x's dtype."""
        return output_view(self.spmm(im2col(x, self.spec)), self.spec, x.shape[0]).contiguous()


def unsupported_reason(spec: ConvSpec, dtype: str, device_type: str, library: bool = True) -> Optional[str]:
    """Why Sputnik cannot run this layer at dtype name `dtype`, None if it can. library: whether
    the CUDA library runs it (else the torch stand-in, which runs on any device)."""
    reason = common_unsupported_reason("Sputnik", tuple(DTYPES), spec, dtype, device_type, library)
    if reason:
        return reason
    k, n = spec.C * spec.R * spec.S, spec.N * spec.P * spec.Q
    if dtype == "fp16" and n % 4:
        # half2 pairs, and 8-byte half4 loads of B's rows for most n: rows must stay aligned
        return f"fp16 needs N*P*Q divisible by 4, got {n}"
    if dtype == "fp16" and k > INT16_MAX + 1:
        return f"fp16 column indices are int16: C*R*S = {k} > {INT16_MAX + 1}"
    if k * n * DTYPES[dtype].itemsize > INT32_MAX:
        return "Sputnik's int32 byte offsets into B would overflow"  # index * n * itemsize, in int
    return None


def make_peer(spmm: Spmm, commit: str = "") -> Peer:
    """The Peer whose variants run `spmm` (a SputnikLibrary's, or torch_spmm in CPU tests)."""
    library = spmm is not torch_spmm

    def config(variant: str, spec: ConvSpec, dtype: str) -> dict:
        part = "conv" if variant == "sputnik" else "spmm"
        return {"part": part, "im2col": "permute" if is_pointwise(spec) else "strided copy",
                "swizzle": "sorted", "sputnik": commit or None}

    def bind(variant: str, weight: torch.Tensor, x: torch.Tensor, spec: ConvSpec,
             dtype: str) -> Callable[[], torch.Tensor]:
        conv = SputnikConv(weight, spec, spmm)
        if variant == "sputnik":
            return lambda: conv.conv(x)
        columns = im2col(x, spec)  # ahead: only the kernel is timed
        return lambda: output_view(conv.spmm(columns), spec, x.shape[0])

    return Peer(name="sputnik", variants=VARIANTS, dtypes=tuple(DTYPES),
                unsupported_reason=lambda spec, dtype, device: unsupported_reason(spec, dtype, device, library),
                config=config, bind=bind)


def library_path(path: Optional[Path] = None) -> Path:
    """`path`, else $SPARSECNN_SPUTNIK_LIB; FileNotFoundError saying how to build it if neither."""
    path = path or settings.sputnik_lib()
    build = "build it with benchmarks/peers/build_sputnik.sh (nvcc, Sputnik's source) and point " \
            f"{settings.SPUTNIK_LIB.name} at the {LIBRARY} it prints"
    if path is None:
        raise FileNotFoundError(f"{settings.SPUTNIK_LIB.name} is not set: {build}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{settings.SPUTNIK_LIB.name}={path}: no such file: {build}")
    return Path(path)


def load_peer(path: Optional[Path] = None) -> Peer:
    """The Sputnik peer on the built library (`path`, else $SPARSECNN_SPUTNIK_LIB)."""
    lib = SputnikLibrary(library_path(path))
    return make_peer(lib.spmm, lib.commit)
