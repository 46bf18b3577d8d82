"""The memory plan of a fit: measure the model on its first micro-batch, agree on the numbers, choose how to run.

The arithmetic lives in :mod:`lightning_mgpu.utilities.memory_plan`; this module gathers its inputs from a trainer
about to train. The measurement leaves no trace: the micro-batch's ``self.log`` calls are dropped, the random
number generators and BatchNorm statistics are put back, and no gradient is kept.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_mgpu import compat
from lightning_mgpu.utilities.blocks import find_repeated_blocks
from lightning_mgpu.utilities.memory_plan import (
    MemoryPlan,
    device_budget_mb,
    measure_activation_bytes,
    model_memory,
    optimizer_state_bytes,
    plan_memory,
)
from lightning_mgpu.utilities.step_pieces import LogCall, capture_logs


def make_plan(
    trainer: "pl.Trainer",
    strategy: "pl.strategies.ParallelStrategy",
    budget_mb: float | None,
    shard_units: list[str] | None = None,
) -> MemoryPlan:
    """The plan every rank agrees on: the largest activation measurement and the smallest budget of all ranks.

    Args:
        trainer: the trainer, after its ``setup`` hooks and before the strategy wraps the model.
        strategy: the strategy whose processes train (one all-reduce of two numbers over its process group).
        budget_mb: the user's per-device budget, or ``None`` for the device's (free CUDA memory, or available host
            memory shared by this host's processes).
        shard_units: class names of the sharding units, ``None`` for the repeated blocks.

    Raises:
        RuntimeError: the device's budget cannot be read and none was given.
    """
    module = trainer.lightning_module
    blocks = find_repeated_blocks(module, shard_units)
    activations, checkpointed = _measure_activations(trainer, strategy, blocks)
    optimizer = _first_optimizer(module.configure_optimizers())
    params = [param for param in module.parameters() if param.requires_grad]
    optimizer_bytes = optimizer_state_bytes(optimizer if optimizer is not None else torch.optim.AdamW, params)
    if budget_mb is not None:
        budget, source = float(budget_mb), "memory_budget_mb"
    else:
        found = device_budget_mb(strategy.root_device, processes_on_host=strategy.num_processes)
        if found is None:
            raise RuntimeError(
                f"{type(strategy).__name__}: the memory of {strategy.root_device} cannot be read; give "
                "memory_budget_mb=<MB per device> to plan against"
            )
        budget, source = found
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # every rank must choose the same setup: the least room and the largest activations decide
        numbers = torch.tensor([-budget, float(activations), float(checkpointed)], dtype=torch.float64)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
        budget, activations, checkpointed = -numbers[0].item(), int(numbers[1]), int(numbers[2])
        source += " (the smallest over ranks)"
    memory = model_memory(module, optimizer_bytes, activations, checkpointed, blocks)
    return plan_memory(
        memory,
        world_size=strategy.world_size,
        budget_mb=budget,
        budget_source=source,
        cpu_offload_possible=strategy.root_device.type == "cuda",
    )


def _first_optimizer(configured: Any) -> Optimizer | None:
    # configure_optimizers may return an optimizer, a list or tuple of them (or of lists), or a dict
    while isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    return configured if isinstance(configured, Optimizer) else None


def _measure_activations(
    trainer: "pl.Trainer", strategy: "pl.strategies.Strategy", blocks: list[torch.nn.Module]
) -> tuple[int, int]:
    module = trainer.lightning_module
    loaders = compat.train_dataloader(trainer)
    loader = _first_loader(loaders)
    batch = strategy.batch_to_device(next(iter(loader)))
    module.to(strategy.root_device)
    calls: list[LogCall] = []
    with _untouched(module), capture_logs(module, calls, samples=1), strategy.precision_plugin.train_step_context():
        return measure_activation_bytes(_step(module, batch), blocks, module)


def _step(module: "pl.LightningModule", batch: Any) -> Callable[[], Any]:
    return lambda: module.training_step(batch, 0)


def _first_loader(loaders: Any) -> Any:
    while isinstance(loaders, (list, tuple)) and loaders:
        loaders = loaders[0]
    if isinstance(loaders, dict) and loaders:
        loaders = next(iter(loaders.values()))
    return loaders


@contextmanager
def _untouched(module: torch.nn.Module) -> Iterator[None]:
    """Put back the random generators and the module's buffers (BatchNorm statistics) after the block."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        module.zero_grad(set_to_none=True)
