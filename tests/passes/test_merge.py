"""nn.merge: sibling convs (same input, same geometry) merged into one by `prepare_for_inference`."""
import torch
from torch import nn

from sparsecnn.core.reference import relative_error
from sparsecnn.nn import SparseConv2d
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.passes.merge import merge_sibling_convs


class Siblings(nn.Module):
    """Convs reading x: a, b and c merge (1x1, ReLU); d is 3x3, e has no ReLU, f takes a residual, g
    is called twice, h reads another tensor: none of those merge."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 5, 1)
        self.c = nn.Conv2d(3, 2, 1)
        self.d = nn.Conv2d(3, 4, 3, padding=1)
        self.e = nn.Conv2d(3, 3, 1)
        self.f = nn.Conv2d(3, 3, 1)
        self.g = nn.Conv2d(3, 3, 1)
        self.h = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = x * 2
        parts = [torch.relu(self.a(x)), torch.relu(self.b(x)), torch.relu(self.c(x)), torch.relu(self.d(x)),
                 self.e(x), torch.relu(self.f(x) + y), self.g(x) + self.g(y), self.h(y)]
        return torch.cat(parts, 1)


class Block(nn.Module):
    """Two nested sibling convs, as in an inception block (`branch1.conv`, `branch2.0.conv`)."""

    def __init__(self):
        super().__init__()
        self.branch1 = nn.Sequential()
        self.branch1.conv = nn.Conv2d(3, 4, 1)
        self.branch2 = nn.Sequential(nn.Sequential())
        self.branch2[0].conv = nn.Conv2d(3, 6, 1)

    def forward(self, x):
        return self.branch1.conv(x) - self.branch2[0].conv(x)[:, :4]


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def _sparse(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.weight.mul_(torch.rand_like(module.weight) > 0.5)
                module.bias.normal_()
    return model.eval()


def test_siblings_merge_into_one_conv_and_the_outputs_stay():
    model = _sparse(Siblings())
    x = torch.randn(2, 3, 7, 5)
    gm = prepare_for_inference(model, example_inputs=(x,))
    assert gm.fuse_report.merged_convs == {"merged__a__b__c": ["a", "b", "c"]}
    assert "3 sibling convs merged into 1" in gm.fuse_report.summary()
    merged = gm.get_submodule("merged__a__b__c")
    assert isinstance(merged, SparseConv2d) and merged.activation == "relu" and merged.out_channels == 11
    assert torch.equal(merged.weight, torch.cat([model.a.weight, model.b.weight, model.c.weight]))
    assert torch.equal(merged.mask, torch.cat([m.weight != 0 for m in (model.a, model.b, model.c)]))
    assert torch.equal(merged.bias, torch.cat([model.a.bias, model.b.bias, model.c.bias]))
    names = {name for name, _ in gm.named_modules()}
    assert not names & {"a", "b", "c"} and {"d", "e", "f", "g", "h"} <= names
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


def test_nested_siblings_are_named_under_their_common_parent():
    model = _sparse(Nested())
    gm = prepare_for_inference(model)
    name = "block.merged__branch1_conv__branch2_0_conv"
    assert gm.fuse_report.merged_convs == {name: ["block.branch1.conv", "block.branch2.0.conv"]}
    x = torch.randn(3, 3, 4, 6)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < 1e-6


def test_conv1d_grouped_and_tuned_siblings_do_not_merge():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv1d(3, 4, 1), nn.Conv1d(3, 4, 1)
            self.c, self.d = nn.Conv2d(4, 4, 1, groups=2), nn.Conv2d(4, 4, 1, groups=2)

        def forward(self, x):
            y = (self.a(x) + self.b(x)).unsqueeze(2)
            return self.c(y) + self.d(y)

    gm = prepare_for_inference(_sparse(Mixed()))
    assert gm.fuse_report.merged_convs == {}

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return self.a(x) * self.b(x)

    gm = prepare_for_inference(_sparse(Pair()))
    assert list(gm.fuse_report.merged_convs) == ["merged__a__b"]
    unmerged = torch.fx.symbolic_trace(Pair())
    for name in ("a", "b"):
        setattr(unmerged, name, SparseConv2d.from_dense(getattr(unmerged, name)))
    unmerged.a.set_backend("im2col-cublas", None)  # a layer already tuned keeps its choice
    assert merge_sibling_convs(unmerged) == {}
