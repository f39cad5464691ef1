"""benchmarks/peers/torch_bsr.py, the torch.sparse BSR peer of `bench layers --peers torch_bsr`.

On CPU: the (r, s, c) flattening and im2col (their product is the convolution, fp64 against the
reference on odd shapes), the block-size choice, the refusals. On a GPU: both variants against fp64.
"""
import pytest
import torch
from helpers.common import needs_cuda

from sparsecnn.bench.peers import peer_module
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

torch_bsr = peer_module("torch_bsr")


@pytest.mark.parametrize("n,c,k,h,r,stride,padding", [(2, 3, 33, 13, 3, 2, 0), (1, 8, 16, 7, 1, 1, 0),
                                                     (2, 5, 7, 9, 5, 3, 2), (0, 4, 4, 5, 3, 1, 1)])
def test_im2col_times_the_weight_matrix_is_the_convolution(n, c, k, h, r, stride, padding):
    spec = ConvSpec(n, c, k, h, h, r, r, stride, padding)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(k, c, r, r, generator=gen, dtype=torch.float64)
    columns = torch_bsr.im2col_rsc(x, spec)
    assert columns.shape[1] % 64 == 0
    count = n * spec.P * spec.Q
    y = (torch_bsr.weight_matrix(weight) @ columns)[:, :count].view(k, n, spec.P, spec.Q).transpose(0, 1)
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
    assert y.shape == ref.shape
    if n:
        assert relative_error(y, ref) < 1e-12


def test_best_blocksize_fits_the_mask():
    matrix = torch.zeros(128, 64)
    matrix[:64, :16] = 1.0  # one 64 x 16 block
    assert torch_bsr.best_blocksize(matrix) == (64, 16)
    matrix[64:, 32:] = 1.0  # and a 64 x 32 block
    assert torch_bsr.best_blocksize(matrix) == (64, 16)
    assert torch_bsr.best_blocksize(torch.ones(128, 64)) == (64, 64)
    assert torch_bsr.best_blocksize(torch.ones(33, 64)) is None


def test_refusals_name_the_reason():
    spec = ConvSpec(1, 64, 64, 8, 8, 3, 3, 1, 1)
    assert "fp16, bf16" in torch_bsr.unsupported_reason(spec, "fp32", "cuda")
    assert "CUDA" in torch_bsr.unsupported_reason(spec, "fp16", "cpu")
    assert "divides" in torch_bsr.unsupported_reason(ConvSpec(1, 3, 33, 8, 8, 3, 3), "fp16", "cuda")
    assert torch_bsr.unsupported_reason(spec, "fp16", "cuda") is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_both_variants_match_fp64(dtype):
    spec = ConvSpec(3, 64, 128, 14, 14, 3, 3, 2, 1)
    gen = torch.Generator().manual_seed(1)
    mask = (torch.rand(2, 4, 3, 3, generator=gen) < 0.3).repeat_interleave(64, 0).repeat_interleave(16, 1)
    weight = (torch.randn(128, 64, 3, 3, generator=gen) * mask).cuda().to(dtype)
    x = torch.randn(3, 64, 14, 14, generator=gen).cuda().to(dtype)
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
    peer = torch_bsr.load_peer()
    own = relative_error(torch.nn.functional.conv2d(x, weight, None, 2, 1), ref)
    for variant in peer.variants:
        y = peer.bind(variant, weight, x, spec, "fp16" if dtype == torch.float16 else "bf16")()
        if variant == "torch-bsr":
            assert relative_error(y, ref) <= 2 * own + 1e-5
