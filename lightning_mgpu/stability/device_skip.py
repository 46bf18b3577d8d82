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

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu.core import compat
from lightning_mgpu.core.sharded_tensors import local_part

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

    :meth:`engage` sets ``fused=True, foreach=False`` on every param group for the step under way (call it once the
    step's closure has run, before its update); the optimizer's step post-hook puts the user's flags back, and so does
    :meth:`remove` after a step that raised. A ``state_dict`` taken meanwhile holds the user's flags. Step counters kept
    on the host (Adam's, without ``capturable``) move to the parameters' device at the first routed step and after
    every ``load_state_dict`` (a host-to-device copy each, once), are given on the host in every ``state_dict``, and go
    back to it at :meth:`remove`.

    Args:
        optimizer: the optimizer to route; :func:`why_no_fused_route` must have returned ``None`` for it.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        # counters on the host unless the user's optimizer keeps them on the device itself
        self._host_counters = not any(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)
        self._placed = False
        self._flags: list[tuple[Any, Any]] = []  # the user's (foreach, fused) per group while engaged
        self._hooks = [
            optimizer.register_step_post_hook(self.release),
            optimizer.register_load_state_dict_post_hook(self._loaded),
            optimizer.register_state_dict_post_hook(self._state_dict),
        ]

    def can_route(self, params: list[Tensor]) -> bool:
        """Whether the fused kernel can take the step of ``params`` with ``found_inf`` (checked every step)."""
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            return False  # the fused kernels take no sparse gradient
        return fused_kernel_can_skip(self.optimizer, params)

    def engage(self) -> None:
        """Route the step under way through the fused kernel."""
        if not self._flags:  # engaged twice (a step that raised before its post-hook): the first flags are the user's
            self._flags = [(group.get("foreach"), group.get("fused")) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["foreach"], group["fused"] = False, True
        if not self._placed:
            self._placed = True
            self._move_counters(to_host=False)

    def release(self, *_: Any) -> None:
        """Put the user's flags back (the step post-hook; also called before a step, after one that raised)."""
        for group, (foreach, fused) in zip(self.optimizer.param_groups, self._flags, strict=False):
            group["foreach"], group["fused"] = foreach, fused
        self._flags = []

    def _loaded(self, optimizer: Optimizer) -> None:
        self._placed = False  # the loaded counters are where the checkpoint had them

    def _state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        groups = state_dict["param_groups"]
        if self._flags:  # taken while engaged (after a raise): the user's flags
            groups = [
                {**group, "foreach": foreach, "fused": fused}
                for group, (foreach, fused) in zip(groups, self._flags, strict=False)
            ] + groups[len(self._flags) :]
        state = state_dict["state"]
        if self._host_counters:
            state = dict(state)
            for key, value in state.items():
                step = value.get("step")
                if isinstance(step, Tensor) and step.device.type != "cpu":
                    state[key] = {**value, "step": step.to("cpu", _host_counter_dtype())}
        return {**state_dict, "state": state, "param_groups": groups}

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
        """Stop routing: the user's flags back (after a step that raised), step counters back on the host."""
        self.release()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._host_counters and self._placed:
            self._move_counters(to_host=True)
        self._placed = False


def fused_kernel_can_skip(optimizer: Optimizer, params: list[Tensor]) -> bool:
    """Whether a fused kernel's ``found_inf`` can skip the step of ``params`` exactly.

    Fused SGD with momentum creates its momentum buffers empty and returns early on ``found_inf``: a skipped first
    step would keep garbage as momentum. It also takes no group in which some buffers are missing (a parameter
    stepping for the first time). Both need the verdict on the host; every other case skips on the device.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return True
    stepping = set(map(id, params))
    return all(
        "momentum_buffer" in optimizer.state.get(p, {})
        for group in optimizer.param_groups
        if group.get("momentum", 0)
        for p in group["params"]
        if id(p) in stepping
    )


def _host_counter_dtype() -> torch.dtype:
    """The dtype torch's optimizers give a step counter kept on the host (torch 2.13's ``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class MaskedStep:
    """Skips any optimizer's step on the device: a backup before the step, ``torch.where`` after it.

    :meth:`arm` is called once the step's verdict exists (before the optimizer's update); the optimizer's step
    post-hook then restores, where the verdict is true, the parameters and every state tensor the backup holds, looked
    up again by parameter and key (an optimizer may replace a state tensor rather than update it). A state key the step
    creates, or a state tensor whose shape it changes, is not undone. Under FSDP2 each rank backs up its own shards.
    The backup buffers are allocated once and kept while the parameters and state keep their shapes.

    Args:
        optimizer: the optimizer whose steps are masked.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._params: list[Tensor] = []
        self._slots: list[tuple[Tensor, str]] = []  # (parameter, state key) of every state tensor backed up
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
        ``capturable=True``) or a Python number changes on the host, where no device flag can undo it. Checked every
        step: the state may be cleared or reloaded during a fit.
        """
        for param in params:
            state = self.optimizer.state.get(param)
            if not state:
                return "its state does not exist before its first step"
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    return f"its state {key!r} is a {type(value).__name__}, kept on the host"
                if value.device != device:
                    return (
                        f"its state {key!r} is kept on {value.device.type} (construct it with capturable=True where it "
                        "has that option)"
                    )
        return None

    def arm(self, params: list[Tensor], bad: Tensor) -> None:
        """Back up ``params`` and their state now; the step about to run is undone where ``bad`` is true."""
        slots = [(param, key) for param in params for key in self.optimizer.state[param]]
        live = [local_part(p) for p in params] + [local_part(self.optimizer.state[p][k]) for p, k in slots]
        if [(t.shape, t.dtype, t.device) for t in live] != [(t.shape, t.dtype, t.device) for t in self._backup]:
            self._backup = [torch.empty_like(t) for t in live]
        with torch.no_grad():
            compat.foreach_copy_(self._backup, [t.detach() for t in live])
        self._params, self._slots, self._bad = params, slots, bad

    def disarm(self) -> None:
        """Forget an armed verdict whose step never ran its post-hook (it raised): called before each step."""
        self._bad = None
        self._params, self._slots = [], []

    def _after_step(self, optimizer: Optimizer, *_: Any) -> None:
        if self._bad is None:
            return
        bad, self._bad = self._bad, None
        saved = self._backup
        with torch.no_grad():
            # the state is looked up again: an optimizer may have replaced a tensor instead of updating it in place
            current = [*self._params, *(optimizer.state[param].get(key) for param, key in self._slots)]
            for tensor, backup in zip(current, saved, strict=True):
                part = local_part(tensor).detach() if isinstance(tensor, Tensor) else None
                if part is not None and part.shape == backup.shape and part.dtype == backup.dtype:
                    torch.where(bad, backup, part, out=part)
        self._params, self._slots = [], []

    def remove(self) -> None:
        """Drop the hook and the backup."""
        self._hook.remove()
        self._params, self._slots, self._backup, self._bad = [], [], [], None
