"""Data-parallel (DDP) and fully-sharded (FSDP2) training: process group, ranks, wrapping, step plan.

One process trains as it always did. Under ``torchrun`` (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment) :func:`process_group`
joins the job: NCCL on CUDA (device ``cuda:LOCAL_RANK``), Gloo on the CPU.

The app's model goes inside :class:`BatchForward` (the app's forward on a batch
as one module), which is then wrapped in DistributedDataParallel or, with
``shard``, FSDP2's ``fully_shard`` as a single unit. Wrapping the app's forward
rather than the bare model matters: the chem app calls ``model.network_energy``
and differentiates it for the forces, which DDP's and FSDP's hooks on
``forward`` would otherwise never see (gradients silently left unsynchronised).

The global batch is ``batch_size`` samples per optimizer step at any world size:
each rank takes ``batch_size / (world * grad_accum_steps)`` samples per
micro-step from its share (``order[rank::world]``) of the epoch's seeded order,
so one step's samples are those of the one-process step. The loss of each
micro-step is weighted so that the average DDP takes is the mean loss over the
step's samples even when the last batches of an epoch are short; a rank whose
share runs out one batch early repeats its last batch with weight 0 so every
rank runs the same number of collectives.
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..contract import App, BatchSource
from ..config import ConfigError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job; one process is rank 0 of 1."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0 writes the checkpoints, logs, TensorBoard events and progress bars."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def process_group(device: str, shard: bool = False) -> Iterator[tuple[Ranks, torch.device]]:
    """(ranks, device) for a training run; joins the torchrun job (once per process).

    A group the caller already made is used and left alone. A sharded run in a
    single process gets a group of one for its duration, so FSDP and sharded
    checkpoints run the same code at every world size.
    """
    torchrun = launched_by_torchrun()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda" and (torchrun or dist.is_initialized()):
        dev = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(dev)
    alone = False
    if not dist.is_initialized() and (torchrun or shard):
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if torchrun:
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
            # kept to the end of the process: joining the torchrun job a second time can hang
            atexit.register(_leave_process_group)
            if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent, not another launcher
                _exit_when_orphaned()
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            alone = True
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), local_rank) if dist.is_initialized() else Ranks()
    try:
        yield ranks, dev
    finally:
        if alone:
            dist.destroy_process_group()


def _exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this rank soon after its torchrun launcher dies.

    torchrun starts each rank in a session of its own, so a SIGKILL of the
    launcher alone would leave the ranks training on into the run folder,
    racing a later ``--resume``. Checkpoints are atomic, so exiting anywhere is safe.
    """
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="converge-launcher-watch", daemon=True).start()


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class BatchForward(nn.Module):
    """``app.forward(model, batch)`` as a module: what DDP and FSDP wrap.

    Its state dict is the model's with a ``model.`` prefix; checkpoints store
    ``.model``'s own state dict (sharded checkpoints keep the prefix).
    """

    def __init__(self, app: App, model: nn.Module) -> None:
        super().__init__()
        self.app = app
        self.model = model

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Any:
        return self.app.forward(self.model, batch)


def unused_parameters(net: BatchForward, loss: Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor],
                      batch: Mapping[str, torch.Tensor]) -> list[str]:
    """Parameters that get no gradient from one training-mode loss on ``batch``.

    The chem model has one network per element, and a dataset of one molecule
    leaves the others unused; DDP must then look for unused parameters every
    step (``find_unused_parameters``), a cost the other apps need not pay. The
    probe leaves the model, its buffers (BatchNorm statistics) and the RNGs as
    they were.
    """
    buffers = {name: b.clone() for name, b in net.named_buffers()}
    devices = [torch.cuda.current_device()] if next(net.parameters()).is_cuda else []
    with torch.random.fork_rng(devices=devices):
        net.train()
        loss(net(batch), batch).backward()
    unused = [name for name, p in net.named_parameters() if p.requires_grad and p.grad is None]
    net.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, b in net.named_buffers():
            b.copy_(buffers[name])
    return unused


