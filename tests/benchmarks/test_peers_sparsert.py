"""benchmarks/peers/sparsert.py, the SparseRT peer of `bench layers --peers sparsert`.

On CPU: the launch candidates, the layers it refuses, the operands (the guarded image buffer, B)
and the pure-torch stand-in for the cubins (the data path, fp64 against F.conv2d on odd shapes),
the launch choice, the bench rows, and the errors without a generator. With the generator made
(SPARSECNN_SPARSERT_COMPILE; this file builds nothing): its cubins for a few launches, which needs
no GPU, and on a GPU its kernels against the fp64 reference. A GPU run without the generator fails,
saying how to make it.
"""
import functools
import time

import pytest
import torch
import torch.nn.functional as F
from helpers.common import OPTIONAL_PREFIX, sparse_weight
from helpers.peers import assert_one_row_per_variant, peer_rows

from sparsecnn import settings
from sparsecnn.bench.peers import load_peer, peer_module
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

sparsert = peer_module("sparsert")
Launch = sparsert.Launch


def _conv3x3(c=3, k=33, h=13, name="") -> ConvSpec:
    return ConvSpec(1, c, k, h, h, 3, 3, 1, 1, name=name)


def _pointwise(n=2, c=3, k=33, h=13, name="") -> ConvSpec:
    return ConvSpec(n, c, k, h, h, 1, 1, name=name)


def _name(spec: ConvSpec) -> str:
    return f"N{spec.N}-C{spec.C}-K{spec.K}-H{spec.H}-{spec.R}x{spec.S}"


