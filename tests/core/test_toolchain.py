"""The compiled-kernel disk cache (core/toolchain.py): entries carry their sha256, so a truncated,
damaged or foreign file is a miss that is removed with one warning, and compiling again replaces it."""
import warnings

import pytest

from sparsecnn.core import toolchain


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain.DiskCache, "_warned", False)
    return toolchain.DiskCache(tmp_path)


def test_an_entry_round_trips_and_its_file_carries_the_digest(cache):
    cache.put("abcdef", "cubin", b"\x7fELF kernel bytes")
    assert cache.get("abcdef", "cubin") == b"\x7fELF kernel bytes"
    raw = cache.path("abcdef", "cubin").read_bytes()
    assert raw != b"\x7fELF kernel bytes" and toolchain.decode_entry(raw) == b"\x7fELF kernel bytes"
    assert cache.get("abcdef", "ptx") is None  # another suffix: a plain miss


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "empty"])
def test_a_damaged_or_foreign_file_is_a_miss_removed_with_one_warning(cache, damage):
    cache.put("abcdef", "cubin", b"kernel bytes " * 100)
    path = cache.path("abcdef", "cubin")
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[:-7], "flipped": raw[:-1] + bytes([raw[-1] ^ 1]),
                      "foreign": b"\x7fELF a cubin from elsewhere", "empty": b""}[damage])
    corrupt = toolchain.CACHE_STATS["corrupt"]
    with pytest.warns(RuntimeWarning, match="compiling again"):
        assert cache.get("abcdef", "cubin") is None
    assert not path.exists() and toolchain.CACHE_STATS["corrupt"] == corrupt + 1
    cache.put("abcdef", "cubin", b"recompiled")
    assert cache.get("abcdef", "cubin") == b"recompiled"


def test_only_the_first_damaged_file_warns(cache):
    for key in ("aa1111", "bb2222"):
        cache.put(key, "ptx", b"text")
        cache.path(key, "ptx").write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning):
        assert cache.get("aa1111", "ptx") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get("bb2222", "ptx") is None


@pytest.mark.parametrize("torch_cuda, expected", [
    ("13.0", ["cu13/bin"]), ("12.4", ["cuda_nvcc/bin"]), (None, ["cu13/bin", "cuda_nvcc/bin"]), ("11.8", [])])
def test_the_wheel_of_torchs_cuda_major_version_is_the_one_looked_in(tmp_path, monkeypatch, torch_cuda, expected):
    import importlib

    import torch

    (tmp_path / "site" / "nvidia").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    root = str(tmp_path / "site" / "nvidia")
    assert [d[len(root) + 1:] for d in toolchain.wheel_bin_dirs() if d.startswith(root)] == expected


def test_nvidias_pip_wheel_is_the_last_place_looked_in(tmp_path, monkeypatch):
    import importlib
    import os

    tool = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "ptxas"  # where nvidia-cuda-nvcc 13.x puts it
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    for name in ("SPARSECNN_PTXAS", "CUDA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(toolchain, "SEARCH_DIRS", ())
    monkeypatch.setattr(toolchain, "torch_cuda_major", lambda: 13)
    assert str(tool.parent) in toolchain.wheel_bin_dirs()
    assert toolchain.find_tool("ptxas") == str(tool)
    system = tmp_path / "system" / "ptxas"  # a toolkit on PATH comes first
    system.parent.mkdir()
    system.write_text("#!/bin/sh\n")
    system.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(system.parent), str(tmp_path / "empty")]))
    assert toolchain.find_tool("ptxas") == str(system)
