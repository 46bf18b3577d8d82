"""Whether an optimizer step is bad: a NaN or Inf loss or gradient, or a spike, decided on the device."""

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mgpu.core.step_service import StepService
from lightning_mgpu.stability._amp import loss_scale
from lightning_mgpu.stability.nan_skip_config import NaNSkipConfig
from lightning_mgpu.stability.skip_tally import SkipTally
from lightning_mgpu.stability.step_skipper import StepSkipper


class NonFiniteStepsError(RuntimeError):
    """Raised by :class:`NaNSkip` when ``max_consecutive`` optimizer steps in a row were not finite."""


class BadStepTest:
    """NaNSkip's test of each optimizer step in one fit: true where the step must be skipped, on the device.

    Each micro-batch's loss is tested as its backward pass starts (:meth:`watch_loss`), the step's gradients and
    gradient norm once they are reduced (:meth:`decide`, the step's one decider). The spike windows take in a step it
    accepts. What the last bad step saw stays on the device, read only for :class:`NonFiniteStepsError`'s message.

    Args:
        config: the callback's options.
        tally: the counters and spike windows the verdicts go into.
        owner: the callback's class name, for messages.
        device: the fit's device.
        service: the fit's step service: the gradient norms, and the share of its batch a micro-batch holds.
        distributed: more than one process (another rank's bad loss reaches this one as NaN gradients).
        names: parameter names by ``id``, for the error message.
        optimizer_index: each optimizer's index in ``trainer.optimizers``, by ``id``.
    """

    def __init__(
        self,
        config: NaNSkipConfig,
        tally: SkipTally,
        owner: str,
        device: torch.device,
        service: StepService,
        distributed: bool,
        names: dict[int, str],
        optimizer_index: dict[int, int],
    ) -> None:
        self.config = config
        self.tally = tally
        self.owner = owner
        self.device = device
        self.service = service
        self.distributed = distributed
        self.names = names
        self.optimizer_index = optimizer_index
        self.check_loss = config.check != "grads"
        self.check_grads = config.check != "loss" or distributed  # other ranks' losses arrive in the gradients
        self.norm_spikes = config.norm_spikes
        # the step under way: its loss verdict (None between steps), spikes, and the losses its windows take in
        self.loss_bad: Tensor | None = None
        self.loss_spike: Tensor | None = None
        self.norm_spike: Tensor | None = None
        self.step_losses: list[Tensor] = []
        # a batch OOMBackoff runs in pieces: their losses so far, and the share of the batch they held
        self.pieces_loss: Tensor | None = None
        self.pieces_share = 0.0
        # what the last skipped step saw, for the error message
        self.last_bad_norms: Tensor | None = None
        self.last_bad_ids: tuple[int, ...] = ()
        self.last_bad_loss = torch.zeros((), dtype=torch.bool, device=device)
        self.last_bad_spike = torch.zeros((), dtype=torch.bool, device=device)

    def start_batch(self, skipper: StepSkipper) -> None:
        """At a batch's start; an optimizer step starts where ``skipper`` has none under way (it ends each in ``skip``).

        The step starts with its running statistics saved and its loss verdict clear, whatever a backward pass after
        the last batch's last step left there (manual optimization: a GAN whose generator accumulates across
        batches): that loss belongs to no step of this batch.
        """
        self.pieces_loss, self.pieces_share = None, 0.0  # pieces never cross a batch: none left from the last
        if skipper.saved_buffers is None:
            skipper.save_buffers()
            self.loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)

    def end_step(self) -> None:
        """After an optimizer step: the next one starts afresh."""
        self.loss_bad = self.loss_spike = self.norm_spike = None
        self.step_losses = []

    def watch_loss(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        """Test a micro-batch's loss; under several processes a bad one turns this rank's gradients into NaN."""
        bad: Tensor | None = None
        if self.check_loss:
            bad = ~torch.isfinite(loss.detach()).all()
            self.loss_bad = bad if self.loss_bad is None else self.loss_bad | bad
        window = self.tally.loss_window
        # manual optimization may run several backward passes for several optimizers per batch: their losses are not
        # one series, and a flag could not be told apart per optimizer; the gradient norms are tested there
        if window is not None and pl_module.automatic_optimization:
            value = self._batch_loss(trainer, loss)
            if value is not None:  # the batch's loss, whole or, after the last of its pieces, summed from them
                spike = window.is_spike(value)[0]
                self.loss_spike = spike if self.loss_spike is None else self.loss_spike | spike
                self.step_losses.append(value)
                bad = spike if bad is None else bad | spike
        if bad is not None and self.distributed and loss.requires_grad:
            # the other ranks learn of this rank's bad loss through DDP's gradient all-reduce
            poison = torch.where(bad, math.nan, 1.0)
            loss.register_hook(lambda grad: grad * poison.to(grad.dtype))

    def _batch_loss(self, trainer: "pl.Trainer", loss: Tensor) -> Tensor | None:
        """The batch's loss, of shape (1,), once it is known; ``None`` for a piece of a batch before its last.

        The loss is the user's: unscaled, and not divided for gradient accumulation. OOMBackoff runs a batch that does
        not fit as pieces, each loss weighted by the piece's share of the batch (a mean loss) or a partial sum (a sum):
        their sum is the batch's loss, which the window compares, as without the split. A piece's own loss would be
        noisier than the batch's the window holds, and look like a spike.
        """
        share = self.service.piece_share
        value = loss.detach().float().mean()
        scale = loss_scale(trainer)
        if scale is not None:
            value = value / scale.to(value.device)
        value = value * trainer.accumulate_grad_batches  # Lightning divided it by the accumulation before this hook
        if share >= 1.0 and self.pieces_loss is None:
            return value.view(1)
        self.pieces_loss = value if self.pieces_loss is None else self.pieces_loss + value
        self.pieces_share += share
        if self.pieces_share < 1.0 - 1e-9:
            return None
        value, self.pieces_loss, self.pieces_share = self.pieces_loss.view(1), None, 0.0
        return value

    def save_attempt(self) -> tuple[Any, ...]:
        """The loss verdicts so far in this optimizer step, for an attempt OOMBackoff may drop."""
        return self.loss_bad, self.loss_spike, len(self.step_losses), self.pieces_loss, self.pieces_share

    def restore_attempt(self, saved: tuple[Any, ...]) -> None:
        """Forget a dropped attempt's loss verdicts and losses (the tensors are replaced, never changed in place)."""
        self.loss_bad, self.loss_spike, count, self.pieces_loss, self.pieces_share = saved
        del self.step_losses[count:]

    def decide(self, optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor:
        """This optimizer step's verdict (true: skip it), on the device; the windows take in a step it accepts."""
        bad = self._flag(optimizer, params, step)
        spiked = torch.zeros((), dtype=torch.bool, device=bad.device)
        if self.loss_spike is not None:
            spiked = spiked | self.loss_spike.to(bad.device)
        norm: Tensor | None = None
        window = None
        if self.norm_spikes:
            window = self.tally.norm_window(self.optimizer_index.get(id(optimizer), len(self.optimizer_index)))
        if window is not None and params:
            norm = torch.linalg.vector_norm(self.service.gradient_norms(optimizer, params, step).to(bad.device)).view(1)
            self.norm_spike = window.is_spike(norm)[0]
            spiked = spiked | self.norm_spike
        bad = bad | spiked
        tally = self.tally
        tally.spiked = tally.spiked + (spiked & bad).long()
        self.last_bad_spike = torch.where(bad, spiked, self.last_bad_spike.to(bad.device))
        if tally.loss_window is not None and self.step_losses:
            tally.loss_window.update_many(self.step_losses, ~bad)
        if norm is not None and window is not None:
            window.update(norm, ~bad)
        return bad

    def _flag(self, optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor:
        """Whether the loss or a gradient of this step is NaN or Inf."""
        device = self.tally.skipped.device
        bad = torch.zeros((), dtype=torch.bool, device=device)
        if self.check_grads and params:
            # fp32 2-norms: NaN or Inf when an element is (or, harmlessly, when a norm exceeds ~1e19); the inf-norm
            # kernel is ~35x slower on CPU
            norms = self.service.gradient_norms(optimizer, params, step).to(device)
            bad = ~torch.isfinite(norms.sum())
            ids = tuple(map(id, params))
            if self.last_bad_norms is None or self.last_bad_ids != ids:  # another parameter set: start over
                self.last_bad_norms, self.last_bad_ids = norms, ids
            else:
                self.last_bad_norms = torch.where(bad, norms, self.last_bad_norms)
        if self.check_loss and self.loss_bad is not None:
            loss_bad = self.loss_bad.to(device)
            self.last_bad_loss = torch.where(bad | loss_bad, loss_bad, self.last_bad_loss.to(device))
            bad = bad | loss_bad
        return bad

    def cause(self) -> tuple[str, str]:
        """What tripped, short and long; read only when a step is skipped (the flag was just read on the host)."""
        if self.loss_bad is not None and bool(self.loss_bad):
            return "NaN/Inf loss", "the loss is NaN or Inf"
        spiked_by = f"more than {self.config.spike_zscore} standard deviations above its recent mean"
        if self.loss_spike is not None and bool(self.loss_spike):
            return "loss spike", f"the loss spiked ({spiked_by})"
        if self.norm_spike is not None and bool(self.norm_spike):
            return "gradient-norm spike", f"the gradient norm spiked ({spiked_by})"
        if self.distributed and self.check_loss:
            return "NaN/Inf gradients", (
                "NaN or Inf gradients (after the all-reduce: this rank's gradients, or another rank's loss)"
            )
        return "NaN/Inf gradients", "NaN or Inf gradients"

    def raise_if_too_many(self, trainer: "pl.Trainer", max_consecutive: int, lagged: int | None) -> None:
        """Raise :class:`NonFiniteStepsError` after ``max_consecutive`` bad steps in a row.

        ``lagged``: the count read one step late (no host sync), else ``None`` to read it now. Every rank reads the
        same step's value at the same step, so all raise together.
        """
        consecutive = int(self.tally.consecutive) if lagged is None else lagged
        if consecutive < max_consecutive:
            return
        culprit = "the first non-finite tensor was " + ("the loss" if bool(self.last_bad_loss) else "a gradient")
        if bool(self.last_bad_spike):
            culprit = "the loss or the gradient norm spiked"
        elif not bool(self.last_bad_loss) and self.last_bad_norms is not None:
            first = int((~torch.isfinite(self.last_bad_norms)).int().argmax())
            name = self.names.get(self.last_bad_ids[first], "?")
            culprit = f"the first non-finite tensor was the gradient of {name!r}"
        spikes = " or spikes" if self.config.spike_zscore is not None else ""
        raise NonFiniteStepsError(
            f"{self.owner}: {consecutive} optimizer steps in a row had NaN or Inf values{spikes} "
            f"(max_consecutive={max_consecutive}); the last at global step {trainer.global_step}, where {culprit}."
        )
