"""``bucket_cap_mb="auto"`` and ``comm_hook="auto"`` during a fit: when to tune, the DDP re-wraps, the checkpoint.

The timing and the choice are :class:`~lightning_mgpu.ddp.bucket_tuning.BucketTuner`'s (pure, tested with a fake
clock); this module wires it to a :class:`~lightning_mgpu.ddp.ddp.DDPStrategy`, which calls
:class:`DDPBucketTuning` from its ``setup``, ``on_train_batch_start``, ``save_checkpoint``, ``load_checkpoint`` and
``teardown``.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.core import compat
from lightning_mgpu.ddp.bucket_tuning import (
    MIN_TIMED_STEPS,
    PAYBACK_FACTOR,
    SETTLE_STEPS,
    WARMUP_STEPS,
    BucketTuner,
    BucketTuningResult,
    Trial,
    bucket_candidates,
)

if TYPE_CHECKING:
    from lightning_mgpu.ddp.ddp import DDPStrategy

# the key under which the tuning result travels in a Lightning checkpoint
BUCKET_TUNING_CHECKPOINT_KEY = "lightning_mgpu_bucket_tuning"
# the smallest budget that times two settings with MIN_TIMED_STEPS each
MIN_BUCKET_TUNING_STEPS = WARMUP_STEPS + 2 * (SETTLE_STEPS + MIN_TIMED_STEPS)


@dataclass
class _FitTuning:
    """One fit's tuning under way: the tuner, the optimizer step it last saw, and what that step started in."""

    tuner: BucketTuner
    step: int
    marker: tuple[int, int] | None = None  # (epoch, validation runs) when that step started


