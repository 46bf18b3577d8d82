"""Optimizer steps skipped on the device, with no host read, for optimizers whose own kernels take no ``found_inf``.

Torch's fused Adam, AdamW and SGD kernels take a ``found_inf`` flag and leave the parameters and the optimizer state
as they were where it is set: a bad step is skipped on the device (``GradScaler`` relies on it). Any other optimizer
steps unconditionally, so skipping needs the verdict on the host before the step (one synchronisation per step on
CUDA), unless the step itself is masked. Two ways do that here, chosen per optimizer:

- :class:`FusedRoute`: a non-fused torch ``Adam``, ``AdamW`` or ``SGD`` steps through its own fused kernel, with
  ``fused=True, foreach=False`` set on its param groups for the length of the step only. It holds no extra memory and
  is usually faster than the foreach kernel; the results are the fused kernel's, which differ from the foreach
  kernel's by rounding (about 2e-7 after 30 Adam steps on a unit-scale model). Adam's step counters move to the
  parameters' device (where the fused kernel keeps them), once; the optimizer's ``state_dict`` still gives them on the
  CPU, as the optimizer would.
- :class:`MaskedStep`: any optimizer whose state is tensors on its parameters' device: before the step the
  parameters and state are copied into a backup (one multi-tensor copy), after it ``torch.where`` puts the backup
  back where the flag is set (exact, NaN included). It holds one copy of the parameters and the state on the device
  and costs one ``where`` per tensor per step.
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu import compat

# torch's optimizers whose class has a fused kernel that reads ``found_inf`` (torch 2.13)
_FUSED_TWINS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def why_no_fused_route(optimizer: Optimizer) -> str | None:
    """``None`` when ``optimizer`` can step through its fused twin kernel, else the reason it cannot."""
    if type(optimizer) not in _FUSED_TWINS:
        return f"{type(optimizer).__name__} has no fused kernel"
    if compat.supports_amp_scaling(optimizer):
        return "it is fused already"
    devices = compat.fused_kernel_devices()
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "differentiable=True"
        for param in group["params"]:
            if not torch.is_floating_point(param) or param.device.type not in devices:
                return f"a {param.dtype} parameter on {param.device.type} has no fused kernel"
    return None


class FusedRoute:
    """Steps a non-fused torch ``Adam``/``AdamW``/``SGD`` through its fused kernel, which reads ``found_inf``.

    The flags of every param group are set for the step (a step pre-hook) and put back after it (a post-hook), so the
    optimizer's settings, ``state_dict`` and checkpoints are the user's. Step counters kept on the host (Adam's,
    without ``capturable``) move to the parameters' device before the first routed step and after every
    ``load_state_dict`` (a host-to-device copy each, once); :meth:`remove` moves them back.

    Args:
        optimizer: the optimizer to route; :func:`why_no_fused_route` must have returned ``None`` for it.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        # counters on the host unless the user's optimizer keeps them on the device itself
        self._host_counters = not any(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)
        self._placed = False
        self._flags: list[tuple[Any, Any]] = []
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_load_state_dict_post_hook(self._loaded),
            optimizer.register_state_dict_post_hook(self._state_dict),
        ]

    def _before_step(self, optimizer: Optimizer, *_: Any) -> None:
        self._flags = [(group.get("foreach"), group.get("fused")) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["foreach"], group["fused"] = False, True
        if not self._placed:
            self._placed = True
            self._move_counters(to_host=False)

    def _after_step(self, optimizer: Optimizer, *_: Any) -> None:
        for group, (foreach, fused) in zip(optimizer.param_groups, self._flags, strict=False):
            group["foreach"], group["fused"] = foreach, fused
        self._flags = []

    def _loaded(self, optimizer: Optimizer) -> None:
        self._placed = False  # the loaded counters are where the checkpoint had them

    def _state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self._host_counters:
            return state_dict
        state = dict(state_dict["state"])
        for key, value in state.items():
            step = value.get("step")
            if isinstance(step, Tensor) and step.device.type != "cpu":
                state[key] = {**value, "step": step.to("cpu", _host_counter_dtype())}
        return {**state_dict, "state": state}

    def _move_counters(self, to_host: bool) -> None:
        dtype = _host_counter_dtype() if to_host else torch.float32  # the fused kernels count in float32
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param)
                step = state.get("step") if state else None
                if isinstance(step, Tensor):
                    device = torch.device("cpu") if to_host else param.device
                    if step.device != device or step.dtype != dtype:
                        state["step"] = step.to(device, dtype)

    def remove(self) -> None:
        """Stop routing; the step counters go back to the host where the optimizer keeps them there."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._host_counters and self._placed:
            self._move_counters(to_host=True)
        self._placed = False


def _host_counter_dtype() -> torch.dtype:
    """The dtype torch's optimizers give a step counter kept on the host (torch 2.13's ``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class MaskedStep:
    """Skips any optimizer's step on the device: a backup before the step, ``torch.where`` after it.

    :meth:`arm` is called once the step's verdict exists (before the optimizer's update); the optimizer's step
    post-hook then restores, where the verdict is true, every tensor the backup holds. The backup buffers are
    allocated once and kept while the parameters and state keep their shapes.

    Args:
        optimizer: the optimizer whose steps are masked.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._live: list[Tensor] = []
        self._backup: list[Tensor] = []
        self._bad: Tensor | None = None
        self._hook = optimizer.register_step_post_hook(self._after_step)

    @property
    def nbytes(self) -> int:
        """Device memory the backup holds."""
        return sum(t.numel() * t.element_size() for t in self._backup)

    def why_not(self, params: list[Tensor], device: torch.device) -> str | None:
        """``None`` when the step of ``params`` can be masked on ``device``, else the reason it cannot.

        Every parameter must have its state already (a first step creates it: the verdict is read on the host then)
        and every state value must be a tensor on ``device``: a counter kept on the host (torch's optimizers without
        ``capturable=True``) or a Python number changes on the host, where no device flag can undo it.
        """
        for param in params:
            state = self.optimizer.state.get(param)
            if not state:
                return "its state does not exist before its first step"
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    return f"its state {key!r} is a {type(value).__name__}, kept on the host"
                if value.device != device:
                    return f"its state {key!r} is kept on {value.device.type} (construct it with capturable=True)"
        return None

    def arm(self, params: list[Tensor], bad: Tensor) -> None:
        """Back up ``params`` and their state now; the step about to run is undone where ``bad`` is true."""
        live = [*params, *_state_tensors(self.optimizer, params)]
        if [(t.shape, t.dtype, t.device) for t in live] != [(t.shape, t.dtype, t.device) for t in self._backup]:
            self._backup = [torch.empty_like(t) for t in live]
        with torch.no_grad():
            compat.foreach_copy_(self._backup, [t.detach() for t in live])
        self._live, self._bad = live, bad

    def _after_step(self, optimizer: Optimizer, *_: Any) -> None:
        if self._bad is None:
            return
        bad, self._bad = self._bad, None
        with torch.no_grad():
            for tensor, saved in zip(self._live, self._backup, strict=True):
                torch.where(bad, saved, tensor.detach(), out=tensor.detach())
        self._live = []

    def remove(self) -> None:
        """Drop the hook and the backup."""
        self._hook.remove()
        self._live, self._backup, self._bad = [], [], None


def _state_tensors(optimizer: Optimizer, params: Iterable[Tensor]) -> list[Tensor]:
    return [value for param in params for value in optimizer.state[param].values() if isinstance(value, Tensor)]
