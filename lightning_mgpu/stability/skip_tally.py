"""What NaNSkip keeps for the whole run: its counters, spike windows and events, saved in checkpoints."""

from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.core.training_events import EventLog
from lightning_mgpu.stability.nan_skip_config import NaNSkipConfig
from lightning_mgpu.stability.spike_window import SpikeWindow


class SkipTally:
    """NaNSkip's counts and spike windows, kept from one fit to the next and through checkpoints.

    Built with the callback, so that a checkpoint can load into it before a fit starts (or after: some strategies
    restore callbacks once their setup is done). The counters are device tensors, counted with no host read; a
    checkpoint reads them. The loss window is each rank's own (:meth:`rank_state`); the gradient-norm windows, one per
    optimizer in ``trainer.optimizers``' order, are the same on every rank.

    Args:
        config: the callback's options (which windows exist, their size and threshold).
    """

    def __init__(self, config: NaNSkipConfig) -> None:
        self.config = config
        self.skipped = torch.zeros((), dtype=torch.long)
        self.consecutive = torch.zeros((), dtype=torch.long)
        self.spiked = torch.zeros((), dtype=torch.long)
        self.optimizer_steps = 0
        self.rollbacks = 0
        self.reported = 0  # skipped steps already reported, a host-side count
        self.events = EventLog()
        self.loss_window = self._window() if config.loss_spikes else None
        self.norm_windows: list[SpikeWindow] = []

    def _window(self) -> SpikeWindow:
        """A new, empty window (made only where spikes are on, so with a ``spike_zscore``)."""
        return SpikeWindow(rows=1, size=self.config.spike_window, zscore=self.config.spike_zscore)

    def to(self, device: torch.device) -> None:
        """Keep the counters on ``device``, the fit's."""
        self.skipped, self.consecutive, self.spiked = (
            self.skipped.to(device),
            self.consecutive.to(device),
            self.spiked.to(device),
        )

    def count(self, bad: Tensor) -> None:
        """Count an optimizer step, skipped where ``bad`` is true (on the device)."""
        self.skipped = self.skipped + bad.long()
        self.consecutive = torch.where(bad, self.consecutive + 1, 0)
        self.optimizer_steps += 1

    def norm_window(self, index: int) -> SpikeWindow:
        """The gradient-norm window of the ``index``-th optimizer (each optimizer's norms have their own scale)."""
        while len(self.norm_windows) <= index:
            self.norm_windows.append(self._window())
        return self.norm_windows[index]

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks: the loss window."""
        return {"loss_window": self.loss_window.state_dict()} if self.loss_window is not None else {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take this rank's loss window back."""
        if self.loss_window is not None and "loss_window" in state:
            self.loss_window.load_state_dict(state["loss_window"])

    def state_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint (reads the device)."""
        state: dict[str, Any] = {
            "skipped_steps": int(self.skipped),
            "consecutive": int(self.consecutive),
            "optimizer_steps": self.optimizer_steps,
            "spiked_steps": int(self.spiked),
            "rollbacks": self.rollbacks,
        }
        if self.loss_window is not None:
            state["loss_window"] = self.loss_window.state_dict()
        if self.norm_windows:
            state["grad_norm_windows"] = [window.state_dict() for window in self.norm_windows]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; keys an older checkpoint lacks start from zero."""
        self.skipped = torch.tensor(int(state_dict.get("skipped_steps", 0)), device=self.skipped.device)
        self.reported = int(self.skipped)  # reported by the run that saved them
        self.consecutive = torch.tensor(int(state_dict.get("consecutive", 0)), device=self.consecutive.device)
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self.spiked = torch.tensor(int(state_dict.get("spiked_steps", 0)), device=self.spiked.device)
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.load_rank_state(state_dict)
        if self.config.norm_spikes:
            self.norm_windows = []
            for saved in state_dict.get("grad_norm_windows", []):
                window = self._window()
                window.load_state_dict(saved)
                self.norm_windows.append(window)
