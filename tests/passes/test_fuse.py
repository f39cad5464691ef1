import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune as torch_prune

from sparsecnn.core.reference import relative_error
from sparsecnn.models import build_model
from sparsecnn.nn import SparseConv2d, SplitKLinear
from sparsecnn.passes.fuse import fold_batchnorm, prepare_for_inference


@torch.no_grad()
def _randomise_batchnorms(model: nn.Module) -> nn.Module:
    """Running statistics and affine parameters far from their identity defaults."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.normal_(0.0, 0.5)
            module.running_var.uniform_(0.3, 3.0)
            if module.affine:
                module.weight.uniform_(0.5, 2.0)
                module.bias.normal_(0.0, 0.5)
    return model


@torch.no_grad()
def _sparsify_weights(model: nn.Module, sparsity: float = 0.7) -> nn.Module:
    for module in model.modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            module.weight.copy_(module.weight * (torch.rand_like(module.weight) >= sparsity))
    return model


class ConvBnPairs(nn.Module):
    """Conv2d (no bias) -> BN2d, Conv2d (bias) -> BN2d without affine, Conv1d -> BN1d."""

    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn_a = nn.BatchNorm2d(8)
        self.conv_b = nn.Conv2d(8, 6, 3, stride=2)
        self.bn_b = nn.BatchNorm2d(6, affine=False, eps=1e-3)
        self.conv_c = nn.Conv1d(6, 5, 3, padding=1)
        self.bn_c = nn.BatchNorm1d(5)

    def forward(self, x):
        y = self.bn_b(self.conv_b(torch.relu(self.bn_a(self.conv_a(x)))))
        return self.bn_c(self.conv_c(y.flatten(2)))


def _bn_model(dtype=torch.float64):
    return _sparsify_weights(_randomise_batchnorms(ConvBnPairs())).to(dtype).eval()


def test_fold_batchnorm_matches_the_eval_model_in_fp64():
    model = _bn_model()
    gm = fold_batchnorm(model)
    x = torch.randn(2, 3, 11, 11, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-12
    assert gm.fuse_report.folded_batchnorms == {"conv_a": "bn_a", "conv_b": "bn_b", "conv_c": "bn_c"}
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gm.modules())


def test_fold_batchnorm_fp32_and_keeps_zeros():
    model = _bn_model(torch.float32)
    gm = fold_batchnorm(model)
    x = torch.randn(2, 3, 11, 11)
    with torch.no_grad():
        ref = model.double()(x.double())
        assert relative_error(gm(x), ref) < 1e-5
    for name in ("conv_a", "conv_b", "conv_c"):
        assert torch.equal(gm.get_submodule(name).weight == 0, model.get_submodule(name).weight == 0)


def test_fold_batchnorm_leaves_the_model_untouched():
    model = _bn_model()
    before = copy.deepcopy(model.state_dict())
    fold_batchnorm(model)
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert isinstance(model.bn_a, nn.BatchNorm2d)


def test_fold_batchnorm_absorbs_torch_prune():
    model = _randomise_batchnorms(ConvBnPairs()).double().eval()
    torch_prune.random_unstructured(model.conv_a, "weight", amount=0.6)
    mask = model.conv_a.weight_mask.bool()
    gm = fold_batchnorm(model)
    assert not hasattr(gm.conv_a, "weight_orig")
    assert torch.equal(gm.conv_a.weight != 0, mask)
    x = torch.randn(2, 3, 11, 11, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-12


class ConvWithTwoUsers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.conv(x)
        return self.relu(self.bn(y)) + y


def test_conv_with_two_users_is_neither_folded_nor_fused():
    model = _randomise_batchnorms(ConvWithTwoUsers()).eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.folded_batchnorms == {}
    assert gm.fuse_report.fused_relus == [] and gm.fuse_report.fused_adds == []
    assert isinstance(gm.conv, SparseConv2d) and gm.conv.activation == "none"
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


# (model, input shape, (BatchNorms folded, ReLUs fused, residual adds fused)), counted from the
# architectures: a ResNet folds every BN and fuses every ReLU (stem, inside and after each block);
# alexnet-cifar's conv1 ReLU comes after a max pool (fused through it), lenet5 has no ReLU after its convs.
MODELS = [
    ("resnet18-cifar", (1, 3, 32, 32), (20, 17, 8)),
    ("resnet50", (1, 3, 32, 32), (53, 49, 16)),
    ("vgg16-cifar", (2, 3, 32, 32), (0, 13, 0)),
    ("googlenet", (1, 3, 32, 32), (57, 57, 0)),
    ("lenet5", (2, 1, 28, 28), (0, 0, 0)),
    ("alexnet-cifar", (2, 3, 32, 32), (0, 3, 0)),
]


def _sparse_mask(gm, model, path):
    """The mask of the `SparseConv2d` that computes conv `path` of `model` (its rows of the merged
    layer's mask when it was merged with its siblings)."""
    for merged, siblings in gm.fuse_report.merged_convs.items():
        if path in siblings:
            rows = [model.get_submodule(sibling).out_channels for sibling in siblings]
            start = sum(rows[:siblings.index(path)])
            return gm.get_submodule(merged).mask[start:start + rows[siblings.index(path)]]
    layer = gm.get_submodule(path)
    assert isinstance(layer, SparseConv2d)
    return layer.mask


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("name, shape, counts", MODELS, ids=[m[0] for m in MODELS])
def test_prepared_model_equals_the_eval_model(name, shape, counts):
    model = _sparsify_weights(_randomise_batchnorms(build_model(name))).eval()
    gm = prepare_for_inference(model)
    report = gm.fuse_report
    assert (len(report.folded_batchnorms), len(report.fused_relus), len(report.fused_adds)) == counts
    x = torch.randn(*shape)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-5
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert all(torch.equal(_sparse_mask(gm, model, n), model.get_submodule(n).weight != 0) for n in convs)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert report.swapped_linears == linears and all(type(gm.get_submodule(n)) is SplitKLinear for n in linears)


def test_resnet18_cifar_keeps_no_batchnorm_or_relu_module():
    gm = prepare_for_inference(build_model("resnet18-cifar"))
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.ReLU)) for m in gm.modules())
    assert gm.get_submodule("layer1.0.conv2").activation == "relu"
    assert "layer2.0.conv2" in gm.fuse_report.fused_adds


