"""The strategies' side of the hang watchdog: one :class:`HangWatchdog` per rank for a fit, fed from strategy hooks.

The strategy calls :meth:`FitHangWatch.beat` from the hooks every training batch passes through (batch start,
``training_step``, ``backward``, ``validation_step``): plain attribute writes, no collective and no host sync. Progress
is counted in training batches over the whole training (Lightning's ``batch_progress.total.ready``, restored on
resume), so ranks compare alike under gradient accumulation and after validation. The watchdog thread is started at
the first training batch and the first beat comes with the second, so a first step that compiles or tunes for longer
than ``hang_timeout`` is never taken for a hang. Checkpoint saves and barriers pause it on the ranks inside them, and
no rank declares a hang while another is paused (rank 0 writing a checkpoint holds the others in a barrier).
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_mgpu import compat
from lightning_mgpu.utilities.hang_watchdog import HangWatchdog

log = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT = 600.0  # seconds: longer than any healthy step, checkpoint or validation batch of a real job


class FitHangWatch:
    """Run a :class:`HangWatchdog` on every rank for the length of one fit.

    Args:
        timeout: ``hang_timeout`` in seconds; ``None`` turns the watchdog off.
    """

    _fits = 0  # per-process count of watched fits: identical on all ranks, so it names a fresh store prefix

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.watchdog: HangWatchdog | None = None
        self._batches = 0

    def setup(self, trainer: "pl.Trainer") -> None:
        """Build this rank's watchdog for a fit of several processes (it starts at the first training batch)."""
        self.stop()
        if self.timeout is None or trainer.state.fn != TrainerFn.FITTING or trainer.world_size <= 1:
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        FitHangWatch._fits += 1
        store = dist.PrefixStore(f"lightning_mgpu/hang/{FitHangWatch._fits}/", compat.default_store())
        self.watchdog = HangWatchdog(
            store, trainer.global_rank, trainer.world_size, self.timeout, report_dir=_report_dir(trainer)
        )
        self._batches = 0

    def on_train_batch_start(self, trainer: "pl.Trainer") -> None:
        """Start the thread at the first training batch; from the second on, beat."""
        watchdog = self.watchdog
        if watchdog is None:
            return
        self._batches += 1
        if self._batches == 1:
            watchdog.start()
        else:
            watchdog.beat(_batch(trainer), "batch_start")

    def beat(self, trainer: "pl.Trainer | None", phase: str) -> None:
        """Record progress in ``phase`` of the training batch in progress (a validation: of the last one)."""
        watchdog = self.watchdog
        if watchdog is not None and self._batches > 1 and trainer is not None:
            watchdog.beat(_batch(trainer), phase)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Declare no hang from this rank while the body runs (a checkpoint being written)."""
        watchdog = self.watchdog
        if watchdog is None:
            yield
            return
        watchdog.pause()
        try:
            yield
        finally:
            watchdog.resume()

    def stop(self) -> None:
        """Stop the thread (the fit left its training loop, or the strategy is torn down)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None


def _batch(trainer: "pl.Trainer") -> int:
    # the training batches started over the whole training, resumed fits included: the optimizer step in progress
    # when accumulate_grad_batches is 1
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready


def _report_dir(trainer: "pl.Trainer") -> Path:
    return Path(trainer.log_dir or trainer.default_root_dir)


class HangWatchHooks(Strategy):
    """The strategy hooks that feed a :class:`FitHangWatch`, for a strategy class to list before its Lightning base.

    The strategy builds ``self._hang_watch`` in its ``__init__``, calls :meth:`FitHangWatch.setup` at the end of its
    ``setup`` and wraps its checkpoint writing in :meth:`FitHangWatch.paused`.
    """

    _hang_watch: FitHangWatch

    @property
    def _watched_trainer(self) -> "pl.Trainer | None":
        module = self.lightning_module
        return module.trainer if module is not None else None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if (trainer := self._watched_trainer) is not None:
            self._hang_watch.on_train_batch_start(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._hang_watch.beat(self._watched_trainer, "forward")
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._hang_watch.beat(self._watched_trainer, "backward")
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._hang_watch.beat(self._watched_trainer, "validation")
        return super().validation_step(*args, **kwargs)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._hang_watch.paused():  # e.g. the other ranks waiting while rank 0 writes a checkpoint
            super().barrier(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self._hang_watch.stop()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._hang_watch.stop()
        super().teardown()
