"""Per-gradient norms computed once per optimizer step and shared by the pack's callbacks, whatever their order."""

import weakref

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu.core import compat
from lightning_mgpu.core.sharded_tensors import global_norms, local_part

# optimizer -> (step, parameter ids, norms): one entry per optimizer, replaced every optimizer step
_CACHE: "weakref.WeakKeyDictionary[Optimizer, tuple[int, tuple[int, ...], Tensor]]" = weakref.WeakKeyDictionary()


def gradient_norms(optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor:
    """The fp32 2-norm of each ``param.grad``, one vectorised pass per optimizer step.

    Under FSDP the norms are those of the full gradients, equal on every rank (one all-reduce of the per-shard
    squares, see :func:`~lightning_mgpu.core.sharded_tensors.global_norms`).

    A second caller in the same step (NaNSkip and GradientClipping both read them) gets the same tensor. Scaling the
    gradients in between by a finite factor, as clipping does, leaves which norms are finite unchanged; clipping
    reads them before it scales.

    Args:
        optimizer: the optimizer about to step.
        params: its parameters that have a gradient.
        step: the trainer's global step, which names the optimizer step under way.
    """
    ids = tuple(id(p) for p in params)
    cached = _CACHE.get(optimizer)
    if cached is not None and cached[0] == step and cached[1] == ids:
        return cached[2]
    grads = [p.grad for p in params]
    local_norms = torch.stack(compat.foreach_norm([local_part(g) for g in grads], 2, dtype=torch.float32))
    norms = global_norms(grads, local_norms)  # one all-reduce when the gradients are FSDP shards, else none
    _CACHE[optimizer] = (step, ids, norms)
    return norms


def clear_gradient_norms() -> None:
    """Forget every cached norm: called after each backward pass and at the start of a fit."""
    _CACHE.clear()
