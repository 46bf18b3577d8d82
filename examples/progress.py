"""One line per epoch instead of Lightning's tqdm bar when the output is not a terminal.

A tqdm bar redraws itself with carriage returns; written to a file, a pipe or a CI log, every redraw stays, and one
run of the main example leaves 37-114 KB of them. ``EpochLines`` prints one line per training epoch on rank 0
instead, with the same fields the bar would show (the loss, ``val_acc``, and the pack's ``skipped``, ``grad_norm``,
``peak_mem_mb`` and ``micro_bs``):

    epoch 0: step 29, train_loss 0.412, val_acc 0.951, skipped 1, micro_bs 32, peak_mem_mb 431 (4.1 s)
"""

import sys
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ProgressBar
from typing_extensions import override


class EpochLines(ProgressBar):
    """A Lightning progress bar that prints one line at the end of each training epoch, on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._epoch_started = 0.0

    @override
    def disable(self) -> None:
        self._enabled = False  # Lightning disables every rank but 0, and the bar while tuners run

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_started = time.perf_counter()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled:
            return
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        fields = "".join(f", {name} {_number(value)}" for name, value in metrics.items())
        seconds = time.perf_counter() - self._epoch_started
        self.print(f"epoch {trainer.current_epoch}: step {trainer.global_step}{fields} ({seconds:.1f} s)", flush=True)


def _number(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.3g}"
    return str(value)


def progress_callbacks() -> list[Callback]:
    """``[EpochLines()]`` when standard output is not a terminal, else ``[]`` (Lightning's tqdm bar)."""
    return [] if sys.stdout.isatty() else [EpochLines()]
