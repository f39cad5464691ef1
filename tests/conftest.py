"""Shared fixtures: seeded RNG, the `gpu` marker's skip, sparse weights that are never all zero."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def sparse_weight(shape, sparsity: float, generator=None) -> torch.Tensor:
    """Normal weights with a uniform random `sparsity` fraction set to exactly zero."""
    weight = torch.randn(shape, generator=generator)
    keep = torch.rand(shape, generator=generator) >= sparsity
    return weight * keep