def test_masks_keyed_by_original_names_apply():
    model = _randomise_batchnorms(build_model("resnet18-cifar")).eval()
    names = ["conv1", "layer1.0.conv1", "layer2.0.downsample.0"]
    masks = {name: torch.rand(model.get_submodule(name).weight.shape) > 0.8 for name in names}
    gm = prepare_for_inference(model, masks=masks)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, mask in masks.items():
            reference.get_submodule(name).weight.mul_(mask)
            assert torch.equal(gm.get_submodule(name).mask, mask)
        x = torch.randn(2, 3, 32, 32)
        assert relative_error(gm(x), reference(x)) < 1e-5


def test_unknown_mask_name_is_rejected():
    with pytest.raises(ValueError, match="layer9.conv"):
        prepare_for_inference(build_model("lenet5"), masks={"layer9.conv": torch.ones(1, dtype=torch.bool)})


RELUS = {
    "module": lambda self, y: self.relu(y),
    "functional": lambda self, y: F.relu(y),
    "functional_inplace": lambda self, y: F.relu(y, inplace=True),
    "torch": lambda self, y: torch.relu(y),
    "torch_inplace": lambda self, y: torch.relu_(y),
    "method": lambda self, y: y.relu(),
    "method_inplace": lambda self, y: y.relu_(),
}
ADDS = {
    "operator": lambda y, other: y + other,
    "reflected": lambda y, other: other + y,
    "torch": lambda y, other: torch.add(y, other),
    "inplace": lambda y, other: y.add_(other),
}


def _iadd(y, other):
    y += other
    return y


ADDS["augmented"] = _iadd


class ConvAddRelu(nn.Module):
    """relu(add(bn(conv_b(relu(bn(conv_a(x))))), shortcut(x))), the relu module reused twice; the first
    operand of the add absorbs it."""

    def __init__(self, relu, add, dims=2):
        super().__init__()
        conv, bn = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.conv_a, self.bn_a = conv(4, 6, 3, padding=1), bn(6)
        self.conv_b, self.bn_b = conv(6, 6, 3, padding=1), bn(6)
        self.shortcut = conv(4, 6, 1)
        self.relu = nn.ReLU(inplace=True)
        self.apply_relu, self.apply_add = relu, add

    def forward(self, x):
        y = self.apply_relu(self, self.bn_a(self.conv_a(x)))
        return self.apply_relu(self, self.apply_add(self.bn_b(self.conv_b(y)), self.shortcut(x)))


