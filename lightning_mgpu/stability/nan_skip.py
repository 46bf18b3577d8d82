"""Skip optimizer steps whose loss or gradients are NaN or Inf, or spike, the same way on every rank.

The callback is wiring: its options are a :class:`~lightning_mgpu.stability.nan_skip_config.NaNSkipConfig`, what
it keeps from fit to fit a :class:`~lightning_mgpu.stability.skip_tally.SkipTally`, and each fit's collaborators a
:class:`~lightning_mgpu.stability.nan_skip_fit.NaNSkipFit` (the step test, the skipper, the reports, the rollback).
"""

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core._logging import has_progress_bar
from lightning_mgpu.core.training_events import EventLog, RecordsEvents
from lightning_mgpu.long_runs.exact_resume import KeepsRankState
from lightning_mgpu.stability._amp import params_to_step
from lightning_mgpu.stability.bad_steps import NonFiniteStepsError
from lightning_mgpu.stability.nan_skip_config import CheckTarget, NaNSkipConfig, SpikeAction, SpikeTarget
from lightning_mgpu.stability.nan_skip_fit import NaNSkipFit
from lightning_mgpu.stability.skip_tally import SkipTally
from lightning_mgpu.stability.spike_rollback import RollbackLimitError

__all__ = ["NaNSkip", "NonFiniteStepsError", "RollbackLimitError"]


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

    Read after ``fit``: ``skipped_steps``, ``spiked_steps``, ``optimizer_steps``, ``rollbacks``, ``events``; the
    options, as given, as read-only attributes of the same names (``skip.max_consecutive``) and together in ``config``
    (a :class:`~lightning_mgpu.stability.nan_skip_config.NaNSkipConfig`). Build a new callback to change one.

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
        self.config = NaNSkipConfig(
            check=check,
            max_consecutive=max_consecutive,
            log_skipped=log_skipped,
            progress_bar=progress_bar,
            spike_zscore=spike_zscore,
            spike_window=spike_window,
            spike_on=spike_on,
            spike_action=spike_action,
            snapshot_every=snapshot_every,
            max_rollbacks=max_rollbacks,
            skip_on_device=skip_on_device,
        )
        self.config.validate(type(self).__name__)
        self._tally = SkipTally(self.config)  # kept from fit to fit, and in checkpoints
        self._fit: NaNSkipFit | None = None  # made at on_fit_start, dropped at the fit's end

    @property
    def check(self) -> CheckTarget:
        """What is tested: ``"loss"``, ``"grads"`` or ``"both"``."""
        return self.config.check

    @property
    def max_consecutive(self) -> int | None:
        """Skipped steps in a row that raise :class:`NonFiniteStepsError`; ``None``: no limit."""
        return self.config.max_consecutive

    @property
    def log_skipped(self) -> bool:
        """Whether ``skipped_steps`` is logged."""
        return self.config.log_skipped

    @property
    def progress_bar(self) -> bool:
        """Whether ``skipped`` is shown in the progress bar."""
        return self.config.progress_bar

    @property
    def spike_zscore(self) -> float | None:
        """Standard deviations above the window's mean that make a spike; ``None``: off."""
        return self.config.spike_zscore

    @property
    def spike_window(self) -> int:
        """How many accepted values the spike windows hold."""
        return self.config.spike_window

    @property
    def spike_on(self) -> SpikeTarget:
        """What is tested for spikes: ``"loss"``, ``"grad_norm"`` or ``"both"``."""
        return self.config.spike_on

    @property
    def spike_action(self) -> SpikeAction:
        """What a bad step does: ``"skip"`` or ``"rollback"``."""
        return self.config.spike_action

    @property
    def snapshot_every(self) -> int:
        """Optimizer steps between rollback snapshots."""
        return self.config.snapshot_every

    @property
    def max_rollbacks(self) -> int | None:
        """Rollbacks allowed over the whole run; ``None``: no limit."""
        return self.config.max_rollbacks

    @property
    def skip_on_device(self) -> bool | Literal["auto"]:
        """Whether non-fused optimizers skip bad steps on the device."""
        return self.config.skip_on_device

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (reads the device)."""
        return int(self._tally.skipped)

    @property
    def spiked_steps(self) -> int:
        """Optimizer steps skipped for a spike this rank saw (reads the device)."""
        return int(self._tally.spiked)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps tested so far, skipped or not."""
        return self._tally.optimizer_steps

    @property
    def rollbacks(self) -> int:
        """Rollbacks so far (``spike_action="rollback"``)."""
        return self._tally.rollbacks

    @property
    def events(self) -> EventLog:  # type: ignore[override]
        """Every skip and rollback, for GPUMemoryMonitor's timeline."""
        return self._tally.events

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        if self.config.rollback and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise MisconfigurationException(
                f"{type(self).__name__}(spike_action='rollback') cannot run with precision='16-mixed': every "
                "loss-scale overflow the GradScaler skips would roll training back. Use precision='bf16-mixed', or "
                "spike_action='skip'."
            )

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end_fit(trainer)  # a fit that never ended: another callback's on_exception raised before this one's
        self._fit = NaNSkipFit(type(self).__name__, self.config, self._tally, trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int):
        fit = self._fit
        if fit is None:  # no fit of its own under way: the callback joined a fit already running
            return
        if fit.rollback is not None:
            fit.rollback.start_batch(trainer)
        fit.test.start_batch(fit.skipper)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        if self._fit is not None:
            self._fit.test.watch_loss(trainer, pl_module, loss)

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._fit is None:
            return
        self._fit.service.new_gradients()  # norms and verdicts taken for an earlier backward (LBFGS...) are stale

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer
    ) -> None:
        fit, tally, config = self._fit, self._tally, self.config
        if fit is None:
            return
        test, skipper, reports = fit.test, fit.skipper, fit.reports
        step = trainer.global_step
        params = params_to_step(trainer, optimizer)
        bad = fit.service.step_is_bad(optimizer, params, step)
        if bad is None:  # an optimizer built after fit started
            bad = test.decide(optimizer, params, step)
        tally.count(bad)
        way = skipper.way(optimizer, params, bad.device, step)
        if config.max_consecutive is not None:  # before anything is changed: a raise leaves the optimizer as it was
            lagged = fit.lagged.read(tally.consecutive) if way is not None and tally.consecutive.is_cuda else None
            test.raise_if_too_many(trainer, config.max_consecutive, lagged)
        if skipper.skip(way, optimizer, params, bad):  # known bad on the host
            reports.skipped(step, *test.cause())
        elif way is not None and reports.unread_from is None:
            reports.unread_from = step
        if fit.rollback is not None:
            fit.rollback.step_done(step, bad)
        test.end_step()
        if compat.is_logging_step(trainer):
            self._log_counts(trainer, pl_module, fit)

    def _log_counts(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", fit: NaNSkipFit) -> None:
        """At a logging step: log the counts; have them read at the batch's end where the bar or a logger shows them."""
        config, tally, reports = self.config, self._tally, fit.reports
        if config.log_skipped:
            pl_module.log("skipped_steps", tally.skipped.float(), on_step=True, on_epoch=False)
            if config.spike_zscore is not None:
                pl_module.log("spiked_steps", tally.spiked.float(), on_step=True, on_epoch=False)
            if fit.rollback is not None:
                pl_module.log("rollbacks", float(tally.rollbacks), on_step=True, on_epoch=False)
        # read at the end of the batch, once the optimizer step is queued, not before it
        reports.bar_due = config.progress_bar and has_progress_bar(trainer)
        # a fused optimizer's skips are read only where the count is read anyway (a logger writes it, the bar shows
        # it); otherwise they are reported at the end of training
        reports.report_due = reports.unread_from is not None and (
            reports.bar_due or (config.log_skipped and bool(trainer.loggers))
        )

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        fit = self._fit
        if fit is None:
            return
        if fit.rollback is not None:
            fit.rollback.end_batch(trainer)
        if fit.reports.bar_due or fit.reports.report_due:
            fit.reports.read(trainer, pl_module, self.skipped_steps)  # one device read, on a logging step

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._fit is None:
            return
        reports = self._fit.reports
        if reports.unread_from is not None:  # skips on the device since the last logging step
            reports.unread(trainer, self.skipped_steps)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._fit is None:
            return
        rank_zero_info(
            f"{type(self).__name__}: skipped {self.skipped_steps} of {self.optimizer_steps} optimizer steps "
            f"for NaN or Inf values{' or spikes' if self.config.spike_zscore is not None else ''}"
            + (f"; {self.rollbacks} rollback(s)." if self.config.rollback else ".")
        )

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._end_fit(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._end_fit(trainer)  # Lightning does not call teardown after an exception

    def _end_fit(self, trainer: "pl.Trainer") -> None:
        if self._fit is not None:
            self._fit.close(trainer.optimizers)
            self._fit = None

    def save_attempt(self) -> Any:
        """The loss verdicts so far in this optimizer step: an attempt OOMBackoff drops must not leave its own.

        Without this, a rank whose dropped attempt's loss spiked would skip the step the other ranks take.
        """
        return self._fit.test.save_attempt() if self._fit is not None else None

    def restore_attempt(self, saved: Any) -> None:
        """Forget the dropped attempt's loss verdicts and losses."""
        if self._fit is not None and saved is not None:
            self._fit.test.restore_attempt(saved)

    @override
    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks, for the pack's strategies to save from every rank: the loss window."""
        return self._tally.rank_state()

    @override
    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take this rank's loss window back."""
        self._tally.load_rank_state(state)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._tally.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tally.load_state_dict(state_dict)
