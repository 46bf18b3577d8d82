"""Loss and gradient-norm spikes: a z-score test against a rolling window kept on the device, with no host read."""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.core.validation import check_int, check_positive


class SpikeWindow:
    """The last ``size`` accepted values of one or more series (a row each), and a z-score spike test against them.

    A value is a spike when it is more than ``zscore`` standard deviations (of the window, unbiased) above the
    window's mean, once the window holds ``warmup`` values. Only values :meth:`update` accepts enter the window: the
    caller leaves out skipped steps, and a non-finite value never enters. The rows share one count, so they stay
    aligned step by step. Everything stays on the device; nothing here reads a value on the host. The window keeps
    running float64 sums of its values and their squares (updated with the value that enters and the one that
    leaves), so a test and an update take about a dozen small device operations each, whatever ``size``.

    Args:
        rows: how many series.
        size: the window's length, in accepted values.
        zscore: standard deviations above the mean that make a spike.
        warmup: accepted values needed before any spike is flagged; ``None`` for ``max(20, size // 2)`` (capped at
            ``size``), as OLMo-core does.

    Raises:
        TypeError: a ``rows``, ``size`` or ``warmup`` that is not an int, or a ``zscore`` that is not a number.
        ValueError: any of them below its minimum, or a ``warmup`` above ``size``.

    Example::

        >>> window = SpikeWindow(rows=1, size=4, zscore=3.0, warmup=3)
        >>> for loss in (1.0, 1.1, 0.9):
        ...     window.update(torch.tensor([loss]), torch.tensor(True))
        >>> window.is_spike(torch.tensor([1.05])), window.is_spike(torch.tensor([9.0]))
        (tensor([False]), tensor([True]))
    """

    def __init__(self, rows: int, size: int, zscore: float, warmup: int | None = None) -> None:
        owner = type(self).__name__
        check_int(owner, "rows", rows, minimum=1)
        check_int(owner, "size", size, minimum=2)
        check_positive(owner, "zscore", zscore)
        warmup = min(max(20, size // 2), size) if warmup is None else warmup
        check_int(owner, "warmup", warmup, minimum=2, maximum=size)
        self.rows = rows
        self.size = size
        self.zscore = float(zscore)
        self.warmup = warmup
        self._reset(torch.device("cpu"))

    def _reset(self, device: torch.device) -> None:
        self.values = torch.zeros(self.rows, self.size, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self.next = torch.zeros((), dtype=torch.long, device=device)
        self._sums = torch.zeros(2, self.rows, dtype=torch.float64, device=device)  # sum of values, of squares

    def to(self, device: torch.device) -> None:
        """Keep the window on ``device``; a no-op where it is already."""
        if self.values.device != device:
            self.values, self.count, self.next = (
                _to(self.values, device),
                _to(self.count, device),
                _to(self.next, device),
            )
            self._sums = _to(self._sums, device)

    def statistics(self) -> tuple[Tensor, Tensor]:
        """Each row's mean and unbiased standard deviation over the values held (zeros while none are)."""
        count = self.count.clamp(min=1).to(torch.float64)
        mean = self._sums[0] / count
        var = (self._sums[1] - count * mean * mean).clamp(min=0) / (count - 1).clamp(min=1)
        return mean, var.sqrt()

    def is_spike(self, value: Tensor) -> Tensor:
        """Per row, whether ``value`` (one per row) is a spike; ``False`` for a non-finite value and during warm-up."""
        self.to(value.device)
        value = value.to(torch.float64)
        mean, std = self.statistics()
        # a floor on the spread: a window of equal values must not flag the next value's rounding noise
        std = torch.maximum(std, 1e-6 * mean.abs() + 1e-12)
        return (self.count >= self.warmup) & torch.isfinite(value) & (value > mean + self.zscore * std)

    def update(self, value: Tensor, accept: Tensor) -> None:
        """Append ``value`` (one per row) where ``accept`` is true and every row's value is finite."""
        self.to(value.device)
        value = value.to(torch.float64).view(-1, 1)
        accept = accept & torch.isfinite(value).all()
        position = self.next.view(1, 1).expand(self.rows, 1)
        leaving = self.values.gather(1, position)  # 0 while the window is not full
        entering = torch.where(accept, value, leaving)
        # out of place: a window pickled into ddp_spawn workers holds tensors in memory the processes share
        self.values = self.values.scatter(1, position, entering)
        self._sums = self._sums + torch.stack((entering - leaving, entering * entering - leaving * leaving)).view(
            2, self.rows
        )
        self.next = torch.where(accept, (self.next + 1) % self.size, self.next)
        self.count = torch.where(accept, (self.count + 1).clamp(max=self.size), self.count)

    def update_many(self, values: Sequence[Tensor], accept: Tensor) -> None:
        """Append several values per row (micro-batches of one step), in order, where ``accept`` is true."""
        for value in values:
            self.update(value, accept)

    def state_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint (reads the device once, at checkpoint time)."""
        return {"values": self.values.cpu().tolist(), "count": int(self.count), "next": int(self.next)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; a window of another shape starts empty."""
        device = self.values.device
        values = torch.tensor(state.get("values", []), dtype=torch.float64)
        self._reset(device)
        if values.shape != (self.rows, self.size):
            return
        self.values = values.to(device)
        self.count = torch.tensor(int(state.get("count", 0)), dtype=torch.long, device=device)
        self.next = torch.tensor(int(state.get("next", 0)), dtype=torch.long, device=device)
        self._sums = torch.stack((self.values.sum(dim=1), (self.values * self.values).sum(dim=1)))


def _to(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``; from the host to a GPU through pinned memory, so that the copy does not synchronise."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
