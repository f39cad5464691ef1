"""Fixtures every test gets: a throwaway tuning cache, a seeded RNG, and the `gpu` marker's skip
without a GPU. Helpers shared by test files live in `helpers/`."""
import os
import tempfile

import pytest
import torch

# Autotune decisions of test runs go to a throwaway directory, never the user's cache.
os.environ.setdefault("SPARSECNN_CACHE_DIR", tempfile.mkdtemp(prefix="sparsecnn-test-cache-"))


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
