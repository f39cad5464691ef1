"""What the Triton backends (`direct`, `blocks`) share: lazy imports, dtypes, where `auto` may pick
them, and the layers they refuse."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from sparsecnn.backends import get_backend
from sparsecnn.core.spec import ConvSpec

SMALL = ConvSpec(3, 3, 33, 13, 13, 3, 3, 2, 1, name="small")
LARGE = ConvSpec(32, 256, 256, 14, 14, 3, 3, 1, 1, name="r50-layer3-3x3")
TRITON_BACKENDS = ("direct", "blocks", "tensorcore")


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("name", TRITON_BACKENDS)
def test_import_does_not_import_triton_or_cuda(name):
    code = ("import sys, torch, sparsecnn, sparsecnn.backends, sparsecnn.backends.direct.format; "
            f"sparsecnn.backends.get_backend({name!r}); "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "assert not torch.cuda.is_initialized(), 'cuda initialised'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": ""})


@pytest.mark.parametrize("name", TRITON_BACKENDS)
def test_backend_registration_and_spec_check(name, monkeypatch):
    backend = get_backend(name)
    assert backend.dtypes["cuda"] == (torch.float32, torch.float16, torch.bfloat16)
    assert backend.autotune_devices == ("cuda",)  # `auto` never picks the CPU interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.unsupported_reason(SMALL, torch.float32, "cpu") is None
    assert "float16" in backend.unsupported_reason(SMALL, torch.float16, "cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "cpu" in backend.unsupported_reason(SMALL, torch.float32, "cpu")
    assert "groups" in backend.spec_check(dataclasses.replace(SMALL, groups=3))
    assert "dilation" in backend.spec_check(dataclasses.replace(SMALL, dilation=2))
    assert backend.spec_check(LARGE) is None
