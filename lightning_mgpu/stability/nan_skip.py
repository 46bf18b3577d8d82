"""Skip optimizer steps whose loss or gradients are NaN or Inf, or spike, the same way on every rank."""

import functools
import math
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core._logging import (
    has_progress_bar,
    show_in_progress_bar,
)
from lightning_mgpu.core.step_pieces import current_piece_share
from lightning_mgpu.core.training_events import EventLog, RecordsEvents
from lightning_mgpu.core.validation import check_bool, check_choice, check_int, check_positive
from lightning_mgpu.long_runs.exact_resume import KeepsRankState
from lightning_mgpu.stability._amp import loss_scale, params_to_step
from lightning_mgpu.stability._grad_norms import clear_gradient_norms, gradient_norms
from lightning_mgpu.stability._step_verdict import (
    clear_step_verdicts,
    register_step_decider,
    step_is_bad,
    unregister_step_decider,
)
from lightning_mgpu.stability.device_skip import FusedRoute, MaskedStep, fused_kernel_can_skip, why_no_fused_route
from lightning_mgpu.stability.spike_window import SpikeWindow
from lightning_mgpu.stability.training_snapshot import TrainingSnapshot

CheckTarget = Literal["loss", "grads", "both"]
CHECK_TARGETS: tuple[str, ...] = get_args(CheckTarget)
SpikeTarget = Literal["loss", "grad_norm", "both"]
SPIKE_TARGETS: tuple[str, ...] = get_args(SpikeTarget)
SpikeAction = Literal["skip", "rollback"]
SPIKE_ACTIONS: tuple[str, ...] = get_args(SpikeAction)


class NonFiniteStepsError(RuntimeError):
    """Raised by :class:`NaNSkip` when ``max_consecutive`` optimizer steps in a row were not finite."""


class RollbackLimitError(RuntimeError):
    """Raised by :class:`NaNSkip` on every rank when a bad step would exceed ``max_rollbacks``."""