@pytest.mark.parametrize("relu", RELUS)
@pytest.mark.parametrize("add", ADDS)
def test_every_relu_and_add_spelling_is_fused(relu, add):
    model = _randomise_batchnorms(ConvAddRelu(RELUS[relu], ADDS[add])).eval()
    gm = prepare_for_inference(model)
    absorbing, other = ("shortcut", "conv_b") if add == "reflected" else ("conv_b", "shortcut")
    assert gm.fuse_report.fused_relus == ["conv_a", absorbing]
    assert gm.fuse_report.fused_adds == [absorbing]
    assert gm.get_submodule(absorbing).activation == "relu" and gm.get_submodule(other).activation == "none"
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-5


def test_torch_prune_mask_is_used():
    model = _randomise_batchnorms(ConvAddRelu(RELUS["module"], ADDS["operator"])).eval()
    torch_prune.l1_unstructured(model.conv_b, "weight", amount=0.5)
    mask = model.conv_b.weight_mask.bool()
    gm = prepare_for_inference(model)
    assert torch.equal(gm.conv_b.mask, mask) and gm.fuse_report.fused_adds == ["conv_b"]
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-5


def test_conv1d_fuses_too():
    model = _randomise_batchnorms(ConvAddRelu(RELUS["module"], ADDS["operator"], dims=1)).eval()
    gm = prepare_for_inference(model)
    assert len(gm.fuse_report.folded_batchnorms) == 2 and gm.fuse_report.fused_adds == ["conv_b"]
    x = torch.randn(2, 4, 13)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-5


