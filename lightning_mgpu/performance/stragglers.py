"""Tell a straggler from the others: a rank whose own work per step stays above the other ranks' median."""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    """A rank flagged by :class:`StragglerWatch`: its figure and the other ranks' median, over the last window."""

    rank: int
    value: float
    others_median: float
    windows: int


class StragglerWatch:
    """Flags a rank whose figure exceeds the other ranks' median by ``margin`` for ``windows`` windows in a row.

    Under DDP every rank's step takes as long as the slowest one's, so the figure to compare is the time each rank
    was busy (its step time less the communication it waited for after its own backward had finished): a straggler
    is busy all step, the others wait for it. A rank is flagged once; it can be flagged again after a window in which
    it was not slow. A window without the rank's figure (NaN) leaves its run of slow windows as it was.

    Args:
        margin: how far above the others' median counts as slow (0.2: 20% above).
        windows: consecutive slow windows before a rank is flagged.
    """

    def __init__(self, margin: float, windows: int) -> None:
        self.margin = margin
        self.windows = windows
        self._slow: dict[int, int] = {}

    def update(self, values: Sequence[float]) -> list[Straggler]:
        """Take one window's figure per rank (NaN: unknown); return the ranks flagged by it."""
        flagged = []
        for rank, value in enumerate(values):
            others = [v for r, v in enumerate(values) if r != rank and not math.isnan(v)]
            if math.isnan(value) or not others:
                continue  # a window without the figure (device times not read yet) neither breaks nor extends a run
            median = statistics.median(others)
            slow = value > median * (1.0 + self.margin)
            count = self._slow.get(rank, 0) + 1 if slow else 0
            self._slow[rank] = count
            if count == self.windows:
                flagged.append(Straggler(rank, value, median, count))
        return flagged
