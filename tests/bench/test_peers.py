"""`bench.peers`: adapters loaded by path from a folder (the checkout's benchmarks/peers) only when
asked for, with errors that say what is missing."""
import pytest

from sparsecnn.bench import peers
from sparsecnn.core.spec import ConvSpec


def test_the_checkout_holds_the_sputnik_adapter():
    assert "sputnik" in peers.peer_names()


def test_an_adapter_is_loaded_once_by_path(tmp_path):
    (tmp_path / "fake.py").write_text(
        "from sparsecnn.bench.peers import Peer\n"
        "LOADS = []\n"
        "def load_peer():\n"
        "    LOADS.append(1)\n"
        "    return Peer('fake', ('fake',), ('fp32',), lambda s, d, t: None, lambda v, s, d: {}, None)\n")
    (tmp_path / "_helper.py").write_text("")
    assert peers.peer_names(tmp_path) == ["fake"]
    assert peers.load_peer("fake", tmp_path).name == "fake"
    assert peers.peer_module("fake", tmp_path) is peers.peer_module("fake", tmp_path)
    assert peers.peer_module("fake", tmp_path).LOADS == [1]


def test_missing_adapters_and_bad_ones_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no peer adapter 'nope'.*holds none"):
        peers.load_peer("nope", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        peers.load_peer("nope", tmp_path / "missing")
    (tmp_path / "odd.py").write_text("def load_peer():\n    return 1\n")
    with pytest.raises(TypeError, match="not a Peer"):
        peers.load_peer("odd", tmp_path)


def test_the_report_shows_peers_but_counts_only_ours_in_sparse_efficiency():
    from sparsecnn.bench import environment, markdown_table
    from sparsecnn.bench.report import efficiency

    base = {"run": "r", "kind": "layer", **environment("cpu"), "device": "NVIDIA H100 80GB HBM3", "suite": "s",
            "layer": "l", "model": None, "N": 32, "C": 64, "K": 64, "H": 56, "W": 56, "R": 3, "S": 3,
            "stride": [1, 1], "padding": [1, 1], "dtype": "fp32", "sparsity": 0.9, "pattern": "random",
            "config": None, "mode": "gpu", "rel_err": 1e-7, "floor_ms": 0.1}
    rows = [{**base, "backend": backend, "median_ms": ms, "p20_ms": ms, "p80_ms": ms}
            for backend, ms in (("cudnn", 4.0), ("unrolled", 2.0), (peers.PEER_PREFIX + "sputnik", 1.0))]
    table = markdown_table(rows)
    assert "peer:sputnik ms" in table and "4.00×" in table  # the peer's column and speedup
    assert f"{100 * efficiency(rows[1]):.3g}%" in table.splitlines()[-3]  # unrolled's, not the peer's


def test_the_checks_every_peer_makes_first():
    plain, grouped = ConvSpec(1, 4, 4, 5, 5, 3, 3), ConvSpec(1, 4, 4, 5, 5, 3, 3, groups=2)
    dilated = ConvSpec(1, 4, 4, 9, 9, 3, 3, dilation=2)
    reason = peers.common_unsupported_reason
    assert reason("P", ("fp32",), plain, "fp32", "cuda", needs_cuda=True) is None
    assert reason("P", ("fp32",), plain, "fp32", "cpu", needs_cuda=False) is None  # a CPU stand-in
    assert reason("P", ("fp32",), plain, "fp32", "cpu", needs_cuda=True) == "P needs a CUDA device"
    assert reason("P", ("fp32", "fp16"), plain, "bf16", "cuda", True, "why") == "P runs fp32, fp16, not bf16 (why)"
    for spec in (grouped, dilated):
        assert "grouped and dilated" in reason("P", ("fp32",), spec, "fp32", "cuda", needs_cuda=True)
