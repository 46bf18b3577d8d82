"""The strategies' side of the hang watchdog: one :class:`HangWatchdog` per rank for a fit, fed from strategy hooks.

The strategy calls :meth:`FitHangWatch.on_train_batch_start` when a training batch starts and marks the phase on the
:attr:`FitHangWatch.beating` watchdog from the hooks every batch passes through (``training_step``, ``backward``,
``validation_step``): plain attribute writes, no collective, no host sync, and no look-up of the trainer after the
batch's start. Progress is counted in training batches over the whole training: Lightning's
``batch_progress.total.ready`` at the fit's first batch (restored on resume), then one more at every batch start the
strategy sees (a batch the loader yields as ``None`` is counted by Lightning and not here), so ranks compare alike
under gradient accumulation and after validation. The watchdog thread is started at
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

from lightning_mgpu.core import compat
from lightning_mgpu.core.options import DDP, FSDP, MGPU, Option, positive
from lightning_mgpu.long_runs.hang_watchdog import HangWatchdog

log = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT = 600.0  # seconds: longer than any healthy step, checkpoint or validation batch of a real job

# the strategies' option (see lightning_mgpu.core.options)
HANG_TIMEOUT = Option(
    "hang_timeout",
    float | None,
    DEFAULT_HANG_TIMEOUT,
    "seconds a rank's training may make no progress before every rank writes `<log_dir>/hang_report_rank<r>.txt` "
    "(the stuck ranks, every rank's stack) and exits with status 124; `None` turns the watchdog off. It runs in fits "
    "of several processes, from the second training batch.",
    (DDP, FSDP, MGPU),
    positive("seconds", hint="None turns it off"),
)


class FitHangWatch:
    """Run a :class:`HangWatchdog` on every rank for the length of one fit.

    Args:
        timeout: ``hang_timeout`` in seconds; ``None`` turns the watchdog off.
    """

    _fits = 0  # per-process count of watched fits: identical on all ranks, so it names a fresh store prefix

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.watchdog: HangWatchdog | None = None
        # the watchdog once training batches beat (from the second on), for the strategy's hooks to mark phases in
        self.beating: HangWatchdog | None = None
        self._trainer: pl.Trainer | None = None  # the fit's, while a watchdog runs
        self._batches = 0
        self._first_batch = 0  # Lightning's count of training batches at the fit's first

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
        self._trainer = trainer
        self._batches = 0

    def on_train_batch_start(self) -> None:
        """Start the thread at the first training batch; from the second on, beat with the batch's number."""
        watchdog = self.watchdog
        if watchdog is None:
            return
        self._batches += 1
        if self._batches == 1:
            self._first_batch = _batch(self._trainer)
            watchdog.start()
        else:  # counted from the first: one training batch more at every start, as Lightning's count
            watchdog.beat(self._first_batch + self._batches - 1, "batch_start")
            self.beating = watchdog

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
        self.beating = None
        self._trainer = None


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

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._hang_watch.on_train_batch_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if (watchdog := self._hang_watch.beating) is not None:
            watchdog.mark("forward")
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (watchdog := self._hang_watch.beating) is not None:
            watchdog.mark("backward")
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if (watchdog := self._hang_watch.beating) is not None:
            watchdog.mark("validation")
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
