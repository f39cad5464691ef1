"""Worker of tests/prune/test_distributed.py: ADMM pruning of a small regression MLP with its own loss.

Run as `python -m torch.distributed.run --standalone --nproc_per_node=2 ddp_prune.py OUT [cuda]`
(each rank training on half of every global batch of 32: gloo on the CPU, NCCL with `cuda`, rank r
on GPU r) or as `python ddp_prune.py OUT [cuda]` (one process, whole batches). Each rank writes
OUT/rank<r>.pt: {"masks", "state_dict", "loss"}, tensors on the CPU.
"""
import os
import sys
from pathlib import Path

import torch

from sparsecnn.data import Batches
from sparsecnn.prune import TrainConfig, admm_prune_
from sparsecnn.prune.distributed import close, init_from_env, rank, shard_for_this_rank


def regression_problem():
    """(model, x (128, 6) float32, y (128, 3) float32): a seeded MLP and a noisy linear target."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 6, generator=generator)
    y = x @ torch.randn(6, 3, generator=generator) + 0.05 * torch.randn(128, 3, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 3))
    return model, x, y


def huber_loss(model, batch):
    """A non-classification loss: Huber loss of the MLP's output against the regression target."""
    x, y = batch
    return torch.nn.functional.smooth_l1_loss(model(x), y)


def mark(step: str) -> None:
    """How far this rank got, on stderr (the test shows it when a rank fails)."""
    print(f"rank {rank()}: {step}", file=sys.stderr, flush=True)


def main(out: Path, device: torch.device) -> None:
    init_from_env(device)
    mark("initialised")
    model, x, y = regression_problem()
    model, x, y = model.to(device), x.to(device), y.to(device)
    batches = shard_for_this_rank(Batches(x, y, 32, shuffle=True, seed=0))
    masks = admm_prune_(model, batches, {"0": 0.7, "2": 0.7}, admm_epochs=3, finetune_epochs=2, lr=0.05,
                        finetune_lr=0.05, loss=huber_loss, train=TrainConfig())
    loss = huber_loss(model, (x, y)).item()
    torch.save({"masks": {name: mask.cpu() for name, mask in masks.items()},
                "state_dict": {key: value.cpu() for key, value in model.state_dict().items()}, "loss": loss},
               out / f"rank{rank()}.pt")
    mark("saved")
    close()
    mark("closed")


if __name__ == "__main__":
    on_gpu = sys.argv[2:] == ["cuda"]
    main(Path(sys.argv[1]), torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu"))
