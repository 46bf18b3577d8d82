"""Private torch and torchmetrics names: BatchNorm's base, foreach kernels, the grad scaler, metric progress, hooks."""

from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn
from torch.utils.hooks import RemovableHandle
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


class _CheckpointedCall:
    """One call of a checkpointed module: the arguments its forward ran with, and torch's checkpoint frame."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        tensors = (*args, *kwargs.values())  # the frame finds the device (and its random state) from these
        self.frame: Generator[None, None, None] = _checkpoint_without_reentrant_generator(
            self.recompute, True, noop_context_fn, "default", False, True, *tensors
        )

    def recompute(self, *_saved_inputs: Any) -> Any:
        # the forward alone, with the arguments it ran with: the module's hooks ran once, outside the checkpoint
        return self.module.forward(*self.args, **self.kwargs)


class ForwardCheckpoint:
    """Run each call of a module's ``forward`` under torch's non-reentrant activation checkpoint, by two hooks.

    The forward pre-hook is registered last, so the module's own pre-hooks (a user's, FSDP2's unshard and input cast,
    which it prepends) run before the checkpoint, once; the forward hook is prepended, so the checkpoint ends as the
    forward returns. The backward recomputes ``module.forward`` alone, with the arguments the forward received, and
    the forward's random state (dropout). Nothing of the module changes: its class, its methods, its parameter names
    and its state-dict keys. A pre-hook registered after this one runs inside the checkpoint; one that saves tensors
    for the backward then fails the recomputation's check.

    Built on torch 2.13's private ``_checkpoint_without_reentrant_generator``, the generator behind
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and ``torch.distributed._composable.checkpoint``. The
    latter recomputes through the module's call, running its pre-hooks a second time on arguments they already
    changed.
    """

    def __init__(self) -> None:
        self._calls: list[_CheckpointedCall] = []  # a stack: a module may call itself
        self._handles: tuple[RemovableHandle, ...] = ()

    @classmethod
    def of(cls, module: nn.Module) -> "ForwardCheckpoint | None":
        """The checkpoint applied to ``module``, if any (among torch's ``_forward_pre_hooks`` of the module)."""
        for hook in module._forward_pre_hooks.values():
            if isinstance(getattr(hook, "__self__", None), cls):
                return hook.__self__
        return None

    @classmethod
    def apply(cls, module: nn.Module) -> "ForwardCheckpoint":
        """Checkpoint ``module``'s forward; applying it again to the same module changes nothing."""
        found = cls.of(module)
        if found is not None:
            return found
        hooks = cls()
        hooks._handles = (
            module.register_forward_pre_hook(hooks._enter, with_kwargs=True),
            module.register_forward_hook(hooks._leave, with_kwargs=True, prepend=True, always_call=True),
        )
        return hooks

    def remove(self) -> None:
        """Keep the module's activations again."""
        for handle in self._handles:
            handle.remove()
        self._handles = ()

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = _CheckpointedCall(module, args, kwargs)
        next(call.frame)
        self._calls.append(call)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self._calls:  # the forward failed before this hook's pair ran
            return
        call = self._calls.pop()
        call.args, call.kwargs = args, kwargs  # what the forward ran with, should a later pre-hook have changed them
        next(call.frame, None)
