"""benchmarks/peers/sputnik.py, the Sputnik peer of `bench layers --peers sputnik`.

On CPU: the data preparation, through the pure-torch stand-in for the library (the CSR holds the
weight, the row order is Sputnik's sorted swizzle, im2col + SpMM is the convolution, fp64 against
F.conv2d on odd shapes), the bench rows, and the errors without a library. On a GPU with the library
built (SPARSECNN_SPUTNIK_LIB; this file builds nothing): Sputnik's kernels against the fp64 reference.
"""
import pytest
import torch
import torch.nn.functional as F
from helpers.common import needs, sparse_weight
from helpers.peers import assert_one_row_per_variant, peer_rows

from sparsecnn.bench.peers import load_peer, peer_module
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

sputnik = peer_module("sputnik")
PADDINGS = [0, 1, 2, 3]
STRIDES = [1, 2, 3]


def _spec(n=2, c=3, k=33, h=13, r=3, stride=2, padding=0) -> ConvSpec:
    return ConvSpec(n, c, k, h, h, r, r, stride, padding)


def _weight(spec: ConvSpec, sparsity=0.7, seed=0, dtype=torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return sparse_weight((spec.K, spec.C, spec.R, spec.S), sparsity, generator).to(dtype)


# --- CSR and row swizzle ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 1.0])
def test_csr_holds_the_weight_and_rows_are_sorted_by_length(dtype, sparsity):
    weight = _weight(_spec(), sparsity, dtype=dtype)
    matrix = sputnik.weight_matrix(weight)
    pair = dtype == torch.float16
    csr = sputnik.to_csr(matrix, pair_rows=pair)
    assert torch.equal(sputnik.csr_to_dense(csr), matrix)
    lengths = (csr.row_offsets[1:] - csr.row_offsets[:-1]).long()
    assert csr.row_offsets[0] == 0 and (lengths >= 0).all() and csr.row_offsets[-1] == csr.nnz
    assert csr.column_indices.dtype == (torch.int16 if pair else torch.int32)
    if csr.nnz:
        assert 0 <= int(csr.column_indices.min()) and int(csr.column_indices.max()) < matrix.shape[1]
    real = (matrix != 0).sum(1)
    assert torch.equal(lengths, real + real % 2 if pair else real)
    order = csr.row_indices.long()
    assert csr.row_indices.dtype == torch.int32 and sorted(order.tolist()) == list(range(matrix.shape[0]))
    assert (lengths[order][:-1] >= lengths[order][1:]).all()


def test_fp16_rows_are_padded_to_even_lengths_with_zeros():
    matrix = torch.zeros(4, 5, dtype=torch.float16)
    matrix[0, [1, 3, 4]] = 1.0  # odd: padded
    matrix[1, [0, 2]] = 2.0  # even: as is
    matrix[3, :] = 3.0  # full odd row: the pad repeats its last column with value 0
    csr = sputnik.to_csr(matrix, pair_rows=True)
    assert csr.row_offsets.tolist() == [0, 4, 6, 6, 12]
    assert csr.column_indices[:4].tolist() == [1, 3, 4, 4] and csr.values[3] == 0
    assert csr.row_indices.tolist() == [3, 0, 1, 2]
    assert torch.equal(sputnik.csr_to_dense(csr), matrix)


# --- im2col + SpMM is the convolution ------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset view"])
@pytest.mark.parametrize("spec", [ConvSpec(1, 3, 8, 13, 11, 5, 5, 2, 3), ConvSpec(3, 4, 8, 9, 12, 3, 1, (1, 2), (2, 0)),
                                  ConvSpec(2, 5, 8, 7, 7, 3, 3, 1, 1)], ids=str)
def test_im2col_is_unfold_for_any_input_layout(spec, layout):
    """One strided copy gives F.unfold's columns, batch-major, whatever x's strides and storage offset."""
    x = torch.randn(spec.N + 1, spec.C, spec.H, spec.W, dtype=torch.float64)
    x = {"contiguous": x[:spec.N], "channels_last": x[:spec.N].to(memory_format=torch.channels_last),
         "offset view": x[1:]}[layout]
    unfolded = F.unfold(x, (spec.R, spec.S), padding=spec.padding, stride=spec.stride)  # (N, CRS, PQ)
    expected = unfolded.transpose(0, 1).reshape(unfolded.shape[1], -1)
    assert torch.equal(sputnik.im2col(x, spec), expected)


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("stride", STRIDES)
def test_im2col_and_spmm_reproduce_conv2d_in_fp64(stride, padding):
    spec = _spec(stride=stride, padding=padding)
    weight = _weight(spec)
    x = torch.randn(spec.input_shape, dtype=torch.float64)
    ref = F.conv2d(x, weight, stride=stride, padding=padding)
    columns = sputnik.im2col(x, spec)
    assert columns.shape == (spec.C * spec.R * spec.S, spec.N * spec.P * spec.Q) and columns.is_contiguous()
    dense = sputnik.output_view(sputnik.weight_matrix(weight) @ columns, spec, spec.N)
    assert relative_error(dense, ref) < 1e-12
    out = sputnik.SputnikConv(weight, spec, sputnik.torch_spmm).conv(x)
    assert out.shape == ref.shape and out.is_contiguous() and relative_error(out, ref) < 1e-12


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("r, stride, padding", [(1, 1, 0), (1, 2, 0), (3, 1, 1)])
def test_conv_on_any_batch_and_the_pointwise_path(n, r, stride, padding):
    spec = _spec(n=n, c=5, k=7, h=6, r=r, stride=stride, padding=padding)
    weight = _weight(spec, 0.5)
    x = torch.randn(spec.input_shape, dtype=torch.float64)
    out = sputnik.SputnikConv(weight, spec, sputnik.torch_spmm).conv(x)
    assert torch.allclose(out, F.conv2d(x, weight, stride=stride, padding=padding))
    assert sputnik.is_pointwise(spec) == (r == 1 and stride == 1)


def test_all_zero_and_fully_dense_weights():
    spec = _spec(stride=1, padding=1)
    x = torch.randn(spec.input_shape, dtype=torch.float64)
    for sparsity in (1.0, 0.0):
        weight = _weight(spec, sparsity)
        out = sputnik.SputnikConv(weight, spec, sputnik.torch_spmm).conv(x)
        assert torch.allclose(out, F.conv2d(x, weight, padding=1))


def test_unsupported_reasons():
    assert sputnik.unsupported_reason(_spec(), "fp32", "cuda") is None
    assert sputnik.unsupported_reason(_spec(n=4, stride=1), "fp16", "cuda") is None  # 4*11*11 % 4 == 0
    assert "CUDA" in sputnik.unsupported_reason(_spec(), "fp32", "cpu")
    assert sputnik.unsupported_reason(_spec(), "fp32", "cpu", library=False) is None
    assert "bf16" in sputnik.unsupported_reason(_spec(), "bf16", "cuda")
    assert "divisible by 4" in sputnik.unsupported_reason(_spec(n=1, stride=1), "fp16", "cuda")  # 121
    assert "int16" in sputnik.unsupported_reason(ConvSpec(4, 4000, 8, 4, 4, 3, 3, 1, 1), "fp16", "cuda")
    assert "grouped" in sputnik.unsupported_reason(ConvSpec(2, 4, 4, 5, 5, 3, 3, groups=2), "fp32", "cuda")


# --- the bench hook and its errors ---------------------------------------------------------------------
def test_bench_layers_rows_of_the_peer_on_cpu_with_the_stand_in():
    specs = [ConvSpec(2, 3, 33, 13, 13, 3, 3, 2, 1, name="odd"), ConvSpec(2, 8, 16, 5, 5, 1, 1, name="pw")]
    rows = peer_rows(sputnik.make_peer(sputnik.torch_spmm), specs, "cpu")
    assert_one_row_per_variant(rows, ("odd", "pw"), sputnik.VARIANTS)
    assert {row["config"]["part"] for row in rows} == {"conv", "spmm"}
    assert {row["config"]["im2col"] for row in rows} == {"strided copy", "permute"}


def test_load_peer_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARSECNN_SPUTNIK_LIB", raising=False)
    with pytest.raises(FileNotFoundError, match="SPARSECNN_SPUTNIK_LIB is not set.*build_sputnik.sh"):
        load_peer("sputnik")
    monkeypatch.setenv("SPARSECNN_SPUTNIK_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(FileNotFoundError, match="nope.so: no such file"):
        load_peer("sputnik")
    (tmp_path / "junk.so").write_text("not a library")
    monkeypatch.setenv("SPARSECNN_SPUTNIK_LIB", str(tmp_path / "junk.so"))
    with pytest.raises(FileNotFoundError, match="junk.so: not a loadable Sputnik shim.*build_sputnik.sh"):
        load_peer("sputnik")


@needs("sputnik")
def test_the_built_library_loads_and_names_its_commit():
    # No GPU needed: loading the shim and asking its version and commit launch nothing.
    commit = load_peer("sputnik").config("sputnik", _spec(), "fp32")["sputnik"]
    assert commit is not None and len(commit) == 40 and int(commit, 16) >= 0


# --- on a GPU, with the library built ------------------------------------------------------------------
def _gpu_conv(spec: ConvSpec, weight: torch.Tensor, dtype: torch.dtype, variant: str = "sputnik"):
    """(output of peer variant `variant` on CUDA in `dtype`, x and weight as run, in float32)."""
    peer = load_peer("sputnik")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(spec.input_shape, generator=generator).to("cuda", dtype)
    weight = weight.to("cuda", dtype)
    out = peer.bind(variant, weight, x, spec, "fp16" if dtype == torch.float16 else "fp32")()
    torch.cuda.synchronize()
    return out, x.float(), weight.float()


@pytest.mark.gpu
@needs("sputnik")
@pytest.mark.parametrize("variant", sputnik.VARIANTS)
@pytest.mark.parametrize("n, r, stride, padding", [(1, 3, 1, 0), (2, 3, 2, 1), (1, 3, 3, 3), (0, 3, 1, 1),
                                                   (3, 3, 2, 2), (2, 1, 1, 0), (2, 1, 2, 0)])
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 1.0])
def test_sputnik_fp32_matches_the_fp64_reference(variant, n, r, stride, padding, sparsity):
    spec = _spec(n=n, r=r, stride=stride, padding=padding)
    out, x, weight = _gpu_conv(spec, _weight(spec, sparsity), torch.float32, variant)
    ref = reference_conv(x, weight, None, stride=stride, padding=padding, fp64=True)
    assert out.shape == ref.shape and relative_error(out, ref) < 1e-5