class InPlaceAddIntoOther(nn.Module):
    """other.add_(conv(x)) mutates `other`, which is returned: the conv must not absorb that add."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        other = torch.relu(x)
        other.add_(self.conv(x))
        return other


def test_inplace_add_into_another_tensor_is_not_fused():
    model = InPlaceAddIntoOther().eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.fused_adds == []
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


class MutationBeforeResidual(nn.Module):
    """conv_a reads x before x.relu_() mutates it: conv_a must not move below that to take the
    residual computed after it, so the add goes to conv_b, whose residual is ready."""

    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 4, 3, padding=1)
        self.conv_b = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        y = self.conv_a(x)
        x.relu_()
        return y + self.conv_b(x)


def test_conv_does_not_move_past_an_inplace_op():
    model = MutationBeforeResidual().eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.fused_adds == ["conv_b"]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert relative_error(gm(x.clone()), model(x.clone())) < 1e-6


class BroadcastAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.offset = nn.Parameter(torch.randn(1, 5, 1, 1))

    def forward(self, x):
        offset = self.offset  # read first, so that the conv could take it without moving
        return self.conv(x) + offset


def test_broadcasting_add_is_not_fused_when_shapes_are_known():
    model = BroadcastAdd().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = prepare_for_inference(model, example_inputs=(x,))
    assert gm.fuse_report.fused_adds == []
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


def test_shared_conv_module_is_not_fused():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x)) + self.conv(x)

    model = Shared().eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.fused_relus == [] and gm.fuse_report.fused_adds == []
    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


def test_untraceable_model_is_rejected():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(ValueError, match="torch.fx"):
        prepare_for_inference(DataDependent())


class PooledRelu(nn.Module):
    """conv_a -> max pool -> ReLU (fuses through the pool); conv_b -> max pool -> ReLU where the pool's
    output has a second use (must not fuse: that use wants the unrectified maximum)."""

    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)
        self.conv_b = nn.Conv2d(4, 4, 3)

    def forward(self, x):
        a = torch.relu(self.pool(self.conv_a(x)))
        pooled = F.max_pool2d(self.conv_b(a), 2)
        return F.relu(pooled) + pooled


def test_relu_after_a_max_pool_fuses_into_the_conv_before_it():
    model = PooledRelu().eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.fused_relus == ["conv_a"]
    assert gm.conv_a.activation == "relu" and gm.conv_b.activation == "none"
    assert not any(node.target is torch.relu for node in gm.graph.nodes)
    x = torch.randn(2, 3, 11, 9) - 0.2
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


def test_channel_concatenations_are_swapped_and_keep_a_batch_innermost_layout():
    from sparsecnn.nn.concat import cat_channels

    gm = prepare_for_inference(build_model("googlenet"))
    assert len(gm.fuse_report.swapped_concats) == 9   # one per inception block
    assert all(n.target is not torch.cat for n in gm.graph.nodes if n.op == "call_function")
    inner = [torch.randn(c, 5, 6, 4).permute(3, 0, 1, 2) for c in (3, 7, 2)]   # (N, C, H, W) stored (C, H, W, N)
    y = cat_channels(inner, 1)
    assert torch.equal(y, torch.cat(inner, 1)) and y.permute(1, 2, 3, 0).is_contiguous()
    mixed = [inner[0], inner[1].contiguous()]
    assert torch.equal(cat_channels(mixed), torch.cat(mixed, 1)) and cat_channels(mixed).is_contiguous()
    assert torch.equal(cat_channels(inner[:2], dim=0 + 1), torch.cat(inner[:2], 1))
    flat = [torch.randn(4, 3), torch.randn(4, 5)]
    assert torch.equal(cat_channels(flat, 1), torch.cat(flat, 1))


def test_only_channel_concatenations_are_swapped():
    class Cats(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], 0).sum() + torch.cat([x, x], dim=1).sum() + torch.cat([x, x], 3).sum()

    gm = prepare_for_inference(Cats())
    assert gm.fuse_report.swapped_concats == ["cat_1"]
    x = torch.randn(2, 3, 4, 5)
    assert torch.equal(gm(x), Cats()(x))


def test_downsample_biases_move_into_the_convs_taking_them_as_residual():
    model = _sparsify_weights(_randomise_batchnorms(build_model("resnet18-cifar"))).double().eval()
    gm = prepare_for_inference(model)
    moved = {f"layer{i}.0.downsample.0": f"layer{i}.0.conv2" for i in (2, 3, 4)}
    assert gm.fuse_report.moved_biases == moved
    folded = fold_batchnorm(model)
    for producer, consumer in moved.items():
        assert gm.get_submodule(producer).bias is None
        expected = folded.get_submodule(producer).bias + folded.get_submodule(consumer).bias
        assert torch.allclose(gm.get_submodule(consumer).bias, expected, rtol=0, atol=1e-12)
    x = torch.randn(2, 3, 13, 13, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-12


class BiasFreeConvPlusShortcut(nn.Module):
    """relu(conv_b(x) + shortcut(x)): conv_b has no bias, the shortcut has one."""

    def __init__(self):
        super().__init__()
        self.conv_b = nn.Conv2d(4, 6, 3, padding=1, bias=False)
        self.shortcut = nn.Conv2d(4, 6, 1)

    def forward(self, x):
        return torch.relu(self.conv_b(x) + self.shortcut(x))


def test_bias_moves_into_a_consumer_without_one():
    model = BiasFreeConvPlusShortcut().eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.moved_biases == {"shortcut": "conv_b"}
    assert gm.shortcut.bias is None and torch.equal(gm.conv_b.bias, model.shortcut.bias)
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


class ResidualWithOtherUses(nn.Module):
    """conv_b takes conv_r's output as residual, but that output is also returned (relu'd or not): its
    bias must stay."""

    def __init__(self, relu_residual: bool):
        super().__init__()
        self.conv_b = nn.Conv2d(3, 4, 3, padding=1)
        self.conv_r = nn.Conv2d(3, 4, 1)
        self.relu_residual = relu_residual

    def forward(self, x):
        r = self.conv_r(x)
        if self.relu_residual:
            return self.conv_b(x) + torch.relu(r)
        return self.conv_b(x) + r, r


@pytest.mark.parametrize("relu_residual", [False, True])
def test_bias_stays_where_the_residual_has_other_uses_or_an_activation(relu_residual):
    model = ResidualWithOtherUses(relu_residual).eval()
    gm = prepare_for_inference(model)
    assert gm.fuse_report.moved_biases == {}
    assert gm.conv_r.bias is not None
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        got, want = gm(x), model(x)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert relative_error(a, b) < 1e-6
