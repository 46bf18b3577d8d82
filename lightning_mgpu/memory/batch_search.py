"""Search for the largest micro-batch that fits, keeping the batch per optimizer step by gradient accumulation.

Pure: the caller gives a ``try_size(size) -> bool`` (does one training step of this size fit here?) and an
``agree(fits) -> bool`` (does it fit on every rank?), so that every rank walks the same sizes and stops at the same one.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


class BatchSizeSearchError(RuntimeError):
    """Not even the smallest micro-batch fits."""


@dataclass(frozen=True)
class SearchResult:
    """The micro-batch chosen, the accumulation factor that keeps the batch, and every trial as ``(size, fits)``."""

    size: int
    accumulation: int
    trials: list[tuple[int, bool]] = field(default_factory=list)


def next_size(batch_size: int, failed: int, min_size: int = 1) -> int | None:
    """The largest divisor of ``batch_size`` at most half of ``failed`` and at least ``min_size``; ``None`` if none.

    Example::

        >>> next_size(24, 24), next_size(24, 12), next_size(24, 6), next_size(24, 3)
        (12, 6, 3, 1)
    """
    for size in range(failed // 2, min_size - 1, -1):
        if size >= 1 and batch_size % size == 0:
            return size
    return None


def search_micro_batch(
    batch_size: int, try_size: Callable[[int], bool], agree: Callable[[bool], bool], min_size: int = 1
) -> SearchResult:
    """Try ``batch_size``, then ever smaller divisors of it (about halving), until one fits on every rank.

    Args:
        batch_size: the configured batch per device and step (the first size tried).
        try_size: runs one trial of a micro-batch size on this rank; ``True`` if it fit.
        agree: combines this rank's answer with every other rank's (``True`` only if all fit).
        min_size: the smallest micro-batch worth trying.

    Raises:
        BatchSizeSearchError: ``min_size`` (or the smallest divisor above it) does not fit either.

    Example::

        >>> search_micro_batch(32, lambda size: size <= 10, lambda fits: fits)
        SearchResult(size=8, accumulation=4, trials=[(32, False), (16, False), (8, True)])
    """
    trials: list[tuple[int, bool]] = []
    size: int | None = batch_size
    while size is not None:
        fits = agree(try_size(size))
        trials.append((size, fits))
        if fits:
            return SearchResult(size, batch_size // size, trials)
        size = next_size(batch_size, size, min_size)
    tried = ", ".join(str(size) for size, _ in trials)
    raise BatchSizeSearchError(
        f"no micro-batch of the per-device batch {batch_size} fits on every rank (tried {tried}, min_size={min_size})"
    )
