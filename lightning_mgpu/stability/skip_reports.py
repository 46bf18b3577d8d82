"""NaNSkip's lines and events about skipped steps, read on the host only where they are read anyway."""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_mgpu.core._logging import show_in_progress_bar
from lightning_mgpu.stability.skip_tally import SkipTally


class SkipLines:
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


class LaggedRead:
    """Reads a CUDA scalar one step late: a non-blocking copy to pinned memory now, read at the next call.

    Waiting on the event of the previous step's copy costs nothing in practice (that work finished long ago) and
    never stalls the current step's kernels.
    """

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._event: Any = None

    def read(self, value: Tensor) -> int:
        """The value given at the previous call (0 at the first), read now; ``value`` is read at the next."""
        previous = 0
        if self._event is not None and self._host is not None:
            self._event.synchronize()
            previous = int(self._host)
        self._host = torch.empty((), dtype=value.dtype, pin_memory=True)
        self._host.copy_(value, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return previous


class SkipReports:
    """The info lines and events of one fit's skipped steps, on rank 0.

    A step skipped after a host read is reported at once (:meth:`skipped`). A step skipped on the device stays
    unread: from the first such step (:attr:`unread_from`) on, the count is reported where it is read anyway, at a
    logging step whose count a logger writes or the progress bar shows (:meth:`unread`), or at the end of training.

    Args:
        owner: the callback's class name, for messages.
        tally: the counters (and how many skips were reported already) and the event log.
    """

    def __init__(self, owner: str, tally: SkipTally) -> None:
        self.owner = owner
        self.tally = tally
        self.lines = SkipLines()
        self.unread_from: int | None = None  # the first step whose skip decision stayed on the device, unread
        self.report_due = False  # the count is read at the end of this batch: report what it says
        self.bar_due = False  # and show it in the progress bar

    def skipped(self, step: int, short: str, cause: str) -> None:
        """A step known on the host to be skipped."""
        tally = self.tally
        before, tally.reported = tally.reported, tally.reported + 1
        tally.events.record(step, "skipped_steps", short)
        suffix = self.lines.due(before, tally.reported)
        if suffix is not None:
            rank_zero_info(
                f"{self.owner}: skipped optimizer step {step}: {cause}; {tally.reported} skipped so far{suffix}."
            )

    def unread(self, trainer: "pl.Trainer", skipped: int) -> None:
        """The device-side skips since :attr:`unread_from`, now that the total ``skipped`` was read."""
        since, self.unread_from = self.unread_from, None
        tally = self.tally
        new = skipped - tally.reported
        if new <= 0:
            return
        before, tally.reported = tally.reported, skipped
        last = trainer.global_step - 1  # the step counter already moved past the last optimizer step
        tally.events.record(last, "skipped_steps", f"{new} in steps {since}-{last}")
        suffix = self.lines.due(before, skipped)
        if suffix is not None:
            steps = "step" if new == 1 else "steps"
            rank_zero_info(
                f"{self.owner}: {new} optimizer {steps} skipped since step {since} (through step {last}; "
                f"skipped on the device, read at logging steps); {skipped} skipped so far{suffix}."
            )

    def read(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", skipped: int) -> None:
        """At the end of a logging step's batch, with the count just read: report it, show it in the bar."""
        if self.report_due:
            self.report_due = False
            self.unread(trainer, skipped)
        if self.bar_due:
            self.bar_due = False
            show_in_progress_bar(pl_module, "skipped", skipped)