class DDPBucketTuning:
    """The DDP setting a :class:`~lightning_mgpu.ddp.ddp.DDPStrategy` fit runs with, tuned where ``"auto"``.

    The bucket size lives in three roles, each held once: the option as the user gave it (the strategy's
    ``bucket_cap_mb``, never changed), the setting DDP's current wrapper was built with (:attr:`in_use`, written into
    the DDP keyword arguments by :meth:`_use` only, right before a wrap) and what tuning settled on (:attr:`result`,
    the strategy's ``bucket_tuning``). While ``bucket_cap_mb`` or ``comm_hook`` is ``"auto"``, the fit's first
    optimizer step decides (on rank 0, for every rank) whether tuning can pay off; if so a per-fit
    :class:`_FitTuning` re-wraps DDP with each trial the tuner asks for, one optimizer step boundary at a time, shares
    rank 0's timings when the tuner must decide, then logs the result. A result saved in a checkpoint is applied
    before DDP wraps the model, so a resumed fit wraps once and does not tune again.

    The strategy calls in (``setup``, ``on_train_batch_start``, ``save_checkpoint``, ``load_checkpoint``,
    ``teardown``); this object reads its options and reaches Lightning's DDP internals only through
    :mod:`lightning_mgpu.core.compat`.

    Args:
        strategy: the strategy it tunes, with its options already set.
    """

    def __init__(self, strategy: "DDPStrategy") -> None:
        self.strategy = strategy
        self.in_use = self.configured  # the setting of DDP's current wrapper
        self.result: BucketTuningResult | None = None  # what the last fit settled on; None until its first batch
        self.restored: BucketTuningResult | None = None  # from the checkpoint the next fit resumes
        self.fit: _FitTuning | None = None
        # nothing left to tune in this fit (decided at its first optimizer step): the strategy stops calling
        self.settled = False

    @property
    def configured(self) -> Trial:
        """The setting every fit starts from: the size given by number (``None``: torch's default), the fixed hook."""
        size = self.strategy.bucket_cap_mb
        return Trial(None if size in (None, "auto") else size, self.fixed_comm_hook)

    @property
    def fixed_comm_hook(self) -> str | None:
        """The hook named by ``comm_hook`` (``None`` for ``"auto"``, which starts from no hook)."""
        comm_hook = self.strategy.comm_hook
        return None if comm_hook == "auto" else comm_hook

    @property
    def active_comm_hook(self) -> str | None:
        """The comm hook on DDP's current wrapper: the fixed one, or ``comm_hook="auto"``'s trial or choice."""
        return self.in_use.comm_hook

    @property
    def owner(self) -> str:
        """The strategy's class name, for log lines."""
        return type(self.strategy).__name__

    def setup(self, trainer: "pl.Trainer") -> None:
        """Start each fit from the configured setting, or from a checkpoint's tuned one; before DDP wraps the model."""
        self.fit, self.settled = None, False
        restored, self.restored = self.restored, None
        if not (self.strategy.tunes_buckets and trainer.state.fn == TrainerFn.FITTING):
            return
        # a fit starts from the configured setting, whatever trial an earlier fit on this strategy stopped in
        self.result = None
        self._use(self.configured)
        if restored is not None:
            self._apply_restored(restored)  # DDP then wraps once, with this

    def on_train_batch_start(self) -> None:
        """Start tuning at the fit's first optimizer step, then advance the tuner once per optimizer step.

        Once nothing is left to tune in the fit, :attr:`settled` says so and the strategy calls no more.
        """
        if not self.strategy.tunes_buckets or (self.result is not None and self.fit is None):
            self.settled = True
            return
        trainer = self.strategy.lightning_module.trainer
        if self.fit is None:
            tuner = self._start(trainer)
            if tuner is None:
                return
            self.fit = _FitTuning(tuner, trainer.global_step)
        elif trainer.global_step == self.fit.step:
            return  # the same optimizer step, accumulating
        else:
            self.fit.step = trainer.global_step
        self._step_started(trainer, self.fit)

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Put a tuned result in ``checkpoint``; a skipped tuning is decided again on resume."""
        if self.result is not None and self.result.tuned:
            checkpoint[BUCKET_TUNING_CHECKPOINT_KEY] = self.result.state_dict()

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Keep ``checkpoint``'s tuned result for the next fit's :meth:`setup`."""
        state = checkpoint.get(BUCKET_TUNING_CHECKPOINT_KEY)
        self.restored = BucketTuningResult.restored(state) if isinstance(state, dict) else None

    def teardown(self) -> None:
        """Forget the fit's tuning: it holds for one fit."""
        self.fit = None

    def _apply_restored(self, restored: BucketTuningResult) -> None:
        strategy, configured = self.strategy, self.configured
        auto_size, auto_hook = strategy.bucket_cap_mb == "auto", strategy.comm_hook == "auto"
        matches = (
            restored.world_size == strategy.world_size
            and (auto_hook or restored.comm_hook == configured.comm_hook)
            and (auto_size or restored.bucket_cap_mb == configured.bucket_cap_mb)
        )
        if not matches:
            rank_zero_info(
                f"{self.owner}: the checkpoint's tuned DDP setting ({restored.world_size} processes, "
                f"{Trial(restored.bucket_cap_mb, restored.comm_hook).label}) was not taken with this run's processes "
                "and fixed settings; tuning again."
            )
            return
        self._use(
            Trial(
                restored.bucket_cap_mb if auto_size else configured.bucket_cap_mb,
                restored.comm_hook if auto_hook else configured.comm_hook,
            )
        )
        self.result = restored
        rank_zero_info(f"{self.owner}: tuned DDP setting {restored.summary()}.")

    def _skip_reason(self, trainer: "pl.Trainer", bucket_sizes: list[float | None]) -> str | None:
        strategy = self.strategy
        untimed = strategy.step_service.untimed_buckets  # a callback reduces gradients outside DDP's buckets
        if untimed is not None:
            return untimed
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(strategy.model, DistributedDataParallel):
            return "not fitting with DDP"
        # torch registers hooks of its own at every wrap with these and never removes them: each trial would keep the
        # old wrapper (and its buckets) alive, and add its work (an all-reduce, a parameter copy) to every step
        if compat.ddp_delayed_params(strategy.model):
            return "delay_all_reduce_named_params adds DDP's own all-reduce again at each re-wrap"
        if getattr(strategy.model, "mixed_precision", None) is not None:
            return "DDP's mixed_precision adds its own parameter-copy hooks again at each re-wrap"
        if strategy.comm_hook == "powersgd":
            return "comm_hook='powersgd' keeps error feedback per bucket, which a re-wrap would lose"
        if compat.lightning_comm_state(strategy):
            return "a ddp_comm_hook, ddp_comm_state or model averaging set through Lightning keeps state per bucket"
        if strategy.world_size < 2:
            return "one process: no gradients are communicated"
        steps_left = trainer.estimated_stepping_batches - trainer.global_step
        if steps_left < PAYBACK_FACTOR * strategy.bucket_tuning_steps:
            return (
                f"the fit has {steps_left:g} optimizer steps left, fewer than {PAYBACK_FACTOR} x "
                f"bucket_tuning_steps ({strategy.bucket_tuning_steps}) needed to pay tuning back"
            )
        if len(bucket_sizes) == 1 and not (strategy.comm_hook == "auto" and strategy.comm_hook_candidates):
            return "one bucket holds every gradient whatever the size: nothing to choose"
        return None

    def _start(self, trainer: "pl.Trainer") -> BucketTuner | None:
        """Decide at the fit's first optimizer step whether to tune: the tuner, or ``None`` with the reason kept."""
        strategy = self.strategy
        if strategy.bucket_cap_mb == "auto":
            trainable = (p for p in strategy.lightning_module.parameters() if p.requires_grad)
            bucket_sizes = bucket_candidates(sum(p.numel() * p.element_size() for p in trainable) / 2**20)
        else:
            bucket_sizes = [self.in_use.bucket_cap_mb]
        hooks = list(strategy.comm_hook_candidates) if strategy.comm_hook == "auto" else []
        reason = self._skip_reason(trainer, bucket_sizes)
        if strategy.world_size > 1:
            # ranks may see different loader lengths: rank 0's view decides, or some ranks would tune alone
            reason, bucket_sizes = strategy.broadcast((reason, bucket_sizes), src=0)
        if reason is not None:
            self.result = BucketTuningResult(
                self.in_use.bucket_cap_mb, self.in_use.comm_hook, reason, world_size=strategy.world_size
            )
            rank_zero_info(f"{self.owner}: bucket tuning {self.result.summary()}.")
            return None
        steps, world_size = strategy.bucket_tuning_steps, strategy.world_size
        tuner = BucketTuner(bucket_sizes, hooks, self.fixed_comm_hook, steps, world_size)
        if tuner.current != self.in_use:
            self._rewrap(tuner.current)
        return tuner

    def _step_started(self, trainer: "pl.Trainer", fit: _FitTuning) -> None:
        strategy, tuner = self.strategy, fit.tuner
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)  # time the GPU's work, not how fast the host queued it
        now = time.perf_counter()
        # a step that also ran validation or ended an epoch is not timed
        marker = (trainer.current_epoch, trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed)
        discard, fit.marker = marker != fit.marker, marker
        switch = tuner.step_started(now, discard=discard)
        if tuner.needs_decision:
            # rank 0's timings decide on every rank: one broadcast, at the same step everywhere
            switch = tuner.decide(strategy.broadcast(tuner.timings(), src=0), now)
        if switch is not None:
            self._rewrap(switch)
        if tuner.result is not None:
            self.fit, self.result = None, tuner.result
            self._log(trainer, tuner.result)

    def _rewrap(self, trial: Trial) -> None:
        strategy = self.strategy
        assert isinstance(strategy.model, DistributedDataParallel)
        module = strategy.model.module
        strategy.model = module  # the old wrapper's buckets are freed before the new ones are allocated
        kept_kwargs, kept_trial = compat.ddp_kwargs(strategy), self.in_use
        # the parameters are equal on every rank already
        compat.set_ddp_kwargs(strategy, dict(kept_kwargs, init_sync=False))
        self._use(trial)
        try:
            strategy.model = compat.wrap_in_ddp(strategy, module)
        except BaseException:
            compat.set_ddp_kwargs(strategy, kept_kwargs)  # the fit is failing: leave the settings as they were
            self.in_use = kept_trial
            raise
        # later wraps (the next fit's) get the user's init_sync back, or torch's default
        kwargs = compat.ddp_kwargs(strategy)
        kwargs.pop("init_sync")
        if "init_sync" in kept_kwargs:
            kwargs["init_sync"] = kept_kwargs["init_sync"]
        compat.register_ddp_hooks(strategy)  # registers in_use's comm hook
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)  # gradients copied into the new buckets on the wrap's stream

    def _use(self, trial: Trial) -> None:
        """Make ``trial`` the setting the next wrap of DDP is built with: the one place the bucket size is written."""
        self.in_use = trial
        kwargs = compat.ddp_kwargs(self.strategy)
        if trial.bucket_cap_mb is None:
            kwargs.pop("bucket_cap_mb", None)
        else:
            kwargs["bucket_cap_mb"] = trial.bucket_cap_mb

    def _log(self, trainer: "pl.Trainer", result: BucketTuningResult) -> None:
        rank_zero_info(f"{self.owner}: bucket tuning {result.summary()}.")
        metrics = {
            "ddp/bucket_cap_mb": result.effective_bucket_cap_mb,
            "ddp/bucket_tuning_seconds": result.tuning_seconds,
            "ddp/bucket_tuning_speedup": result.speedup or 1.0,
        }
        if compat.ddp_kwargs(self.strategy).get("bucket_cap_mb_list"):
            del metrics["ddp/bucket_cap_mb"]  # DDP's own list of sizes applies, not one size
        metrics.update({f"ddp/bucket_trial_ms/{label}": ms for label, ms in result.step_ms.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