def wrap_model(net: BatchForward, ranks: Ranks, device: torch.device, *, shard: bool, bucket_cap_mb: float,
               find_unused: bool) -> nn.Module:
    """``net`` as trained: itself (one process), DDP, or sharded in place by FSDP2."""
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.no_grad():  # FSDP, unlike DDP, does not broadcast rank 0's initial state
            for tensor in net.state_dict().values():
                dist.broadcast(tensor, src=0)
        fully_shard(net, mesh=init_device_mesh(device.type, (ranks.world,)))
        return net
    if ranks.world == 1:
        return net
    # The chem model's double backward gives its (1, n) output weights (1, 1)-strided gradients; a size-1
    # dimension's stride is immaterial, but DDP warns about it (once, at length) on every rank.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    return nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce (DDP ``no_sync``) or reduce-scatter (FSDP2) when not ``enabled``."""
    if enabled:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2's no_sync
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@dataclass(frozen=True)
class StepPlan:
    """How every rank walks an epoch: micro-batches, accumulation, loss weights."""

    n_samples: int  # the epoch's samples, all ranks together
    world: int
    accum: int
    micro_batch: int  # samples per rank per micro-step

    @property
    def micro_steps(self) -> int:
        """Micro-steps per epoch, the same on every rank (rank 0's share is the largest)."""
        return math.ceil(math.ceil(self.n_samples / self.world) / self.micro_batch)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per epoch: ceil(n_samples / batch_size) at any world size."""
        return math.ceil(self.micro_steps / self.accum)

    def batch_sizes(self, rank: int) -> list[int]:
        """Samples in each of ``rank``'s micro-steps (0: its share has run out)."""
        q, r = divmod(self.n_samples, self.world)
        return [self._size(q + (rank < r), k) for k in range(self.micro_steps)]

    def loss_weights(self, rank: int) -> list[float]:
        """Factor on ``rank``'s mean micro-batch loss: n_rank,k * world / n_step.

        Averaged over ranks (DDP) and summed over the step's micro-steps, the
        weighted gradients are the gradient of the mean loss over the step's n_step samples.
        """
        q, r = divmod(self.n_samples, self.world)  # r ranks hold q + 1 samples, the others q
        per_micro = [r * self._size(q + 1, k) + (self.world - r) * self._size(q, k) for k in range(self.micro_steps)]
        per_step = [sum(per_micro[i:i + self.accum]) for i in range(0, self.micro_steps, self.accum)]
        return [n * self.world / per_step[k // self.accum] for k, n in enumerate(self.batch_sizes(rank))]

    def _size(self, share: int, k: int) -> int:
        return max(0, min(self.micro_batch, share - k * self.micro_batch))


def plan_steps(n_samples: int, batch_size: int, world: int, accum: int) -> StepPlan:
    """The :class:`StepPlan` of a run, or a ConfigError saying which setting to change."""
    if batch_size % (world * accum):
        unit = world * accum
        near = sorted({max(unit, batch_size - batch_size % unit), batch_size - batch_size % unit + unit})
        raise ConfigError(
            f"train.batch_size={batch_size} is not divisible by {world} rank(s) x train.grad_accum_steps={accum}: "
            f"the global batch is split into equal micro-batches; use a multiple of {unit}, "
            f"e.g. {' or '.join(map(str, near))}")
    if n_samples < world:
        raise ConfigError(f"{n_samples} training samples cannot be shared by {world} ranks; use fewer processes")
    return StepPlan(n_samples, world, accum, batch_size // (world * accum))


def rank_batches(source: BatchSource, epoch: int, plan: StepPlan, ranks: Ranks) -> Iterator[tuple[dict, float]]:
    """(batch, loss weight) for each of this rank's micro-steps; padding repeats the last batch at weight 0."""
    sizes, weights = plan.batch_sizes(ranks.rank), plan.loss_weights(ranks.rank)
    batches = source.batches(epoch, plan.micro_batch, ranks.rank, ranks.world)
    last = None
    for size, weight in zip(sizes, weights, strict=True):
        batch = next(batches, None) if size else None
        if batch is None:
            if size or last is None:
                raise RuntimeError(f"{type(source).__name__} ran out of batches before its share of "
                                   f"{plan.n_samples} samples (rank {ranks.rank} of {ranks.world})")
            batch = last
        elif len(next(iter(batch.values()))) != size:
            raise RuntimeError(f"{type(source).__name__} gave a batch of {len(next(iter(batch.values())))} samples "
                               f"where its rank::world share gives {size}; it breaks the BatchSource contract")
        last = batch
        yield batch, weight


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums over ranks (the values themselves in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank, so all take the same decisions (best epoch, early stop)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
