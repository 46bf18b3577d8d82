"""NaNSkip's ``spike_action="rollback"``: snapshots in host memory, and every rank put back after a bad step."""

import functools
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_mgpu.stability.nan_skip_config import NaNSkipConfig
from lightning_mgpu.stability.skip_tally import SkipTally
from lightning_mgpu.stability.training_snapshot import TrainingSnapshot


class RollbackLimitError(RuntimeError):
    """Raised by :class:`NaNSkip` on every rank when a bad step would exceed ``max_rollbacks``."""


class SpikeRollback:
    """One fit's rollbacks: a snapshot every ``snapshot_every`` optimizer steps, put back at a bad step's batch end.

    The snapshot (:class:`~lightning_mgpu.stability.training_snapshot.TrainingSnapshot`) holds the module, the
    optimizers, the LR schedulers, the GradScaler, NaNSkip's spike windows and the statistics of the pack's other
    callbacks that keep some (a ``_rollback_state``/``_load_rollback_state`` pair). The verdict is the same on every
    rank, so every rank rolls back together.

    Args:
        owner: the callback's class name, for messages.
        config: the callback's options (``snapshot_every``, ``max_rollbacks``).
        tally: the rollback count, the event log, and the spike windows a rollback puts back.
        trainer: the trainer whose fit starts, its module built.
    """

    def __init__(self, owner: str, config: NaNSkipConfig, tally: SkipTally, trainer: "pl.Trainer") -> None:
        self.owner = owner
        self.config = config
        self.tally = tally
        self.due: int | None = None  # the global step of a bad step, until its batch ends
        self.stepped = False  # an optimizer step ran in this batch
        self._memory_reported = False
        self.snapshot = TrainingSnapshot(
            trainer.lightning_module,
            trainer.optimizers,
            [scheduler.scheduler for scheduler in trainer.lr_scheduler_configs],
            getattr(trainer.precision_plugin, "scaler", None),
            extra=functools.partial(self._state_to_roll_back, trainer),
            restore_extra=functools.partial(self._roll_state_back, trainer),
        )

    def start_batch(self, trainer: "pl.Trainer") -> None:
        """The first snapshot, once the strategy's ``on_train_start`` has put back what a checkpoint held per rank."""
        if self.snapshot.step is None:
            self.snapshot.take(trainer.global_step)  # read only here: the property costs a few calls a batch

    def step_done(self, step: int, bad: Tensor) -> None:
        """After an optimizer step's verdict: a bad one rolls back at its batch's end (one host read)."""
        self.stepped = True
        if self.due is None and bool(bad):
            self.due = step

    def end_batch(self, trainer: "pl.Trainer") -> None:
        """At a batch's end (its optimizer and LR-scheduler steps done): roll back after a bad step, else snapshot."""
        snapshot = self.snapshot
        stepped, self.stepped = self.stepped, False
        if self.due is not None:
            bad_step, self.due = self.due, None
            self._roll_back(bad_step)
            return
        if not stepped:  # a micro-batch of gradient accumulation: the step is not done
            return
        last = snapshot.step if snapshot.step is not None else trainer.global_step
        # a new snapshot every snapshot_every steps, or at once where the optimizers' parameters changed since
        if trainer.global_step - last >= self.config.snapshot_every or not snapshot.matches():
            snapshot.take(trainer.global_step)
            if not self._memory_reported:  # now that the optimizer states exist
                self._memory_reported = True
                rank_zero_info(
                    f"{self.owner}: rollback snapshots every {self.config.snapshot_every} optimizer steps hold "
                    f"{snapshot.nbytes / 2**20:.1f} MB of host memory per process."
                )

    def _roll_back(self, bad_step: int) -> None:
        tally, limit = self.tally, self.config.max_rollbacks
        if limit is not None and tally.rollbacks >= limit:
            raise RollbackLimitError(
                f"{self.owner}: the bad optimizer step {bad_step + 1} would be rollback number "
                f"{tally.rollbacks + 1}, over max_rollbacks={limit}. Training keeps going bad: lower the "
                "learning rate, look at the data around these steps, or raise max_rollbacks."
            )
        tally.rollbacks += 1
        saved = self.snapshot.restore()
        dropped = f"steps {saved + 1}-{bad_step + 1}" if bad_step > saved else f"step {bad_step + 1}"
        tally.events.record(bad_step, "rollback", f"to step {saved}: {dropped} dropped")
        rank_zero_info(
            f"{self.owner}: optimizer step {bad_step + 1} was bad: rolled back to the state after step "
            f"{saved}, dropping {dropped}; {tally.rollbacks} rollback(s) so far"
            + (f" of at most {limit}." if limit is not None else ".")
        )

    def _state_to_roll_back(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """The statistics a rollback puts back: the spike windows, and the other pack callbacks' (deep-copied)."""
        others = [cb._rollback_state() for cb in trainer.callbacks if hasattr(cb, "_load_rollback_state")]
        return {"windows": (self.tally.loss_window, self.tally.norm_windows), "others": others}

    def _roll_state_back(self, trainer: "pl.Trainer", state: dict[str, Any]) -> None:
        self.tally.loss_window, self.tally.norm_windows = state["windows"]
        callbacks = [cb for cb in trainer.callbacks if hasattr(cb, "_load_rollback_state")]
        for callback, saved in zip(callbacks, state["others"], strict=True):
            callback._load_rollback_state(saved)
