"""core/triton_ahead.py: Triton compiles in worker processes, deduplicated, never waited for."""
from concurrent.futures import Future

import torch
from helpers.triton_compiles import run_compiling

from sparsecnn.core import triton_ahead
from sparsecnn.core.workers import WorkerPool

LAUNCH = ("pkg.module:kernel", (torch.float16, 64, 1, 30), {"BLOCK": 32, "num_warps": 4})


def test_a_launch_key_holds_what_triton_specializes_on():
    key = triton_ahead.launch_key(LAUNCH)
    assert key == triton_ahead.launch_key(("pkg.module:kernel", (torch.float16, 128, 1, 46), {"num_warps": 4,
                                                                                              "BLOCK": 32}))
    for other in [(torch.float32, 64, 1, 30), (torch.float16, 65, 1, 30), (torch.float16, 64, 2, 30),
                  (torch.float16, 64, 1, 2 ** 31)]:
        assert triton_ahead.launch_key((LAUNCH[0], other, LAUNCH[2])) != key, other
    assert triton_ahead.launch_key((LAUNCH[0], LAUNCH[1], {"BLOCK": 64, "num_warps": 4})) != key


class _Pool:
    """An executor that records submissions and finishes only the futures a test completes."""

    def __init__(self, workers):
        self.futures = []

    def submit(self, fn, *args):
        future = Future()
        self.futures.append((future, args))
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def test_each_specialization_is_submitted_once_and_settling_never_waits():
    pool = WorkerPool("test compile", lambda: 2, triton_ahead._LOG, _Pool)
    ahead = triton_ahead.AheadCompiles("test compile", pool)
    twin = (LAUNCH[0], (torch.float16, 128, 1, 46), LAUNCH[2])  # the same specialization
    other = (LAUNCH[0], (torch.float32, 64, 1, 30), LAUNCH[2])
    ahead.submit("layer 1", [LAUNCH, other], arch=90)
    ahead.submit("layer 2", [twin], arch=90)  # shares layer 1's compile
    assert len(pool.pool.futures) == 2
    (done, args), (queued, _) = pool.pool.futures
    assert args[1:] == ("pkg.module:kernel", 90, LAUNCH[1], LAUNCH[2])  # _timed(compile_in_worker, ...)
    done.set_result((0.0, 0.5, None))
    ahead.settle("layer 1")  # the finished job taken, the queued one cancelled: nothing waits
    assert not pool.pending and queued.cancelled() and pool.times.jobs == 1
    ahead.settle("layer 2")  # its compile was taken with layer 1's
    ahead.settle("never submitted")
    assert pool.times.jobs == 1


def test_a_running_compile_is_left_to_finish():
    pool = WorkerPool("test compile", lambda: 2, triton_ahead._LOG, _Pool)
    ahead = triton_ahead.AheadCompiles("test compile", pool)
    ahead.submit("layer", [LAUNCH], arch=90)
    future, _ = pool.pool.futures[0]
    future.set_running_or_notify_cancel()
    ahead.settle("layer")
    assert len(pool.pending) == 1 and not future.cancelled()


def test_a_layer_may_be_tuned_with_relu_alone_or_either_resnet_epilogue():
    assert triton_ahead.epilogues(True) == [(True, False)]
    assert triton_ahead.epilogues(False) == [(False, False), (True, True)]


def test_at_most_four_workers(monkeypatch):
    monkeypatch.setenv("SPARSECNN_COMPILE_WORKERS", "16")
    assert triton_ahead.workers() == 4
    monkeypatch.setenv("SPARSECNN_COMPILE_WORKERS", "0")
    assert triton_ahead.workers() == 0


def test_a_worker_compiles_for_the_gpu_into_tritons_disk_cache(tmp_path):
    """`compile_in_worker` needs no GPU (here: this CPU machine, Triton's interpreter off, as in a
    worker process) and leaves an sm_90 cubin in Triton's cache directory, for a direct launch."""
    code = """
import torch
from sparsecnn.backends.direct import compile_ahead, kernel
from sparsecnn.core.spec import ConvSpec
from sparsecnn.core.triton_ahead import compile_in_worker
spec = ConvSpec(32, 64, 64, 14, 14, 3, 3, 1, 1)
config = kernel.auto_configs(spec, torch.float32)[0]
path, args, meta = compile_ahead.ahead_launches(spec, torch.float32, True, config, True)[0]
compile_in_worker(path, 90, args, meta)
"""
    run_compiling(code, tmp_path)
    assert list(tmp_path.rglob("*.cubin")), sorted(p.name for p in tmp_path.rglob("*"))