class NaNSkip(RecordsEvents, KeepsRankState, Callback):
    """Skip every optimizer step whose loss or gradients are not finite, on every rank, and keep training.

    A skipped step leaves parameters, optimizer state (moments, step counters) and BatchNorm running statistics
    exactly as they were before the step; its gradients are discarded. With gradient accumulation the whole
    accumulated step is skipped.

    A gradient counts as non-finite when its fp32 2-norm is: when an element is NaN or Inf, and also when the norm
    overflows (above about 1e19), a step no optimizer should take either.

    Spikes (``spike_zscore``, off by default): a step whose loss or global gradient norm (``spike_on``) is more than
    ``spike_zscore`` standard deviations above its rolling window of the last ``spike_window`` accepted values counts
    as bad, exactly like a non-finite step: skipped the same way, counted in ``skipped_steps`` (and in
    ``spiked_steps``), and limited by ``max_consecutive``. The test starts once the window holds
    ``max(20, spike_window // 2)`` values (all of them for a window shorter than 20). The window never takes in a
    non-finite value or a skipped step's. Everything is decided on the device:

    - the gradient norm is the global one, after DDP's all-reduce (or over every FSDP shard): the same on every
      rank, so every rank decides alike; each optimizer has its own window;
    - the loss is each rank's own (divided by the loss scale under ``16-mixed``), tested at every micro-batch against
      that rank's window of micro-batch losses; a rank whose loss spikes turns its backward pass into NaN, as for a
      NaN loss, so every rank skips the step. Under the pack's strategies each rank resumes its own loss window from a
      checkpoint (they save every rank's); under others, every rank resumes rank 0's.
      Under manual optimization the loss is not tested (several backward passes for several optimizers may share a
      batch), only the gradient norms.

    The decision is the one source of "this step is bad" for the pack's other callbacks: GradientClipping's z-score
    statistics leave out exactly the steps NaNSkip skips, in either callback order.

    Rollback (``spike_action="rollback"``): every ``snapshot_every`` optimizer steps (and at the start of training)
    an in-memory snapshot is taken of the parameters, buffers, optimizer states and param-group settings, the LR
    schedulers, the GradScaler and the pack's callback statistics (spike windows, GradientClipping's z-score
    statistics). On CUDA it is copied into pinned host memory with non-blocking copies on a side stream (no host
    sync; the training stream waits for them on the device before the next batch); it holds one copy of the
    parameters, buffers and optimizer states in host memory, printed at the first snapshot. At the end of a batch
    whose step was bad (a spike or a non-finite step: the verdict is the same on every rank, where the cause may
    not be), every rank puts the snapshot back, so the batches since the snapshot, the bad one included, are dropped
    from training; the loader carries on with the next batch, the data order otherwise kept. ``global_step`` and
    ``max_steps`` keep counting the dropped steps. Each rollback gets an info line, a ``rollback`` event and the
    ``rollbacks`` count; the ``max_rollbacks + 1``-th raises :class:`RollbackLimitError` on every rank. The
    verdict is read on the host once per step (free on the CPU; with a fused optimizer on CUDA, where the skip
    itself needs no read, it is one synchronisation per step). Not with ``precision="16-mixed"``, whose loss-scale
    overflows would each roll back.

    Every rank takes the same decision without an extra collective: a non-finite gradient on any rank is
    non-finite on all of them after DDP's gradient all-reduce, and a rank whose loss is not finite turns its
    backward pass into NaN (a hook on the loss), so its state reaches the others through that same all-reduce.
    Under several processes ``check="loss"`` therefore also skips steps with non-finite reduced gradients.

    How the step is skipped:

    - fused torch optimizers (``Adam``/``AdamW``/``SGD`` with ``fused=True``, CPU or CUDA): on the device,
      through the ``found_inf`` argument their kernels take (as ``GradScaler`` does): no host synchronisation.
    - torch's ``Adam``/``AdamW``/``SGD`` without ``fused=True``, with ``skip_on_device="auto"`` on an accelerator or
      ``True`` anywhere: each step runs through the class's fused kernel with ``found_inf``
      (:class:`~lightning_mgpu.stability.device_skip.FusedRoute`): the flags are set for the step only, so the
      optimizer's settings and ``state_dict`` stay the user's; the results are the fused kernel's (they differ from
      the foreach kernel's by rounding). SGD with momentum reads its first step's verdict on the host.
    - any other optimizer with ``skip_on_device=True``: the step is masked
      (:class:`~lightning_mgpu.stability.device_skip.MaskedStep`): a device backup of its parameters and state, put
      back by ``torch.where`` where the step is bad; it holds one copy of them. Its first step, and every step of an
      optimizer whose state is kept on the host (counters without ``capturable=True``) or is not a tensor, reads the
      verdict on the host instead (said once, with the reason).
    - otherwise (``skip_on_device=False``; ``"auto"`` on the CPU, where a host read costs nothing; ``"auto"`` for an
      optimizer without a fused twin) the flag is read on the host once per optimizer step (on CUDA, one
      synchronisation per optimizer step) and every gradient is set to ``None``, which torch's optimizers skip
      exactly. Which way each optimizer takes is printed at the start of ``fit``.
    - ``precision="16-mixed"``: ``GradScaler`` already skips steps with inf/NaN gradients; they are counted.
      Its first steps may overflow while it calibrates the loss scale: leave ``max_consecutive`` large enough.
    - manual optimization: the optimizer step the ``training_step`` calls is skipped as above; what the step does
      around it (schedulers, extra backward calls) is the user's.
    - learning-rate schedulers, ``global_step`` and ``max_steps`` still advance on a skipped step, as they do on a
      step GradScaler skips.

    Logged keys, on the steps Lightning's loggers write (every ``log_every_n_steps``; a ``self.log`` call costs about
    0.6 ms on CPU): ``skipped_steps`` (count, total since the start of training) and, with spike detection on,
    ``spiked_steps`` (the part of them skipped for a spike). A summary is
    printed on rank 0 at the end of ``fit``. The counters are saved in checkpoints.

    One info line is printed on rank 0 when a step is skipped, as soon as it is known on the host without an extra
    device read: at once where the flag is read on the host anyway ("skipped optimizer step 12: the loss is NaN or
    Inf"), and for fused optimizers, which skip on the device, at the next logging step or at the end of training
    ("3 optimizer steps skipped since step 40"). A storm stays readable: after 10 lines, one line per 100 skipped
    steps. Each skip is also recorded in ``events`` (an :class:`~lightning_mgpu.core.training_events.EventLog`),
    which :class:`~lightning_mgpu.GPUMemoryMonitor` marks on its memory timeline. Under several processes every rank
    skips the same steps; the cause named is what rank 0 saw (another rank's NaN loss reaches it as NaN gradients).

    Progress bar field, with ``progress_bar=True`` and a Trainer that draws a bar: ``skipped``, the same total,
    refreshed at the end of the same logging steps (never with ``log_every_n_steps=0``), where the count is read from
    the device once, after the optimizer step, as Lightning's loggers read it anyway when ``log_skipped`` is on and a
    logger is set. It is not sent to the loggers.

    Args:
        check: ``"loss"``, ``"grads"`` or ``"both"``.
        max_consecutive: after this many skipped steps in a row raise :class:`NonFiniteStepsError` on every rank,
            naming the step and the first non-finite tensor; ``None`` for no limit.
        log_skipped: log ``skipped_steps``.
        progress_bar: show ``skipped`` in the progress bar.
        spike_zscore: standard deviations above the window's mean that make a loss or gradient norm a spike;
            ``None`` (the default) turns spike detection off. OLMo-core uses 6.
        spike_window: how many accepted values the rolling window holds.
        spike_on: ``"loss"``, ``"grad_norm"`` or ``"both"``: which values are tested for spikes.
        spike_action: ``"skip"`` the bad step, or ``"rollback"`` to the last snapshot.
        snapshot_every: ``rollback``: optimizer steps between snapshots.
        max_rollbacks: ``rollback``: rollbacks allowed over the whole run; ``None`` for no limit.
        skip_on_device: ``"auto"``, ``True`` or ``False``: skip the bad steps of non-fused optimizers on the device,
            with no host read (see above); ``"auto"`` does so on accelerators, through fused kernels only.

    Raises:
        TypeError: a ``check`` or ``spike_on`` that is not a string, a ``max_consecutive`` or ``spike_window`` that is
            not an int (or None where allowed), a ``spike_zscore`` that is not a number or None, or a
            ``log_skipped`` or ``progress_bar`` that is not a bool, or a ``skip_on_device`` that is neither a bool nor
            a string.
        ValueError: an unknown ``check``, ``spike_on`` or ``skip_on_device``, a ``max_consecutive`` below 1, a
            ``spike_zscore`` that is not positive, or a ``spike_window`` below 2.
        NonFiniteStepsError: during ``fit``, see ``max_consecutive``.
        RollbackLimitError: during ``fit``, see ``max_rollbacks``.
        MisconfigurationException: at setup, ``spike_action="rollback"`` with ``precision="16-mixed"``.

    Example::

        trainer = Trainer(callbacks=[NaNSkip(check="both", max_consecutive=25, spike_zscore=6.0)])
    """

    def __init__(
        self,
        check: CheckTarget = "both",
        max_consecutive: int | None = 25,
        log_skipped: bool = True,
        progress_bar: bool = True,
        spike_zscore: float | None = None,
        spike_window: int = 128,
        spike_on: SpikeTarget = "both",
        spike_action: SpikeAction = "skip",
        snapshot_every: int = 50,
        max_rollbacks: int | None = 5,
        skip_on_device: bool | Literal["auto"] = "auto",
    ):
        owner = type(self).__name__
        check_choice(owner, "check", check, CHECK_TARGETS)
        check_int(owner, "max_consecutive", max_consecutive, minimum=1, allow_none=True, hint="use None for no limit")
        check_bool(owner, "log_skipped", log_skipped)
        check_bool(owner, "progress_bar", progress_bar)
        check_positive(owner, "spike_zscore", spike_zscore, allow_none=True, hint="use None to turn spikes off")
        check_int(owner, "spike_window", spike_window, minimum=2)
        check_choice(owner, "spike_on", spike_on, SPIKE_TARGETS)
        check_choice(owner, "spike_action", spike_action, SPIKE_ACTIONS)
        check_int(owner, "snapshot_every", snapshot_every, minimum=1)
        check_int(owner, "max_rollbacks", max_rollbacks, minimum=1, allow_none=True, hint="use None for no limit")
        check_choice(owner, "skip_on_device", skip_on_device, ("auto", True, False))
        self.check = check
        self.max_consecutive = max_consecutive
        self.log_skipped = log_skipped
        self.progress_bar = progress_bar
        self.spike_zscore = spike_zscore
        self.spike_window = spike_window
        self.spike_on = spike_on
        self.spike_action = spike_action
        self.snapshot_every = snapshot_every
        self.max_rollbacks = max_rollbacks
        self.skip_on_device = skip_on_device
        self.rollbacks = 0
        # per optimizer (by id): how its bad steps are skipped on the device, and the last reason a masked one read
        self._routes: dict[int, FusedRoute] = {}
        self._masks: dict[int, MaskedStep] = {}
        self._host_reasons: dict[int, str] = {}
        self._masked_reported: set[int] = set()  # ids of the optimizers whose backup size was printed
        self._rollback: TrainingSnapshot | None = None
        self._rollback_due: int | None = None  # the global step of a bad step, until its batch ends
        self._loss_window: SpikeWindow | None = None
        self._norm_windows: list[SpikeWindow] = []  # one per optimizer, in trainer.optimizers' order
        if spike_zscore is not None and spike_on != "grad_norm":
            self._loss_window = SpikeWindow(rows=1, size=spike_window, zscore=spike_zscore)
        self._optimizer_index: dict[int, int] = {}
        self._stepped = False  # an optimizer step ran in this batch
        self._memory_reported = False
        self._spiked = torch.zeros((), dtype=torch.long)
        self._loss_spike: Tensor | None = None  # a micro-batch's loss of this step spiked
        self._norm_spike: Tensor | None = None
        self._step_losses: list[Tensor] = []
        # a batch OOMBackoff runs in pieces: their losses so far, and the share of the batch they held
        self._pieces_loss: Tensor | None = None
        self._pieces_share = 0.0
        self.optimizer_steps = 0
        self._skipped = torch.zeros((), dtype=torch.long)
        self._consecutive = torch.zeros((), dtype=torch.long)
        # what the last skipped step saw, for the error message: kept on the device, read only when raising
        self._last_bad_norms: Tensor | None = None
        self._last_bad_loss = torch.zeros((), dtype=torch.bool)
        self._last_bad_spike = torch.zeros((), dtype=torch.bool)
        self._last_bad_ids: tuple[int, ...] = ()
        self._found_inf: Tensor | None = None
        self._loss_bad: Tensor | None = None
        self._buffers: list[Tensor] = []
        self._snapshot: list[Tensor] | None = None
        self._names: dict[int, str] = {}
        self._distributed = False
        self._hooks: list[Any] = []
        self._lagged = _LaggedRead()
        self._bar_due = False
        self.events = EventLog()
        self._lines = _SkipLines()
        self._reported = 0  # skipped steps already reported, a host-side count
        self._unread_from: int | None = None  # the first step whose skip decision stayed on the device, unread
        self._report_due = False

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (reads the device)."""
        return int(self._skipped)

    @property
    def spiked_steps(self) -> int:
        """Optimizer steps skipped for a spike this rank saw (reads the device)."""
        return int(self._spiked)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        self._distributed = trainer.world_size > 1
        if self.spike_action == "rollback" and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise MisconfigurationException(
                f"{type(self).__name__}(spike_action='rollback') cannot run with precision='16-mixed': every "
                "loss-scale overflow the GradScaler skips would roll training back. Use precision='bf16-mixed', or "
                "spike_action='skip'."
            )

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        device = pl_module.device
        self._skipped = self._skipped.to(device)
        self._spiked = self._spiked.to(device)
        self._loss_spike = self._norm_spike = None
        self._step_losses = []
        self._pieces_loss, self._pieces_share = None, 0.0
        self._consecutive = self._consecutive.to(device)
        self._last_bad_loss = self._last_bad_loss.to(device)
        self._last_bad_norms = None
        self._lagged = _LaggedRead()
        self._bar_due = False
        self._lines = _SkipLines()
        self._unread_from = None
        self._report_due = False
        clear_gradient_norms()
        # after configure_model, which may build layers after setup
        self._names = {id(p): name for name, p in pl_module.named_parameters()}
        # the running statistics a bad forward pass may already have changed; sync-BN layers are BatchNorms too
        self._buffers = [
            buffer
            for module in pl_module.modules()
            if isinstance(module, compat.BatchNormBase)
            for buffer in module.buffers()
        ]
        self._snapshot = None
        clear_step_verdicts()
        self._masked_reported = set()
        self._optimizer_index = {id(optimizer): i for i, optimizer in enumerate(trainer.optimizers)}
        self._last_bad_spike = self._last_bad_spike.to(device)
        self._stepped = False
        self._memory_reported = False
        self._rollback_due = None
        self._rollback = None
        if self.spike_action == "rollback":
            self._rollback = TrainingSnapshot(
                pl_module,
                trainer.optimizers,
                [config.scheduler for config in trainer.lr_scheduler_configs],
                getattr(trainer.precision_plugin, "scaler", None),
                extra=functools.partial(self._state_to_roll_back, trainer),
                restore_extra=functools.partial(self._roll_state_back, trainer),
            )
        for optimizer in trainer.optimizers:
            # found_inf is an argument of one step only; GradScaler removes the one it sets itself
            self._hooks.append(optimizer.register_step_post_hook(self._drop_found_inf))
            register_step_decider(optimizer, self._decide)
        self._choose_device_skips(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int):
        if self._rollback is not None and self._rollback.step is None:
            # the first snapshot, once the strategy's on_train_start has put back what a checkpoint held per rank
            self._rollback.take(trainer.global_step)
        self._pieces_loss, self._pieces_share = None, 0.0  # pieces never cross a batch: none left from the last
        if self._snapshot is None:  # the first micro-batch of an optimizer step
            self._snapshot = [buffer.detach().clone() for buffer in self._buffers]
            self._loss_bad = torch.zeros((), dtype=torch.bool, device=pl_module.device)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        bad: Tensor | None = None
        if self.check != "grads":
            bad = ~torch.isfinite(loss.detach()).all()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        # manual optimization may run several backward passes for several optimizers per batch: their losses are not
        # one series, and a flag could not be told apart per optimizer; the gradient norms are tested there
        if self._loss_window is not None and pl_module.automatic_optimization:
            value = self._batch_loss(trainer, pl_module, loss)
            if value is not None:  # the batch's loss, whole or, after the last of its pieces, summed from them
                spike = self._loss_window.is_spike(value)[0]
                self._loss_spike = spike if self._loss_spike is None else self._loss_spike | spike
                self._step_losses.append(value)
                bad = spike if bad is None else bad | spike
        if bad is not None and self._distributed and loss.requires_grad:
            # the other ranks learn of this rank's bad loss through DDP's gradient all-reduce
            poison = torch.where(bad, math.nan, 1.0)
            loss.register_hook(lambda grad: grad * poison.to(grad.dtype))

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        clear_gradient_norms()  # new gradients: norms cached for an earlier backward (LBFGS, resumes) are stale
        clear_step_verdicts()

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer
    ) -> None:
        self._clear_unfinished_step(optimizer)
        params = params_to_step(trainer, optimizer)
        bad = step_is_bad(optimizer, params, trainer.global_step)
        if bad is None:  # an optimizer built after fit started
            bad = self._decide(optimizer, params, trainer.global_step)
        self._count(bad)
        self.optimizer_steps += 1
        way = self._device_skip(optimizer, trainer, params, bad.device)
        if self.max_consecutive is not None:  # before anything is changed: a raise leaves the optimizer as it was
            lagged = way is not None and self._consecutive.is_cuda
            self._raise_if_too_many(trainer, self._lagged.read(self._consecutive) if lagged else None)
        if way is not None:
            if way == "fused":  # the fused kernels leave parameters and state as they were where this is 1
                route = self._routes.get(id(optimizer))
                if route is not None:  # a non-fused torch optimizer: through its fused kernel for this step
                    route.engage()
                self._found_inf = optimizer.found_inf = bad.float()
            else:  # the optimizer's step post-hook puts the backup back where this is true
                self._arm_mask(self._masks[id(optimizer)], params, bad)
            self._restore_buffers(bad)
            if self._unread_from is None:
                self._unread_from = trainer.global_step
        elif bool(bad):  # one host read per optimizer step for optimizers that cannot skip on the device
            for param in params:
                param.grad = None
            self._restore_buffers(None)
            self._report_skip(trainer.global_step, *self._cause())
        if self._rollback is not None and self._rollback_due is None and bool(bad):
            self._rollback_due = trainer.global_step
        self._stepped = True
        self._snapshot = None
        self._loss_bad = self._loss_spike = self._norm_spike = None
        self._step_losses = []
        if not compat.is_logging_step(trainer):
            return
        if self.log_skipped:
            pl_module.log("skipped_steps", self._skipped.float(), on_step=True, on_epoch=False)
            if self.spike_zscore is not None:
                pl_module.log("spiked_steps", self._spiked.float(), on_step=True, on_epoch=False)
            if self._rollback is not None:
                pl_module.log("rollbacks", float(self.rollbacks), on_step=True, on_epoch=False)
        # read at the end of the batch, once the optimizer step is queued, not before it
        self._bar_due = self.progress_bar and has_progress_bar(trainer)
        # a fused optimizer's skips are read only where the count is read anyway (a logger writes it, the bar shows
        # it); otherwise they are reported at the end of training
        self._report_due = self._unread_from is not None and (
            self._bar_due or (self.log_skipped and bool(trainer.loggers))
        )

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rollback is not None:
            self._snapshot_or_roll_back(trainer, self._rollback)
        if not (self._bar_due or self._report_due):
            return
        skipped = self.skipped_steps  # one device read, on a logging step
        if self._report_due:
            self._report_due = False
            self._report_unread(trainer, skipped)
        if self._bar_due:
            self._bar_due = False
            show_in_progress_bar(pl_module, "skipped", skipped)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._unread_from is not None:  # skips on the device since the last logging step
            self._report_unread(trainer, self.skipped_steps)

    def _cause(self) -> tuple[str, str]:
        """What tripped, short and long; read only when a step is skipped (the flag was just read on the host)."""
        if self._loss_bad is not None and bool(self._loss_bad):
            return "NaN/Inf loss", "the loss is NaN or Inf"
        spiked_by = f"more than {self.spike_zscore} standard deviations above its recent mean"
        if self._loss_spike is not None and bool(self._loss_spike):
            return "loss spike", f"the loss spiked ({spiked_by})"
        if self._norm_spike is not None and bool(self._norm_spike):
            return "gradient-norm spike", f"the gradient norm spiked ({spiked_by})"
        if self._distributed and self.check != "grads":
            return "NaN/Inf gradients", (
                "NaN or Inf gradients (after the all-reduce: this rank's gradients, or another rank's loss)"
            )
        return "NaN/Inf gradients", "NaN or Inf gradients"

    def _report_skip(self, step: int, short: str, cause: str) -> None:
        before, self._reported = self._reported, self._reported + 1
        self.events.record(step, "skipped_steps", short)
        suffix = self._lines.due(before, self._reported)
        if suffix is not None:
            rank_zero_info(
                f"{type(self).__name__}: skipped optimizer step {step}: {cause}; {self._reported} skipped so far"
                f"{suffix}."
            )

    def _report_unread(self, trainer: "pl.Trainer", skipped: int) -> None:
        since, self._unread_from = self._unread_from, None
        new = skipped - self._reported
        if new <= 0:
            return
        before, self._reported = self._reported, skipped
        last = trainer.global_step - 1  # the step counter already moved past the last optimizer step
        self.events.record(last, "skipped_steps", f"{new} in steps {since}-{last}")
        suffix = self._lines.due(before, skipped)
        if suffix is not None:
            steps = "step" if new == 1 else "steps"
            rank_zero_info(
                f"{type(self).__name__}: {new} optimizer {steps} skipped since step {since} (through step {last}; "
                f"skipped on the device, read at logging steps); {skipped} skipped so far{suffix}."
            )

    def _choose_device_skips(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Decide, per optimizer, how its bad steps are skipped with no host read, and say so once."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        wanted = self.skip_on_device is True or (self.skip_on_device == "auto" and pl_module.device.type != "cpu")
        lines = []
        for index, optimizer in enumerate(trainer.optimizers):
            name = f"optimizer {index} ({type(optimizer).__name__})"
            if scaler is not None:  # GradScaler skips inf/NaN steps itself
                continue
            if compat.supports_amp_scaling(optimizer):
                continue  # fused: skips through found_inf, as always
            if not wanted:  # skip_on_device=False, or "auto" on the CPU, where a host read costs nothing
                continue
            reason = why_no_fused_route(optimizer)
            if reason is None:
                self._routes[id(optimizer)] = FusedRoute(optimizer)
                lines.append(f"{name} steps through its fused kernel, which skips bad steps on the device")
            elif self.skip_on_device is True:
                self._masks[id(optimizer)] = MaskedStep(optimizer)
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
            rank_zero_info(f"{type(self).__name__}: " + "; ".join(lines) + ".")

    def _device_skip(
        self, optimizer: Optimizer, trainer: "pl.Trainer", params: list[Tensor], device: torch.device
    ) -> str | None:
        """How this step is skipped with no host read: ``"fused"`` (found_inf), ``"masked"``, or ``None`` (read)."""
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return None  # GradScaler handles inf/NaN steps
        route = self._routes.get(id(optimizer))
        if route is not None:
            return "fused" if route.can_route(params) else None
        if compat.supports_amp_scaling(optimizer):
            return "fused" if fused_kernel_can_skip(optimizer, params) else None
        mask = self._masks.get(id(optimizer))
        if mask is None:
            return None
        reason = mask.why_not(params, device)
        if reason is not None:
            first_step = any(not optimizer.state.get(p) for p in params)  # expected: no line
            if not first_step and self._host_reasons.get(id(optimizer)) != reason:  # said once per reason
                self._host_reasons[id(optimizer)] = reason
                rank_zero_info(
                    f"{type(self).__name__}: {type(optimizer).__name__}'s step {trainer.global_step} reads its verdict "
                    f"on the host: {reason}."
                )
            return None
        return "masked"

    def _clear_unfinished_step(self, optimizer: Optimizer) -> None:
        """What an earlier step that raised (and was caught, as under manual optimization) left set for itself."""
        self._drop_found_inf(optimizer)
        route, mask = self._routes.get(id(optimizer)), self._masks.get(id(optimizer))
        if route is not None:
            route.release()
        if mask is not None:
            mask.disarm()

    def _arm_mask(self, mask: MaskedStep, params: list[Tensor], bad: Tensor) -> None:
        mask.arm(params, bad)
        if id(mask.optimizer) not in self._masked_reported:
            self._masked_reported.add(id(mask.optimizer))
            rank_zero_info(
                f"{type(self).__name__}: the masked step of {type(mask.optimizer).__name__} holds "
                f"{mask.nbytes / 2**20:.2f} MB of device memory per process."
            )

    def _drop_found_inf(self, optimizer: Optimizer, *_: Any) -> None:
        if self._found_inf is not None and getattr(optimizer, "found_inf", None) is self._found_inf:
            del optimizer.found_inf

    def _snapshot_or_roll_back(self, trainer: "pl.Trainer", snapshot: TrainingSnapshot) -> None:
        """At a batch's end (its optimizer and LR-scheduler steps done): roll back after a bad step, else snapshot."""
        stepped, self._stepped = self._stepped, False
        if self._rollback_due is not None:
            bad_step, self._rollback_due = self._rollback_due, None
            self._roll_back(bad_step, snapshot)
            return
        if not stepped:  # a micro-batch of gradient accumulation: the step is not done
            return
        last = snapshot.step if snapshot.step is not None else trainer.global_step
        # a new snapshot every snapshot_every steps, or at once where the optimizers' parameters changed since
        if trainer.global_step - last >= self.snapshot_every or not snapshot.matches():
            snapshot.take(trainer.global_step)
            if not self._memory_reported:  # now that the optimizer states exist
                self._memory_reported = True
                rank_zero_info(
                    f"{type(self).__name__}: rollback snapshots every {self.snapshot_every} optimizer steps hold "
                    f"{snapshot.nbytes / 2**20:.1f} MB of host memory per process."
                )

    def _roll_back(self, bad_step: int, snapshot: TrainingSnapshot) -> None:
        if self.max_rollbacks is not None and self.rollbacks >= self.max_rollbacks:
            raise RollbackLimitError(
                f"{type(self).__name__}: the bad optimizer step {bad_step + 1} would be rollback number "
                f"{self.rollbacks + 1}, over max_rollbacks={self.max_rollbacks}. Training keeps going bad: lower the "
                "learning rate, look at the data around these steps, or raise max_rollbacks."
            )
        self.rollbacks += 1
        saved = snapshot.restore()
        dropped = f"steps {saved + 1}-{bad_step + 1}" if bad_step > saved else f"step {bad_step + 1}"
        self.events.record(bad_step, "rollback", f"to step {saved}: {dropped} dropped")
        rank_zero_info(
            f"{type(self).__name__}: optimizer step {bad_step + 1} was bad: rolled back to the state after step "
            f"{saved}, dropping {dropped}; {self.rollbacks} rollback(s) so far"
            + (f" of at most {self.max_rollbacks}." if self.max_rollbacks is not None else ".")
        )

    def _state_to_roll_back(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """The statistics a rollback puts back: the spike windows, and the other pack callbacks' (deep-copied)."""
        others = [cb._rollback_state() for cb in trainer.callbacks if hasattr(cb, "_load_rollback_state")]
        return {"windows": (self._loss_window, self._norm_windows), "others": others}

    def _roll_state_back(self, trainer: "pl.Trainer", state: dict[str, Any]) -> None:
        self._loss_window, self._norm_windows = state["windows"]
        callbacks = [cb for cb in trainer.callbacks if hasattr(cb, "_load_rollback_state")]
        for callback, saved in zip(callbacks, state["others"], strict=True):
            callback._load_rollback_state(saved)

    def _measured_loss(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> Tensor:
        """The micro-batch's loss as the user computed it: unscaled, and not divided for gradient accumulation."""
        value = loss.detach().float().mean()
        scale = loss_scale(trainer)
        if scale is not None:
            value = value / scale.to(value.device)
        return value * trainer.accumulate_grad_batches  # Lightning divided it by the accumulation before this hook

    def _batch_loss(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> Tensor | None:
        """The batch's loss, of shape (1,), once it is known; ``None`` for a piece of a batch before its last.

        OOMBackoff runs a batch that does not fit as pieces, each loss weighted by the piece's share of the batch (a
        mean loss) or a partial sum (a sum): their sum is the batch's loss, which the window compares, as without the
        split. A piece's own loss would be noisier than the batch's the window holds, and look like a spike.
        """
        share = current_piece_share()
        value = self._measured_loss(trainer, pl_module, loss)
        if share >= 1.0 and self._pieces_loss is None:
            return value.view(1)
        self._pieces_loss = value if self._pieces_loss is None else self._pieces_loss + value
        self._pieces_share += share
        if self._pieces_share < 1.0 - 1e-9:
            return None
        value, self._pieces_loss, self._pieces_share = self._pieces_loss.view(1), None, 0.0
        return value

    # ------------------------------------------------------------------------------------------ attempts
    def save_attempt(self) -> tuple[Any, ...]:
        """The loss verdicts so far in this optimizer step: an attempt OOMBackoff drops must not leave its own.

        Without this, a rank whose dropped attempt's loss spiked would skip the step the other ranks take.
        """
        return self._loss_bad, self._loss_spike, len(self._step_losses), self._pieces_loss, self._pieces_share

    def restore_attempt(self, saved: tuple[Any, ...]) -> None:
        """Forget the dropped attempt's loss verdicts and losses (the tensors are replaced, never changed in place)."""
        self._loss_bad, self._loss_spike, count, self._pieces_loss, self._pieces_share = saved
        del self._step_losses[count:]

    def _norm_window(self, optimizer: Optimizer) -> SpikeWindow | None:
        """The gradient-norm window of ``optimizer`` (each optimizer's norms have their own scale), if spikes are on."""
        if self.spike_zscore is None or self.spike_on == "loss":
            return None
        index = self._optimizer_index.get(id(optimizer), len(self._optimizer_index))
        while len(self._norm_windows) <= index:
            self._norm_windows.append(SpikeWindow(rows=1, size=self.spike_window, zscore=self.spike_zscore))
        return self._norm_windows[index]

    def _decide(self, optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor:
        """This optimizer step's verdict (true: skip it), on the device; the windows take in a step it accepts."""
        bad = self._flag(optimizer, params, step)
        spiked = torch.zeros((), dtype=torch.bool, device=bad.device)
        if self._loss_spike is not None:
            spiked = spiked | self._loss_spike.to(bad.device)
        norm: Tensor | None = None
        window = self._norm_window(optimizer)
        if window is not None and params:
            norm = torch.linalg.vector_norm(gradient_norms(optimizer, params, step).to(bad.device)).view(1)
            self._norm_spike = window.is_spike(norm)[0]
            spiked = spiked | self._norm_spike
        bad = bad | spiked
        self._spiked = self._spiked + (spiked & bad).long()
        self._last_bad_spike = torch.where(bad, spiked, self._last_bad_spike.to(bad.device))
        if self._loss_window is not None and self._step_losses:
            self._loss_window.update_many(self._step_losses, ~bad)
        if norm is not None and window is not None:
            window.update(norm, ~bad)
        return bad

    def _flag(self, optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor:
        device = self._skipped.device
        bad = torch.zeros((), dtype=torch.bool, device=device)
        check_grads = self.check != "loss" or self._distributed  # other ranks' losses arrive in the gradients
        if check_grads and params:
            # fp32 2-norms: NaN or Inf when an element is (or, harmlessly, when a norm exceeds ~1e19); the inf-norm
            # kernel is ~35x slower on CPU
            norms = gradient_norms(optimizer, params, step).to(device)
            bad = ~torch.isfinite(norms.sum())
            ids = tuple(map(id, params))
            if self._last_bad_norms is None or self._last_bad_ids != ids:  # another parameter set: start over
                self._last_bad_norms, self._last_bad_ids = norms, ids
            else:
                self._last_bad_norms = torch.where(bad, norms, self._last_bad_norms)
        if self.check != "grads" and self._loss_bad is not None:
            loss_bad = self._loss_bad.to(device)
            self._last_bad_loss = torch.where(bad | loss_bad, loss_bad, self._last_bad_loss.to(device))
            bad = bad | loss_bad
        return bad

    def _count(self, bad: Tensor) -> None:
        self._skipped = self._skipped + bad.long()
        self._consecutive = torch.where(bad, self._consecutive + 1, 0)

    def _restore_buffers(self, bad: Tensor | None) -> None:
        if not self._snapshot:
            return
        for buffer, saved in zip(self._buffers, self._snapshot, strict=True):
            buffer.copy_(saved if bad is None else torch.where(bad, saved, buffer))

    def _raise_if_too_many(self, trainer: "pl.Trainer", lagged: int | None) -> None:
        # every rank reads the same step's value at the same step, so all raise together
        consecutive = int(self._consecutive) if lagged is None else lagged
        if self.max_consecutive is None or consecutive < self.max_consecutive:
            return
        culprit = "the first non-finite tensor was " + ("the loss" if bool(self._last_bad_loss) else "a gradient")
        if bool(self._last_bad_spike):
            culprit = "the loss or the gradient norm spiked"
        elif not bool(self._last_bad_loss) and self._last_bad_norms is not None:
            first = int((~torch.isfinite(self._last_bad_norms)).int().argmax())
            culprit = (
                f"the first non-finite tensor was the gradient of {self._names.get(self._last_bad_ids[first], '?')!r}"
            )
        spikes = " or spikes" if self.spike_zscore is not None else ""
        raise NonFiniteStepsError(
            f"{type(self).__name__}: {consecutive} optimizer steps in a row had NaN or Inf values{spikes} "
            f"(max_consecutive={self.max_consecutive}); the last at global step {trainer.global_step}, where "
            f"{culprit}."
        )

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        rank_zero_info(
            f"{type(self).__name__}: skipped {self.skipped_steps} of {self.optimizer_steps} optimizer steps "
            f"for NaN or Inf values{' or spikes' if self.spike_zscore is not None else ''}"
            + (f"; {self.rollbacks} rollback(s)." if self.spike_action == "rollback" else ".")
        )

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hooks(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_hooks(trainer)  # Lightning does not call teardown after an exception

    def _remove_hooks(self, trainer: "pl.Trainer") -> None:
        self._rollback = None  # the snapshot's host memory goes with it
        self._rollback_due = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for optimizer in trainer.optimizers:
            self._drop_found_inf(optimizer)
            unregister_step_decider(optimizer, self._decide)
        for way in (*self._routes.values(), *self._masks.values()):
            way.remove()
        self._routes, self._masks, self._host_reasons = {}, {}, {}

    @override
    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks, for the pack's strategies to save from every rank: the loss window."""
        return {"loss_window": self._loss_window.state_dict()} if self._loss_window is not None else {}

    @override
    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take this rank's loss window back."""
        if self._loss_window is not None and "loss_window" in state:
            self._loss_window.load_state_dict(state["loss_window"])

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "skipped_steps": int(self._skipped),
            "consecutive": int(self._consecutive),
            "optimizer_steps": self.optimizer_steps,
            "spiked_steps": int(self._spiked),
            "rollbacks": self.rollbacks,
        }
        if self._loss_window is not None:
            state["loss_window"] = self._loss_window.state_dict()
        if self._norm_windows:
            state["grad_norm_windows"] = [window.state_dict() for window in self._norm_windows]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._skipped = torch.tensor(int(state_dict.get("skipped_steps", 0)), device=self._skipped.device)
        self._reported = int(self._skipped)  # reported by the run that saved them
        self._consecutive = torch.tensor(int(state_dict.get("consecutive", 0)), device=self._consecutive.device)
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self._spiked = torch.tensor(int(state_dict.get("spiked_steps", 0)), device=self._spiked.device)
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        if self._loss_window is not None and "loss_window" in state_dict:
            self._loss_window.load_state_dict(state_dict["loss_window"])
        if self.spike_zscore is not None and self.spike_on != "loss":
            self._norm_windows = []
            for saved in state_dict.get("grad_norm_windows", []):
                window = SpikeWindow(rows=1, size=self.spike_window, zscore=self.spike_zscore)
                window.load_state_dict(saved)
                self._norm_windows.append(window)


class _SkipLines:
    """Which skip reports get a line, so that a storm of skips does not flood the log.

    Each of the first ``first`` reports gets one, then a report gets one when the count passes a multiple of ``every``.
    """

    def __init__(self, first: int = 10, every: int = 100) -> None:
        self.first = first
        self.every = every
        self.printed = 0

    def due(self, before: int, after: int) -> str | None:
        """``None`` for no line, else the end of the line (``""``, or a note on the rate limit)."""
        if self.printed < self.first:
            self.printed += 1
            return f"; from now on one line per {self.every} skipped steps" if self.printed == self.first else ""
        if after // self.every > before // self.every:
            self.printed += 1
            return f" (one line per {self.every} skipped steps)"
        return None


class _LaggedRead:
    """Reads a CUDA scalar one step late: a non-blocking copy to pinned memory now, read at the next call.

    Waiting on the event of the previous step's copy costs nothing in practice (that work finished long ago) and
    never stalls the current step's kernels.
    """

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._event: Any = None

    def read(self, value: Tensor) -> int:
        previous = 0
        if self._event is not None and self._host is not None:
            self._event.synchronize()
            previous = int(self._host)
        self._host = torch.empty((), dtype=value.dtype, pin_memory=True)
        self._host.copy_(value, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return previous
