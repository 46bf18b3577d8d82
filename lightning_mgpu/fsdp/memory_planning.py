"""The memory plan of a fit: measure the model on its first micro-batch, agree on the numbers, choose how to run.

The arithmetic lives in :mod:`lightning_mgpu.fsdp.memory_plan`; this module gathers its inputs from a trainer
about to train. The measurement leaves no trace: the micro-batch's ``self.log`` calls are dropped, the random
number generators and BatchNorm statistics are put back, and no gradient is kept.
"""

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_mgpu.core import compat
from lightning_mgpu.core.blocks import sharding_units
from lightning_mgpu.core.step_pieces import LogCall, capture_logs
from lightning_mgpu.fsdp.memory_plan import (
    MemoryPlan,
    ModelMemory,
    device_budget_mb,
    measure_activation_bytes,
    model_memory,
    optimizer_state_bytes,
    plan_memory,
)


def make_plan(
    trainer: "pl.Trainer",
    strategy: "pl.strategies.ParallelStrategy",
    budget_mb: float | None,
    shard_units: list[str] | None = None,
    node_size: int | None = None,
) -> MemoryPlan:
    """The plan every rank agrees on: the largest activation measurement and the smallest budget of all ranks.

    Args:
        trainer: the trainer, after its ``setup`` hooks and before the strategy wraps the model.
        strategy: the strategy whose processes train (one all-reduce of three numbers over its process group).
        budget_mb: the user's per-device budget, or ``None`` for the device's (free CUDA memory, or available host
            memory shared by this host's processes).
        shard_units: class names of the sharding units, ``None`` for the repeated blocks.
        node_size: the processes hybrid sharding would shard over (a node's, or ``shard_group_size``); ``None``
            offers no hybrid sharding.

    Raises:
        RuntimeError: the device's budget cannot be read and none was given.
    """
    module = trainer.lightning_module
    batch = strategy.batch_to_device(first_batch(trainer))
    module.to(strategy.root_device)
    memory = measure_model(
        module, batch, shard_units, strategy.precision_plugin.train_step_context(), owner=type(strategy).__name__
    )
    budget, source = plan_budget(strategy.root_device, strategy.num_processes, budget_mb)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # every rank must choose the same setup: the least room and the largest activations decide
        numbers = [-budget, float(memory.activation_bytes), float(memory.checkpointed_activation_bytes)]
        agreed = torch.tensor(numbers, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        budget, source = -agreed[0].item(), source + " (the smallest over ranks)"
        memory = replace(memory, activation_bytes=int(agreed[1]), checkpointed_activation_bytes=int(agreed[2]))
    return plan_memory(
        memory,
        world_size=strategy.world_size,
        budget_mb=budget,
        budget_source=source,
        cpu_offload_possible=strategy.root_device.type == "cuda",
        node_size=node_size,
    )


def measure_model(
    module: "pl.LightningModule",
    batch: Any,
    shard_units: list[str] | None = None,
    step_context: AbstractContextManager | None = None,
    owner: str = "MultiGPUStrategy",
) -> ModelMemory:
    """Measure ``module`` on ``batch``: one ``training_step`` forward (no backward), leaving no trace.

    The optimizer state is estimated from ``configure_optimizers()`` (called once, its result dropped; AdamW's when
    it returns no optimizer).

    Args:
        module: the LightningModule, on the device ``batch`` is on.
        batch: one micro-batch as the training loop would pass it.
        shard_units: class names of the sharding units, ``None`` for the repeated blocks.
        step_context: the precision plugin's training-step context (autocast), if any.
        owner: the class named in errors.
    """
    blocks = sharding_units(module, shard_units, owner=owner)
    calls: list[LogCall] = []
    with untouched(module), capture_logs(module, calls, samples=1), step_context or nullcontext():
        activations, checkpointed = measure_activation_bytes(lambda: module.training_step(batch, 0), blocks, module)
    optimizer = _first_optimizer(module.configure_optimizers())
    params = [param for param in module.parameters() if param.requires_grad]
    optimizer_bytes = optimizer_state_bytes(optimizer if optimizer is not None else torch.optim.AdamW, params)
    return model_memory(module, optimizer_bytes, activations, checkpointed, blocks)


def plan_budget(device: torch.device, processes_on_host: int, budget_mb: float | None) -> tuple[float, str]:
    """The budget to plan with: the user's, or the device's.

    Raises:
        RuntimeError: the device's memory cannot be read and no budget was given.
    """
    if budget_mb is not None:
        return float(budget_mb), "memory_budget_mb"
    found = device_budget_mb(device, processes_on_host=processes_on_host)
    if found is None:
        raise RuntimeError(f"the memory of {device} cannot be read; give memory_budget_mb=<MB per device> to plan")
    return found


def _first_optimizer(configured: Any) -> Optimizer | None:
    # configure_optimizers may return an optimizer, a list or tuple of them (or of lists), or a dict
    while isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    return configured if isinstance(configured, Optimizer) else None


def first_batch(trainer: "pl.Trainer") -> Any:
    """The first batch of a fresh training dataloader, leaving the random generators as they were.

    A shuffling loader draws its seed from torch's global generator, and so does starting its iterator.
    """
    with kept_random_state():
        return next(iter(first_loader(compat.train_dataloader(trainer))))


@contextmanager
def kept_random_state() -> Iterator[None]:
    """Put torch's CPU and CUDA random generators back as they were after the block."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def first_loader(loaders: Any) -> Any:
    """The first dataloader of what a ``train_dataloader`` hook returned (a loader, a list, a dict of them)."""
    while isinstance(loaders, (list, tuple)) and loaders:
        loaders = loaders[0]
    if isinstance(loaders, dict) and loaders:
        loaders = next(iter(loaders.values()))
    return loaders


@contextmanager
def untouched(module: torch.nn.Module) -> Iterator[None]:
    """Put back the random generators, the module's buffers (BatchNorm statistics) and its gradients after the block."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        with kept_random_state():
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        module.zero_grad(set_to_none=True)