def _weight(spec: ConvSpec, sparsity=0.7, seed=0, dtype=torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return sparse_weight(spec.weight_shape, sparsity, generator).to(dtype)


def _input(spec: ConvSpec, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(spec.input_shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def _stand_in(x: torch.Tensor, weight: torch.Tensor, spec: ConvSpec, guard=0.0) -> torch.Tensor:
    """What the cubin of `weight` outputs for x, by the stand-in, as the peer's operands hold it."""
    operands = sparsert.make_operands(x, spec, guard)
    assert operands.out.isnan().all()  # poisoned until the kernel writes it
    operands.out.copy_(sparsert.torch_kernel(operands.kind, sparsert.weight_matrix(weight), operands.data, spec))
    return operands.output()


# --- launch candidates and the layers SparseRT refuses -----------------------------------------------------
ODD_SPECS = [_conv3x3(), _conv3x3(c=64, k=64, h=56), _conv3x3(c=5, k=7, h=1), _conv3x3(c=512, k=512, h=7),
             _conv3x3(c=4, k=37, h=8), _pointwise(), _pointwise(n=1), _pointwise(n=3, c=5, k=7, h=6),
             _pointwise(n=1, c=1024, k=256, h=14), _pointwise(n=1, c=8, k=2, h=31)]


@pytest.mark.parametrize("spec", ODD_SPECS, ids=_name)
def test_launch_candidates_are_valid_launches(spec):
    assert sparsert.unsupported_reason(spec, "fp32", "cuda") is None
    candidates = sparsert.launch_candidates(spec)
    cols = spec.H * spec.W * (1 if spec.R == 3 else spec.N)
    assert sparsert.columns(spec) == cols
    assert 1 <= len(candidates) <= 4 and len(set(candidates)) == len(candidates)
    for launch in candidates:
        assert spec.K % launch.a_blocks == 0 and spec.K // launch.a_blocks <= sparsert.MAX_ROWS
        assert launch.c_blocks * launch.threads == cols and 1 <= launch.threads <= sparsert.MAX_THREADS
        assert launch.grid == (launch.a_blocks, launch.c_blocks, 1) and launch.block == (launch.threads, 1, 1)


def test_launch_candidates_prefer_whole_warps_and_grids_that_fill_the_gpu():
    candidates = sparsert.launch_candidates(_conv3x3(c=64, k=64, h=56))  # 3136 = 2^6 * 7^2 columns
    # 7 and 2 full warps; 16 channels a block when that makes >= 128 blocks, else fewer channels.
    assert [(64 // launch.a_blocks, launch.c_blocks, launch.threads) for launch in candidates] == [
        (4, 14, 224), (8, 14, 224), (16, 49, 64), (8, 49, 64)]
    assert sparsert.rows_per_block(512, 1)[:3] == [4, 8, 16]  # 128 blocks fill the GPU; then 64, 32
    odd = sparsert.launch_candidates(_conv3x3())  # 169 columns: one block of 169, never 13 threads
    assert {(launch.threads, launch.c_blocks) for launch in odd} == {(169, 1)}
    assert {launch.a_blocks for launch in odd} == {3, 1}  # 11 and 33 channels a block
    assert {launch.a_blocks for launch in sparsert.launch_candidates(_conv3x3(k=37))} == {1}  # prime K <= 64
    assert sparsert.rows_per_block(134) == [] and sparsert.rows_per_block(2) == [2]


def test_unsupported_reasons():
    assert sparsert.unsupported_reason(_conv3x3(), "fp32", "cpu", compiled=False) is None
    assert "CUDA" in sparsert.unsupported_reason(_conv3x3(), "fp32", "cpu")
    for dtype in ("fp16", "bf16", "tf32"):
        assert f"runs fp32, not {dtype}" in sparsert.unsupported_reason(_conv3x3(), dtype, "cuda")
    reasons = {
        "(batch 1), got N=2": ConvSpec(2, 3, 33, 13, 13, 3, 3, 1, 1),
        "square images, got H=13, W=12": ConvSpec(1, 3, 33, 13, 12, 3, 3, 1, 1),
        "not 3x3 stride (2, 2) padding (1, 1)": ConvSpec(1, 3, 33, 13, 13, 3, 3, 2, 1),
        "not 3x3 stride (1, 1) padding (0, 0)": ConvSpec(1, 3, 33, 13, 13, 3, 3, 1, 0),
        "not 1x1 stride (2, 2)": ConvSpec(1, 3, 33, 13, 13, 1, 1, 2),
        "not 5x5": ConvSpec(1, 3, 33, 13, 13, 5, 5, 1, 2),
        "grouped and dilated": ConvSpec(1, 4, 4, 13, 13, 3, 3, 1, 1, groups=2),
        "N = 0": _pointwise(n=0),
        "K=134 has no divisor": _pointwise(k=134),
        "32-bit": _pointwise(n=256, c=2048, k=64, h=32),
    }
    for expected, spec in reasons.items():
        assert expected in sparsert.unsupported_reason(spec, "fp32", "cuda"), spec
    assert "grouped" in sparsert.unsupported_reason(ConvSpec(1, 4, 4, 13, 13, 3, 3, 1, 2, 2), "fp32", "cuda")


# --- the operands and the stand-in data path ---------------------------------------------------------------
def test_the_guarded_buffer_holds_the_image_between_w_plus_1_guard_floats():
    spec = _conv3x3(c=3, k=4, h=5)
    x = _input(spec)
    operands = sparsert.make_operands(x, spec, guard=7.0)
    data, image = operands.data, operands.input()
    assert data.shape == (3 * 25 + 2 * 6,) and sparsert.guard_floats(spec) == 6
    assert image.shape == (1, 3, 5, 5) and image.data_ptr() == data.data_ptr() + 6 * data.element_size()
    assert torch.equal(image, x) and (data[:6] == 7).all() and (data[-6:] == 7).all()
    assert operands.out.shape == (4, 25) and operands.output().shape == spec.output_shape


def test_spmm_reads_x_itself_at_batch_1_and_its_permute_else():
    spec = _pointwise(n=1)
    x = _input(spec)
    assert sparsert.make_operands(x, spec).data.data_ptr() == x.data_ptr()  # no copy
    spec = _pointwise(n=3, c=5, k=7, h=6)
    x = _input(spec)
    data = sparsert.make_operands(x, spec).data
    assert data.shape == (5, 3 * 36) and torch.equal(data, x.transpose(0, 1).reshape(5, -1))


STAND_IN_SPECS = [_conv3x3(), _conv3x3(c=5, k=7, h=1), _conv3x3(c=4, k=6, h=8), _pointwise(n=1), _pointwise(),
                  _pointwise(n=3, c=5, k=7, h=6)]


@pytest.mark.parametrize("spec", STAND_IN_SPECS, ids=_name)
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("guard", [0.0, 1e3])
def test_the_stand_in_data_path_reproduces_conv2d_in_fp64(spec, sparsity, guard):
    weight, x = _weight(spec, sparsity), _input(spec)
    out = _stand_in(x, weight, spec, guard)  # finite guards: multiplied by 0 wherever read
    ref = F.conv2d(x, weight, padding=spec.padding)
    assert out.shape == ref.shape and relative_error(out, ref) < 1e-12


def test_the_stand_in_reads_the_guards_where_the_kernel_does():
    spec = _conv3x3(c=2, k=3, h=6)
    out = _stand_in(_input(spec), _weight(spec, 0.0), spec, guard=float("nan"))  # NaN * 0 is NaN
    # The W+1 floats before the image: the row above row 0, and the left of (1, 0); after it, mirrored.
    reads_guard = torch.zeros(6, 6, dtype=torch.bool)
    reads_guard[[0, -1]] = True
    reads_guard[1, 0] = reads_guard[-2, -1] = True
    assert torch.equal(out.isnan(), reads_guard.expand_as(out))


def test_the_stand_in_drops_the_weights_the_generator_drops():
    spec = _pointwise(n=1, c=4, k=2, h=3)
    weight = torch.zeros(spec.weight_shape, dtype=torch.float64)
    weight[0, 1], weight[1, 2] = sparsert.WEIGHT_EPS / 2, 1.0
    out = _stand_in(_input(spec), weight, spec)
    assert (out[:, 0] == 0).all() and torch.allclose(out, F.conv2d(_input(spec), weight), atol=1e-7)


# --- choosing a launch -------------------------------------------------------------------------------------
def test_fastest_times_every_call_and_picks_the_quickest():
    slow, quick = Launch(1, 1, 32), Launch(2, 1, 32)
    calls = {slow: lambda: time.sleep(3e-3), quick: lambda: None}
    launch, times = sparsert.fastest(calls, torch.device("cpu"))
    assert launch == quick and set(times) == {slow, quick} and times[quick] < times[slow]


def test_the_tuner_builds_each_weight_once():
    builds = []

    def build(matrix, spec, launches):
        builds.append(list(launches))
        return sparsert.torch_build(matrix, spec, launches)

    tuner, spec = sparsert.Tuner(build), _conv3x3()
    weight, x = _weight(spec), _input(spec)
    first = tuner.choose(sparsert.weight_matrix(weight), sparsert.make_operands(x, spec))
    again = tuner.choose(sparsert.weight_matrix(weight.clone()), sparsert.make_operands(x, spec))
    assert again is first and builds == [sparsert.launch_candidates(spec)]
    assert first.launch in builds[0] and set(first.times) == set(builds[0])
    tuner.choose(sparsert.weight_matrix(_weight(spec, seed=5)), sparsert.make_operands(x, spec))
    assert len(builds) == 2


@pytest.mark.parametrize("spec", [_conv3x3(), _pointwise(n=1), _pointwise(n=3, c=5, k=7, h=6)], ids=_name)
def test_the_variants_on_cpu_with_the_stand_in(spec):
    peer = sparsert.make_peer(sparsert.torch_build)
    weight, x = _weight(spec), _input(spec)
    conv, kernel = (peer.bind(variant, weight, x, spec, "fp32") for variant in sparsert.VARIANTS)
    ref = F.conv2d(x, weight, padding=spec.padding)
    assert relative_error(kernel(), ref) < 1e-12
    out = conv()
    assert out.is_contiguous() and relative_error(out, ref) < 1e-12
    x.mul_(-2)  # the convolution loads x on every call: it follows
    assert relative_error(conv(), -2 * ref) < 1e-12
    for variant in sparsert.VARIANTS:
        config = peer.config(variant, spec, "fp32")
        chosen = Launch(config["a_blocks"], config["c_blocks"], config["threads"])
        assert chosen in sparsert.launch_candidates(spec) and len(config["candidates"]) >= 1
        assert config["part"] == ("conv" if variant == "sparsert" else "kernel")
    assert peer.config("sparsert", _conv3x3(h=5), "fp32")["a_blocks"] is None  # not bound


def test_bench_layers_rows_of_the_peer_on_cpu_with_the_stand_in():
    specs = [_conv3x3(name="c3"), _pointwise(n=2, c=8, k=16, h=5, name="pw"),
             ConvSpec(1, 3, 33, 13, 13, 3, 3, 2, 1, name="strided")]
    rows = peer_rows(sparsert.make_peer(sparsert.torch_build), specs, "cpu")
    assert_one_row_per_variant(rows, ("c3", "pw"), sparsert.VARIANTS)  # "strided" is skipped with a note
    assert [row["config"]["input"] for row in rows] == ["guarded copy"] * 2 + ["permute"] * 2
    assert {row["config"]["kind"] for row in rows} == {"conv3x3", "spmm"}


# --- the generator, and its errors ---------------------------------------------------------------------------
MAKE = ("build it with benchmarks/peers/build_sparsert.sh (nvcc, ptxas, SparseRT's source) and set "
        "SPARSECNN_SPARSERT_COMPILE to the sparsert_compile.py it prints")


def test_load_peer_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARSECNN_SPARSERT_COMPILE", raising=False)
    with pytest.raises(FileNotFoundError, match="SPARSECNN_SPARSERT_COMPILE is not set.*build_sparsert.sh"):
        load_peer("sparsert")
    monkeypatch.setenv("SPARSECNN_SPARSERT_COMPILE", str(tmp_path / "nope.py"))
    with pytest.raises(FileNotFoundError, match="nope.py: no such file.*build_sparsert.sh"):
        load_peer("sparsert")
    script = tmp_path / "sparsert_compile.py"
    script.write_text("# not made by build_sparsert.sh")
    monkeypatch.setenv("SPARSECNN_SPARSERT_COMPILE", str(script))
    with pytest.raises(FileNotFoundError, match="no build stamp.*build_sparsert.sh"):
        load_peer("sparsert")
    (tmp_path / ".stamp").write_text(f"{'0' * 40} 90 {tmp_path / 'no-nvcc'}\n")
    with pytest.raises(FileNotFoundError, match="no-nvcc, which this machine lacks"):
        load_peer("sparsert")


def _compile_script(on_gpu: bool):
    """The generator SPARSECNN_SPARSERT_COMPILE names; without one the test is skipped as an
    optional extra, as Sputnik's are without their library (the skip summary counts it). on_gpu:
    whether the caller is a GPU test (said in the reason)."""
    path = settings.sparsert_compile()
    if path is None or not path.is_file():
        where = "GPU test" if on_gpu else "offline compile test"
        pytest.skip(f"{OPTIONAL_PREFIX}{where} needs SparseRT's generator: {MAKE} (set: {path})")
    return path


@pytest.mark.parametrize("spec", [_conv3x3(), _pointwise(n=2)], ids=_name)
def test_the_generator_compiles_every_candidate_without_a_gpu(spec, tmp_path):
    compiler = sparsert.SparseRTCompiler(_compile_script(on_gpu=False))
    assert len(compiler.commit) == 40 and compiler.arch.startswith("sm_")
    weight_file = tmp_path / "weight.npy"
    sparsert.np.save(weight_file, sparsert.weight_matrix(_weight(spec, dtype=torch.float32)).numpy())
    for index, launch in enumerate(sparsert.launch_candidates(spec)):
        assert compiler.compile(weight_file, spec, launch, tmp_path / f"{index}.cubin")[:4] == b"\x7fELF"
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\):\nsparsert_compile: unsupported K=33"):
        compiler.compile(weight_file, spec, Launch(5, 1, sparsert.columns(spec)), tmp_path / "bad.cubin")


# --- on a GPU, with the generator made ---------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _loaded_peer():
    return load_peer("sparsert")


def _gpu_peer():
    _compile_script(on_gpu=True)
    return _loaded_peer()  # one peer: both variants of a layer share its compiled kernels


# h=8: a power of two (build_sparsert.sh's pixel marker); h=37: 37 threads a block, as many as W.
GPU_SPECS = [_conv3x3(), _conv3x3(h=56), _conv3x3(c=16, k=32, h=8), _conv3x3(h=37), _conv3x3(c=64, k=64, h=14),
             _pointwise(n=1), _pointwise(n=2), _pointwise(n=2, c=64, k=256, h=14)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sparsert.VARIANTS)
@pytest.mark.parametrize("spec", GPU_SPECS, ids=_name)
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 1.0])
def test_sparsert_fp32_matches_the_fp64_reference(variant, spec, sparsity):
    peer = _gpu_peer()
    weight, x = _weight(spec, sparsity, dtype=torch.float32).cuda(), _input(spec, torch.float32).cuda()
    run = peer.bind(variant, weight, x, spec, "fp32")  # its outputs start as NaN
    out = run()
    torch.cuda.synchronize()
    ref = reference_conv(x, weight, None, padding=spec.padding, fp64=True)
    assert out.shape == ref.shape and relative_error(out, ref) < 1e-5
    launch = peer.config(variant, spec, "fp32")
    assert Launch(launch["a_blocks"], launch["c_blocks"], launch["threads"]) in sparsert.launch_candidates(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [_conv3x3(), _conv3x3(c=16, k=32, h=28), _pointwise(n=2)], ids=_name)
def test_every_launch_candidate_matches_the_fp64_reference(spec):
    compiler = sparsert.SparseRTCompiler(_compile_script(on_gpu=True))
    weight, x = _weight(spec, dtype=torch.float32).cuda(), _input(spec, torch.float32).cuda()
    runners = compiler.build(sparsert.weight_matrix(weight), spec, sparsert.launch_candidates(spec))
    ref = reference_conv(x, weight, None, padding=spec.padding, fp64=True)
    for launch, runner in runners.items():
        operands = sparsert.make_operands(x, spec, guard=1e3)  # NaN output; finite garbage in the guards
        runner(operands)()
        torch.cuda.synchronize()
        assert relative_error(operands.output(), ref) < 1e-5, launch


@pytest.mark.gpu
@pytest.mark.timing
def test_sparsert_rows_on_the_gpu():
    specs = [ConvSpec(1, 64, 64, 14, 14, 3, 3, 1, 1, name="c3"), ConvSpec(2, 64, 256, 14, 14, 1, 1, name="c1")]
    rows = peer_rows(_gpu_peer(), specs, "cuda", sparsity=0.9, baselines=False)
    assert_one_row_per_variant(rows, ("c3", "c1"), sparsert.VARIANTS)
    assert all(row["config"]["sparsert"] and row["config"]["threads"] for row in rows)
