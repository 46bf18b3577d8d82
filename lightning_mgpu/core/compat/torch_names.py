"""Private torch and torchmetrics names: BatchNorm's base, foreach kernels, the grad scaler, metric progress."""

from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from torchmetrics import Metric

BatchNormBase = _BatchNorm  # every BatchNorm1d/2d/3d and SyncBatchNorm (torch 2.13)


class BatchNormLayer(_BatchNorm):
    """Base for the pack's own BatchNorm layers; subclasses implement :meth:`check_input_dim`.

    torch's private ``_BatchNorm`` checks the input through the private ``_check_input_dim`` hook (torch 2.13).
    """

    def check_input_dim(self, input: Tensor) -> None:
        """Raise ``ValueError`` for an input this layer cannot normalise."""
        raise NotImplementedError(f"{type(self).__name__} must implement check_input_dim")

    def _check_input_dim(self, input: Tensor) -> None:
        self.check_input_dim(input)


NormBase = _NormBase  # BatchNorm and InstanceNorm layers with running statistics (torch 2.13)


def foreach_norm(tensors: list[Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[Tensor]:
    """One norm per tensor, in one multi-tensor kernel (torch's ``_foreach_norm``, 2.13)."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_mul_(tensors: list[Tensor], scalar: Tensor | float) -> None:
    """Multiply every tensor in place, in one multi-tensor kernel (torch's ``_foreach_mul_``, 2.13)."""
    torch._foreach_mul_(tensors, scalar)


def foreach_add_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """Add ``sources`` into ``targets`` in one multi-tensor kernel (torch's ``_foreach_add_``, 2.13)."""
    torch._foreach_add_(targets, sources)


def foreach_copy_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """Copy ``sources`` into ``targets`` in one multi-tensor kernel (torch's ``_foreach_copy_``, 2.13)."""
    torch._foreach_copy_(targets, sources)


def foreach_lerp_(targets: list[Tensor], ends: list[Tensor], weight: float) -> None:
    """``target += weight * (end - target)`` for every pair, in one multi-tensor kernel (``_foreach_lerp_``, 2.13)."""
    torch._foreach_lerp_(targets, ends, weight)


def fused_kernel_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on (``_get_fused_kernels_supported_devices``, 2.13)."""
    return _get_fused_kernels_supported_devices()


def supports_amp_scaling(optimizer: Optimizer) -> bool:
    """Whether the optimizer's step reads ``found_inf``/``grad_scale`` itself (fused kernels; torch 2.13)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def grad_scaler_scale(scaler: Any) -> Tensor | None:
    """A ``GradScaler``'s loss scale as its device tensor, or ``None`` before its first ``scale()``.

    ``get_scale()`` would read it on the host (torch 2.13's ``_scale``).
    """
    return getattr(scaler, "_scale", None)


def grad_scaler_tensors(scaler: Any) -> list[Tensor]:
    """The device tensors a ``GradScaler``'s state lives in: its scale and growth tracker, once it has scaled.

    torch 2.13's ``_scale`` and ``_growth_tracker``, ``None`` until the first ``scale()``.
    """
    found = [getattr(scaler, name, None) for name in ("_scale", "_growth_tracker")]
    return [t for t in found if isinstance(t, Tensor)]


def metric_progress(metric: Metric) -> tuple[int, Any]:
    """A metric's update count and cached ``compute()`` result (torchmetrics 1.9)."""
    return metric._update_count, metric._computed


def set_metric_progress(metric: Metric, progress: tuple[int, Any]) -> None:
    """Put back what :func:`metric_progress` returned."""
    metric._update_count, metric._computed = progress
