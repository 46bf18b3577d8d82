"""Count the Python-level ``torch.distributed`` calls a process makes, by wrapping them (they still run)."""

import functools
from collections.abc import Callable

import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)


def count_collectives(calls: dict[str, int], counting: Callable[[], bool]) -> None:
    """Wrap every collective of ``torch.distributed`` so each call made while ``counting()`` adds 1 to ``calls``."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _counted(name, original, calls, counting))


def _counted(name: str, original: Callable, calls: dict[str, int], counting: Callable[[], bool]) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if counting():
            calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    return wrapper
