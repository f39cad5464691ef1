"""What the tuner offers per layer (`tuning.select.candidates_for`) when a machine lacks what a
backend needs besides the device: the backend is left out, and the reason is said once."""
import logging

import pytest
import torch

from sparsecnn.core import cubin_loader, toolchain
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning import select
from sparsecnn.tuning.precision import resolve_policy

GENERATED = {"codegen", "staged", "unrolled"}
SPECS = [ConvSpec(32, 64, 64, 14, 14, 3, 3, 1, 1), ConvSpec(32, 128, 64, 14, 14, 1, 1),
         ConvSpec(32, 64, 96, 28, 28, 3, 3, 1, 1)]
OFFERED_HERE = {"codegen", "unrolled"}   # staged's auto rule skips these layers


def _offered(spec):
    return {candidate.backend for candidate in select.candidates_for(spec, resolve_policy("fp32", torch.float32),
                                                                      "cuda")}


@pytest.fixture
def fresh_messages(monkeypatch):
    monkeypatch.setattr(select, "_SAID", set())


def test_without_ptxas_the_generated_backends_are_left_out_with_one_warning(monkeypatch, caplog, fresh_messages):
    monkeypatch.setattr(toolchain, "find_tool", lambda name: None)
    monkeypatch.setattr(cubin_loader, "missing_loader", lambda: None)
    with caplog.at_level(logging.WARNING, logger="sparsecnn.tuning.select"):
        offered = [_offered(spec) for spec in SPECS]
    assert not any(GENERATED & backends for backends in offered)
    assert all({"dense", "direct"} <= backends for backends in offered)
    warnings = sorted(record.getMessage() for record in caplog.records)
    assert len(warnings) == 2, warnings   # one per process and reason, not one per layer
    assert warnings[0].startswith("codegen, staged not tried: no nvcc or ptxas found")
    assert warnings[1].startswith("unrolled not tried: no ptxas found")
    assert all("sparsecnn[gpu]" in warning for warning in warnings)


def test_without_a_kernel_loader_they_are_left_out_and_the_loader_named(monkeypatch, caplog, fresh_messages):
    monkeypatch.setattr(toolchain, "missing_tools", lambda *names: None)
    monkeypatch.setattr(cubin_loader, "missing_loader", lambda: "needs cuda-python or CuPy")
    with caplog.at_level(logging.WARNING, logger="sparsecnn.tuning.select"):
        assert not GENERATED & _offered(SPECS[0])
    assert [record.getMessage() for record in caplog.records] == [
        "codegen, staged, unrolled not tried: needs cuda-python or CuPy"]


def test_with_their_tools_they_are_offered_and_nothing_is_said(monkeypatch, caplog, fresh_messages):
    monkeypatch.setattr(toolchain, "find_tool", lambda name: f"/opt/cuda/bin/{name}")
    monkeypatch.setattr(cubin_loader, "missing_loader", lambda: None)
    with caplog.at_level(logging.WARNING, logger="sparsecnn.tuning.select"):
        assert OFFERED_HERE <= _offered(SPECS[0])
    assert caplog.records == []


def test_only_ptxas_is_asked_for_unrolled(monkeypatch, fresh_messages):
    monkeypatch.setattr(toolchain, "find_tool", lambda name: "/opt/cuda/bin/ptxas" if name == "ptxas" else None)
    monkeypatch.setattr(cubin_loader, "missing_loader", lambda: None)
    assert GENERATED & _offered(SPECS[0]) == {"unrolled"}


def test_staged_is_tried_unasked_only_where_no_tf32_candidate_is(monkeypatch, fresh_messages):
    """`auto_with_tf32=False` (staged: no layer won against cuDNN TF32 in measured tunings): absent
    from `auto` under the TF32 policies, offered under exact fp32 and whenever it is named."""
    monkeypatch.setattr(toolchain, "find_tool", lambda name: f"/opt/cuda/bin/{name}")
    monkeypatch.setattr(cubin_loader, "missing_loader", lambda: None)
    spec = ConvSpec(32, 64, 128, 56, 56, 3, 3, 1, 1)
    backends = {name: {c.backend for c in select.candidates_for(spec, resolve_policy(name, torch.float32), "cuda")}
                for name in ("fp32", "fp32-default", "tf32")}
    assert "staged" in backends["fp32"]
    assert "staged" not in backends["fp32-default"] | backends["tf32"]
    assert {"codegen", "unrolled", "direct"} & backends["fp32-default"]  # the others stay
    named = select.candidates_for(spec, resolve_policy("fp32-default", torch.float32), "cuda", backends=["staged"])
    assert any(c.backend == "staged" for c in named)
