"""How NaNSkip skips a bad optimizer step: on the device where the optimizer allows it, else after a host read."""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu.core import compat
from lightning_mgpu.stability.device_skip import FusedRoute, MaskedStep, fused_kernel_can_skip, why_no_fused_route

SkipWay = Literal["fused", "masked"]


class StepSkipper:
    """How each optimizer's bad steps are skipped in one fit, and the BatchNorm statistics a bad step puts back.

    The way is chosen per optimizer when the fit starts (said once on rank 0), and checked again each step:

    - ``"fused"``: the optimizer's fused kernel reads ``found_inf`` (a fused torch optimizer, or a non-fused one routed
      through its fused kernel, :class:`~lightning_mgpu.stability.device_skip.FusedRoute`);
    - ``"masked"``: :class:`~lightning_mgpu.stability.device_skip.MaskedStep` undoes the step where it was bad;
    - ``None``: the verdict is read on the host and a bad step's gradients are set to ``None``.

    Under ``precision="16-mixed"`` the GradScaler skips inf/NaN steps itself: every step takes the host way. The
    running statistics of BatchNorm layers (sync-BN ones too), which a bad forward pass may already have changed, are
    copied at each optimizer step's first micro-batch and put back where the step is bad.

    Args:
        owner: the callback's class name, for messages.
        skip_on_device: NaNSkip's ``skip_on_device``.
        trainer: the trainer whose fit starts.
        pl_module: its module, once ``configure_model`` has built it.
    """

    def __init__(
        self,
        owner: str,
        skip_on_device: bool | Literal["auto"],
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
    ) -> None:
        self.owner = owner
        self.scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        # per optimizer (by id): how its bad steps are skipped on the device, and the last reason a masked one read
        self.routes: dict[int, FusedRoute] = {}
        self.masks: dict[int, MaskedStep] = {}
        self.host_reasons: dict[int, str] = {}
        self.masked_reported: set[int] = set()  # ids of the optimizers whose backup size was printed
        self.found_inf: Tensor | None = None
        self.buffers = [
            buffer
            for module in pl_module.modules()
            if isinstance(module, compat.BatchNormBase)
            for buffer in module.buffers()
        ]
        self.saved_buffers: list[Tensor] | None = None  # None between optimizer steps
        self.hooks: list[Any] = []
        wanted = skip_on_device is True or (skip_on_device == "auto" and pl_module.device.type != "cpu")
        try:
            if not self.scaled:  # GradScaler skips inf/NaN steps itself
                self._choose(trainer.optimizers, wanted, masked=skip_on_device is True)
            # found_inf is an argument of one step only; GradScaler removes the one it sets itself
            for optimizer in trainer.optimizers:
                if not self.scaled and (id(optimizer) in self.routes or compat.supports_amp_scaling(optimizer)):
                    self.hooks.append(optimizer.register_step_post_hook(self.drop_found_inf))
        except BaseException:
            self.remove(trainer.optimizers)  # what it attached before the raise
            raise

    def _choose(self, optimizers: list[Optimizer], wanted: bool, masked: bool) -> None:
        lines = []
        for index, optimizer in enumerate(optimizers):
            name = f"optimizer {index} ({type(optimizer).__name__})"
            # fused optimizers skip through found_inf, as always; skip_on_device=False, or "auto" on the CPU (where
            # a host read costs nothing), reads the verdict
            if compat.supports_amp_scaling(optimizer) or not wanted:
                continue
            reason = why_no_fused_route(optimizer)
            if reason is None:
                self.routes[id(optimizer)] = FusedRoute(optimizer)
                lines.append(f"{name} steps through its fused kernel, which skips bad steps on the device")
            elif masked:
                self.masks[id(optimizer)] = MaskedStep(optimizer)
                lines.append(
                    f"{name} has its bad steps undone on the device where its state allows (a backup of its "
                    "parameters and state, one torch.where per tensor)"
                )
            else:
                lines.append(
                    f"{name} reads each step's verdict on the host ({reason}); skip_on_device=True masks its steps "
                    "on the device instead, at the cost of a copy of its parameters and state"
                )
        if lines:
            rank_zero_info(f"{self.owner}: " + "; ".join(lines) + ".")

    def save_buffers(self) -> None:
        """At an optimizer step's first micro-batch: copy the running statistics its forward passes may change.

        :attr:`saved_buffers` is ``None`` again once :meth:`skip` ended the step: no step is under way until this.
        """
        self.saved_buffers = [buffer.detach().clone() for buffer in self.buffers] if self.buffers else []

    def way(self, optimizer: Optimizer, params: list[Tensor], device: torch.device, step: int) -> SkipWay | None:
        """How this step is skipped with no host read: ``"fused"`` (found_inf), ``"masked"``, or ``None`` (read)."""
        if self.scaled:
            return None  # GradScaler handles inf/NaN steps
        route = self.routes.get(id(optimizer))
        if route is not None:
            return "fused" if route.can_route(params) else None
        if compat.supports_amp_scaling(optimizer):
            return "fused" if fused_kernel_can_skip(optimizer, params) else None
        mask = self.masks.get(id(optimizer))
        if mask is None:
            return None
        reason = mask.why_not(params, device)
        if reason is None:
            return "masked"
        first_step = any(not optimizer.state.get(p) for p in params)  # expected: no line
        if not first_step and self.host_reasons.get(id(optimizer)) != reason:  # said once per reason
            self.host_reasons[id(optimizer)] = reason
            rank_zero_info(
                f"{self.owner}: {type(optimizer).__name__}'s step {step} reads its verdict on the host: {reason}."
            )
        return None

    def skip(self, way: SkipWay | None, optimizer: Optimizer, params: list[Tensor], bad: Tensor) -> bool:
        """Skip the step about to run where ``bad`` is true, and end it; ``True`` where it was skipped on the host.

        First what an earlier step that raised (and was caught, as under manual optimization) left set for itself is
        cleared. ``way`` is :meth:`way`'s: on the device, with no host read; ``None`` reads ``bad`` and sets a bad
        step's gradients to ``None``, which torch's optimizers skip exactly. A later step in the batch (manual
        optimization) has no running statistics to put back.
        """
        if self.found_inf is not None:
            self.drop_found_inf(optimizer)
        if self.routes or self.masks:
            route, mask = self.routes.get(id(optimizer)), self.masks.get(id(optimizer))
            if route is not None:
                route.release()
            if mask is not None:
                mask.disarm()
        saved, self.saved_buffers = self.saved_buffers, None
        if way is None:
            if not bool(bad):  # one host read per optimizer step for optimizers that cannot skip on the device
                return False
            for param in params:
                param.grad = None
        elif way == "fused":  # the fused kernels leave parameters and state as they were where this is 1
            route = self.routes.get(id(optimizer))
            if route is not None:  # a non-fused torch optimizer: through its fused kernel for this step
                route.engage()
            self.found_inf = optimizer.found_inf = bad.float()
        else:  # the optimizer's step post-hook puts the backup back where this is true
            self._arm_mask(self.masks[id(optimizer)], params, bad)
        if saved:  # the running statistics the bad step's forward passes changed
            for buffer, value in zip(self.buffers, saved, strict=True):
                buffer.copy_(value if way is None else torch.where(bad, value, buffer))
        return way is None

    def _arm_mask(self, mask: MaskedStep, params: list[Tensor], bad: Tensor) -> None:
        mask.arm(params, bad)
        if id(mask.optimizer) not in self.masked_reported:
            self.masked_reported.add(id(mask.optimizer))
            rank_zero_info(
                f"{self.owner}: the masked step of {type(mask.optimizer).__name__} holds "
                f"{mask.nbytes / 2**20:.2f} MB of device memory per process."
            )

    def drop_found_inf(self, optimizer: Optimizer, *_: Any) -> None:
        """Take the ``found_inf`` this skipper set off ``optimizer`` (its step post-hook)."""
        if self.found_inf is not None and getattr(optimizer, "found_inf", None) is self.found_inf:
            del optimizer.found_inf

    def remove(self, optimizers: list[Optimizer]) -> None:
        """At the fit's end, or its exception: the optimizers as the user made them."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        for optimizer in optimizers:
            self.drop_found_inf(optimizer)
        for way in (*self.routes.values(), *self.masks.values()):
            way.remove()
        self.routes, self.masks, self.host_reasons = {}, {}, {}
