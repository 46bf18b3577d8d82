"""Unscaled gradients for the pack's callbacks under ``precision="16-mixed"``, whatever the optimizer."""

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu.core import compat


def unscale_gradients(trainer: "pl.Trainer", optimizer: Optimizer) -> None:
    """Unscale ``optimizer``'s gradients in place if a GradScaler scaled them and has not unscaled them yet.

    Lightning unscales before ``on_before_optimizer_step`` except for fused optimizers, which unscale inside their
    kernel; clipping or checking those gradients would see values multiplied by the loss scale. Unscaling here also
    records GradScaler's inf check, so its ``step`` skips and its ``update`` works as usual.

    Args:
        trainer: the trainer, whose precision plugin may hold a ``scaler``.
        optimizer: the optimizer about to step.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as err:  # Lightning already did it for this step: the usual case
        if "already been called" not in str(err):
            raise


def params_to_step(trainer: "pl.Trainer", optimizer: Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` is about to step that have a gradient, their gradients unscaled.

    What both NaNSkip and GradientClipping start ``on_before_optimizer_step`` with, so that they see the same values
    in either order.

    Args:
        trainer: the trainer.
        optimizer: the optimizer about to step.
    """
    unscale_gradients(trainer, optimizer)
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def loss_scale(trainer: "pl.Trainer") -> Tensor | None:
    """The GradScaler's current loss scale as a device tensor (no host read), or ``None`` when no scaler is on.

    The loss ``on_before_backward`` receives under ``precision="16-mixed"`` is already multiplied by it.

    Args:
        trainer: the trainer, whose precision plugin may hold a ``scaler``.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return compat.grad_scaler_scale(scaler)
