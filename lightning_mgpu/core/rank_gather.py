"""One all-gather per logging step, shared by every monitor of a run, on a host-side group."""

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

RANK_STATISTICS: tuple[str, ...] = ("max_rank", "min", "mean", "max")


class RankGather:
    """Gathers the numbers of several monitors from every rank in one ``all_gather`` per logging step.

    Each monitor registers a provider, a function returning its float vector (the same length on every rank).
    At a logging step the first monitor to ask triggers the gather of every provider's vector, concatenated; the
    others read their columns from it. Every rank must ask at the same steps (the monitors follow Lightning's
    ``log_every_n_steps``), so each rank makes exactly one collective per such step however many monitors run.

    Obtain it from the fit's :meth:`~lightning_mgpu.core.step_service.StepService.join_rank_gather`; it lives
    while a monitor is registered.

    Args:
        world_size: the number of processes.
        group: the process group to gather on (``None`` for the default group).
        device: where the gathered tensors live (the host, unless no gloo side group could be made).
    """

    def __init__(self, world_size: int, group: Any, device: torch.device) -> None:
        self.world_size = world_size
        self.group = group
        self.device = device
        self._providers: dict[int, Callable[[], torch.Tensor]] = {}
        self._key: Hashable = None
        self._columns: dict[int, torch.Tensor] = {}

    def register(self, owner: object, provide: Callable[[], torch.Tensor]) -> None:
        """Add ``owner``'s provider; its vector joins every later logging step's gather."""
        self._providers[id(owner)] = provide

    def unregister(self, owner: object) -> bool:
        """Drop ``owner``'s provider; returns whether none is left."""
        self._providers.pop(id(owner), None)
        self._columns.pop(id(owner), None)
        return not self._providers

    def gather(self, owner: object, key: Hashable) -> torch.Tensor:
        """``owner``'s vectors from every rank, ``[world_size, n]`` on the host, for the logging step ``key``."""
        if key != self._key or id(owner) not in self._columns:
            owners = list(self._providers)
            vectors = [self._providers[o]().double().flatten() for o in owners]
            gathered = self.gather_now(torch.cat(vectors))
            self._columns, start = {}, 0
            for o, vector in zip(owners, vectors, strict=True):
                self._columns[o] = gathered[:, start : start + vector.numel()]
                start += vector.numel()
            self._key = key
        return self._columns[id(owner)]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; for set-up, not for the training loop."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def gather_now(self, vector: torch.Tensor) -> torch.Tensor:
        """One all-gather of ``vector`` (the same length on every rank) outside the shared logging steps."""
        local = vector.to(self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).cpu()


def summarize_across_ranks(gathered: torch.Tensor, keys: list[str]) -> dict[str, float]:
    """Min, mean, max and the rank holding the max of each key, over a ``[world_size, len(keys)]`` matrix.

    NaN entries (a value a rank could not read) are left out; a key no rank could read is left out entirely.
    """
    metrics: dict[str, float] = {}
    for column, key in enumerate(keys):
        values = gathered[:, column]
        known = ~torch.isnan(values)
        if not bool(known.any()):
            continue
        present = values[known]
        metrics[f"{key}_min"] = float(present.min())
        metrics[f"{key}_mean"] = float(present.mean())
        metrics[f"{key}_max"] = float(present.max())
        metrics[f"{key}_max_rank"] = float(int(torch.where(known, values, -math.inf).argmax()))
    return metrics
