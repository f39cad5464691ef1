"""Several processes through torch.distributed: one copy of the model per rank, decisions made once.

Under `torchrun` (or any launcher that sets WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT) the
re-training loops wrap the model in DistributedDataParallel, so each rank computes the gradient of
its own batches and the ranks step with their mean. Everything that is decided rather than
trained (masks, ADMM's sparse copies, search and re-pruning results) is computed on rank 0 and
broadcast, so the masks are identical on every rank by construction. Rank 0 alone writes files.

Outside such a run (no process group and WORLD_SIZE unset or 1) every function here is a no-op:
rank 0 of a world of one.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Iterator, Optional

import torch
from torch import nn


def _env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset); ValueError for anything but a positive int."""
    text = os.environ.get("WORLD_SIZE", "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be a positive int, got {text!r}")
    return int(text)


def is_distributed() -> bool:
    """Whether a process group of more than one rank is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_from_env(device: Optional[torch.device] = None) -> bool:
    """Initialise the default process group from torchrun's environment when WORLD_SIZE > 1 and none
    is initialised yet: NCCL when `device` is CUDA (then made this process's current device from
    LOCAL_RANK), gloo otherwise. Returns `is_distributed()`."""
    import torch.distributed as dist

    if _env_world_size() > 1 and not dist.is_initialized():
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(local_rank())
        dist.init_process_group("nccl" if cuda else "gloo")
    return is_distributed()


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    import torch.distributed as dist

    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks (1 outside a distributed run)."""
    import torch.distributed as dist

    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """LOCAL_RANK as torchrun sets it (0 when unset): the GPU index of this process on its host."""
    text = os.environ.get("LOCAL_RANK", "").strip() or "0"
    if not text.isdigit():
        raise ValueError(f"environment variable LOCAL_RANK must be a non-negative int, got {text!r}")
    return int(text)


def is_main() -> bool:
    """Whether this process is rank 0, the one that logs and writes files."""
    return rank() == 0


def close() -> None:
    """Destroy the default process group if there is one (end of a torchrun entry point), once every
    rank got there."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # No rank tears its connections down while another may still use them. (A gloo rank still
        # aborted at teardown once in CI since, "terminate called without an active exception".)
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op outside a distributed run)."""
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


@torch.no_grad()
def broadcast_tensors_(tensors: Dict[str, torch.Tensor], src: int = 0) -> Dict[str, torch.Tensor]:
    """Overwrite every tensor of `tensors` with rank `src`'s, in place (any dtype and device; bool
    tensors travel as uint8, which gloo and NCCL both carry). Returns `tensors`."""
    if not is_distributed():
        return tensors
    import torch.distributed as dist

    for name in sorted(tensors):
        tensor = tensors[name]
        carried = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
        dist.broadcast(carried, src)
        if carried is not tensor:
            tensor.copy_(carried)
    return tensors


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` (any picklable object) on every rank."""
    if not is_distributed():
        return value
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src)
    return holder[0]


def wrap_ddp(model: nn.Module) -> nn.Module:
    """`model` wrapped in DistributedDataParallel in a distributed run (parameters and buffers
    broadcast from rank 0 at construction), `model` itself otherwise."""
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel

    parameter = next(model.parameters(), None)
    on_cuda = parameter is not None and parameter.device.type == "cuda"
    return DistributedDataParallel(model, device_ids=[parameter.device.index] if on_cuda else None)


class ShardedBatches:
    """Each batch of `batches` cut along dim 0 into `world` near-equal parts, of which this rank
    iterates part `rank`: with a global batch of B samples (B divisible by `world`), the ranks'
    mean gradient is the single-process gradient of the whole batch. For in-memory batches that
    every rank holds (`data.Batches`); a DataLoader should use a `DistributedSampler` instead.

    len() and state_dict()/load_state_dict() pass through to `batches` when it has them."""

    def __init__(self, batches: Iterable, rank: int, world: int):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
        self.batches, self.rank, self.world = batches, rank, world

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        for batch in self.batches:
            yield _shard(batch, self.rank, self.world)

    def state_dict(self) -> dict:
        return self.batches.state_dict() if hasattr(self.batches, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.batches, "load_state_dict"):
            self.batches.load_state_dict(state)


def _shard(batch, rank: int, world: int):
    """Part `rank` of `world` along dim 0 of every tensor in `batch` (tuples, lists, dicts kept)."""
    if isinstance(batch, torch.Tensor):
        return torch.tensor_split(batch, world)[rank]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_shard(item, rank, world) for item in batch)
    if isinstance(batch, dict):
        return {key: _shard(value, rank, world) for key, value in batch.items()}
    return batch


def shard_for_this_rank(batches: Iterable) -> Iterable:
    """`ShardedBatches(batches, rank(), world_size())` in a distributed run, `batches` otherwise."""
    return ShardedBatches(batches, rank(), world_size()) if is_distributed() else batches