@pytest.mark.gpu
@needs("sputnik")
@pytest.mark.parametrize("r, stride, padding", [(3, 1, 1), (3, 2, 0), (3, 3, 3), (1, 1, 0)])
@pytest.mark.parametrize("sparsity", [0.0, 0.7])
def test_sputnik_fp16_within_twice_cudnn_error(r, stride, padding, sparsity):
    spec = _spec(n=4, r=r, stride=stride, padding=padding)  # N*P*Q divisible by 4 for every P
    out, x, weight = _gpu_conv(spec, _weight(spec, sparsity), torch.float16)
    ref = reference_conv(x, weight, None, stride=stride, padding=padding, fp64=True)
    cudnn = F.conv2d(x.half(), weight.half(), stride=stride, padding=padding)
    assert out.dtype == torch.float16 and relative_error(out, ref) <= 2 * relative_error(cudnn, ref) + 1e-6


@pytest.mark.gpu
@pytest.mark.timing
@needs("sputnik")
def test_sputnik_rows_on_the_gpu():
    specs = [ConvSpec(4, 64, 64, 14, 14, 3, 3, 1, 1, name="c3"), ConvSpec(4, 64, 256, 14, 14, 1, 1, name="c1")]
    for dtype in ("fp32", "fp16"):
        rows = peer_rows(load_peer("sputnik"), specs, "cuda", dtype, sparsity=0.9, baselines=False)
        assert_one_row_per_variant(rows, ("c3", "c1"), sputnik.VARIANTS, dtype, 1e-5 if dtype == "fp32" else 1e-2)
        assert all(row["config"]["sputnik"] for row in rows)
