"""Hold back a step's ``self.log`` calls, then log each key once for the whole batch.

A batch run as several micro-batches calls ``training_step`` (or ``validation_step``) once per micro-batch, and
an attempt that ran out of memory may already have logged. Capturing the calls and replaying one value per key,
combined over the micro-batches that counted, keeps the logged value the batch's and never logs twice.
"""

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_SUM = ("sum", torch.sum)
_MAX = ("max", torch.max)
_MIN = ("min", torch.min)


class LoggedCall:
    """One ``self.log`` call made during a micro-batch holding ``samples`` samples."""

    __slots__ = ("arguments", "samples")

    def __init__(self, arguments: dict[str, Any], samples: int) -> None:
        self.arguments = arguments
        self.samples = samples


@contextlib.contextmanager
def capture_logs(pl_module: "pl.LightningModule", into: list[LoggedCall], samples: int) -> Iterator[None]:
    """Record the module's ``self.log`` (and so ``self.log_dict``) calls into ``into`` instead of logging them."""

    def log(*args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(pl_module, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        into.append(LoggedCall(arguments, samples))

    # an instance attribute shadows the class method for this step only; the user's class is untouched
    pl_module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log


def replay_logs(pl_module: "pl.LightningModule", calls: list[LoggedCall], hook_name: str) -> None:
    """Log each captured key once, its value combined over the micro-batches as ``reduce_fx`` asks.

    ``"mean"`` (the default) is weighted by the micro-batches' sample counts, so the value is the one the whole
    batch would have given; ``"sum"``, ``"max"`` and ``"min"`` reduce the values; a torchmetrics ``Metric`` already
    holds every micro-batch's update and is logged once. An explicit ``batch_size=`` is summed.
    """
    if not calls:
        return
    by_name: dict[str, list[LoggedCall]] = {}
    for call in calls:
        by_name.setdefault(call.arguments["name"], []).append(call)
    previous_fx = pl_module._current_fx_name
    pl_module._current_fx_name = hook_name
    try:
        for same_key in by_name.values():
            arguments = dict(same_key[-1].arguments)
            if len(same_key) > 1:
                arguments["value"] = _combine_values(same_key, arguments.get("reduce_fx", "mean"))
                sizes = [c.arguments.get("batch_size") for c in same_key]
                if all(size is not None for size in sizes):
                    arguments["batch_size"] = sum(sizes)
            pl_module.log(**arguments)
    finally:
        pl_module._current_fx_name = previous_fx


def _combine_values(calls: list[LoggedCall], reduce_fx: Any) -> Any:
    values = [c.arguments["value"] for c in calls]
    if isinstance(values[-1], Metric) or not all(isinstance(v, (Tensor, int, float)) for v in values):
        return values[-1]
    tensors = [torch.as_tensor(v).detach().double() for v in values]
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    stacked = torch.stack([t.to(device) for t in tensors])
    if reduce_fx in _SUM:
        combined = stacked.sum(0)
    elif reduce_fx in _MAX:
        combined = stacked.max(0).values
    elif reduce_fx in _MIN:
        combined = stacked.min(0).values
    else:
        weights = torch.tensor([float(c.samples) for c in calls], dtype=torch.float64, device=device)
        weights = weights.view(-1, *([1] * (stacked.dim() - 1)))
        combined = (stacked * weights).sum(0) / weights.sum()
    dtype = values[-1].dtype if isinstance(values[-1], Tensor) else torch.get_default_dtype()
    if not dtype.is_floating_point and reduce_fx not in (*_SUM, *_MAX, *_MIN):
        dtype = torch.get_default_dtype()  # a weighted mean of counts is not a count
    return combined.to(dtype)
