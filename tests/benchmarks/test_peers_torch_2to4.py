"""benchmarks/peers/torch_2to4.py, the 2:4 semi-structured peer of `bench layers --peers torch_2to4`,
and the "2to4" pattern it runs on. On CPU: the pattern is 2:4 along the (r, s, c) reduction, the
checks and refusals. On a GPU: both variants against fp64."""
import pytest
import torch
from helpers.common import needs_cuda

from sparsecnn.bench.patterns import make_weight, two_four_mask
from sparsecnn.bench.peers import load_peer, peer_module
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

torch_2to4 = peer_module("torch_2to4")
torch_bsr = peer_module("torch_bsr")


@pytest.mark.parametrize("c,r", [(4, 3), (64, 1), (8, 5), (6, 3)])
def test_the_pattern_keeps_the_2_largest_of_every_4_channels_at_each_tap(c, r):
    spec = ConvSpec(1, c, 16, 8, 8, r, r, 1, r // 2, name="two-four")
    weight, label = make_weight(spec, 0.5, "2to4", 0, "cpu")
    assert label == "2to4" and weight.shape == (16, c, r, r)
    matrix = torch_bsr.weight_matrix(weight)
    assert torch_2to4.is_two_four(matrix) == (c % 4 == 0)
    if c % 4 == 0:
        assert int(weight.ne(0).sum()) == weight.numel() // 2
    values = torch.randn(2, c - c % 4, r, r)  # whole groups: the 2 kept outweigh the 2 dropped in each
    groups = values.abs().reshape(2, -1, 4, r, r)
    mask = two_four_mask(values).reshape(groups.shape)
    assert (mask.sum(2) == 2).all()
    assert (groups.masked_fill(~mask, float("inf")).amin(2) >= groups.masked_fill(mask, -1.0).amax(2)).all()
    with pytest.raises(ValueError, match="sparsity must be 0.5"):
        make_weight(spec, 0.9, "2to4", 0, "cpu")


def test_is_two_four():
    assert torch_2to4.is_two_four(torch.tensor([[1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 3.0]]))
    assert not torch_2to4.is_two_four(torch.tensor([[1.0, 1.0, 2.0, 0.0]]))
    assert not torch_2to4.is_two_four(torch.ones(2, 6))


@pytest.mark.parametrize("library", ["cusparselt", "cutlass"])
def test_refusals_name_the_reason(library):
    spec = ConvSpec(1, 64, 64, 8, 8, 3, 3, 1, 1)
    assert "fp16, bf16" in torch_2to4.unsupported_reason(spec, "fp32", "cuda", library)
    assert "CUDA" in torch_2to4.unsupported_reason(spec, "fp16", "cpu", library)
    assert "not a multiple" in torch_2to4.unsupported_reason(ConvSpec(1, 3, 64, 8, 8, 7, 7), "fp16", "cuda", library)
    assert torch_2to4.unsupported_reason(spec, "fp16", "cuda", library) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,c,k,h,r,stride,padding", [(2, 64, 64, 9, 3, 1, 1), (3, 32, 96, 13, 1, 2, 0)])
def test_gpu_both_variants_match_fp64(dtype, n, c, k, h, r, stride, padding):
    spec = ConvSpec(n, c, k, h, h, r, r, stride, padding, name="two-four")
    weight = make_weight(spec, 0.5, "2to4", 0, "cuda", dtype)[0]
    x = torch.randn(n, c, h, h, device="cuda").to(dtype)
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
    limit = 2 * relative_error(torch.nn.functional.conv2d(x, weight, None, stride, padding), ref) + 1e-5
    peer = load_peer("torch_2to4")
    name = "fp16" if dtype == torch.float16 else "bf16"
    for variant in peer.variants:
        y = peer.bind(variant, weight, x, spec, name)()
        assert y.shape == ref.shape and relative_error(y, ref) <= limit, variant
    dense = make_weight(spec, 0.0, "random", 0, "cuda", dtype)[0]
    with pytest.raises(ValueError, match="--pattern 2to4"):
        peer.bind("torch-2to4", dense, x, spec, name)
