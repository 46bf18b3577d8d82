"""Run a step in pieces, then log and return what one run on the whole batch would have.

Two features run one step as several pieces: :class:`~lightning_mgpu.OOMBackoff` runs a batch as micro-batches,
one after another, and :class:`~lightning_mgpu.DataParallelStrategy` runs it as one chunk per GPU, in threads. Both
hold back the step's ``self.log`` calls (:func:`capture_logs`), log each key once from the combined calls
(:func:`replay_logs`) and merge the pieces' step outputs (:func:`merge_outputs`), by the rules below.

Logged values, one call per key (:func:`combine_log_calls`), ``reduce_fx`` as Lightning accepts it:

- ``"mean"`` (the default), ``"avg"`` or ``torch.mean``: the mean of the pieces' values weighted by their samples,
  or by their explicit ``batch_size`` when every call passed one; a mean of integers is a float.
- ``"sum"``, ``"max"``, ``"min"`` (any case), the matching ``torch`` functions or Python builtins: that reduction.
- any other ``reduce_fx``: ``ValueError`` (Lightning refuses it too: log a ``torchmetrics.Metric`` instead).
- a logged ``torchmetrics.Metric``: logged once, the last call's object; it already holds every piece's update.
- a value that is neither a number, a tensor nor a ``Metric``: the last call's, for Lightning to accept or refuse.
- the other arguments (``prog_bar``, ``on_epoch``...) are the last call's; an explicit ``batch_size`` is summed when
  every call passed one, and otherwise left out, so Lightning measures the whole batch as it does without pieces.

Step outputs (:func:`merge_outputs`):

- a 0-dim tensor: the mean weighted by the pieces' samples, differentiable, in its dtype (a float for integers);
  a tensor with dimensions: the pieces' tensors concatenated along dim 0.
- mappings, namedtuples, dataclass instances, lists and tuples: merged entry by entry, keeping their type. A list or
  tuple of plain items (names, ids) as long as its piece's samples in every piece is per-sample: concatenated.
- any other value (a string, ``None``, a number): kept if it is equal in every piece; differing numbers become their
  weighted mean (a float), and any other differing values a list of the pieces' values, in piece order.
"""

import inspect
import numbers
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_mgpu.core import compat
from lightning_mgpu.core.batch_split import (
    init_fields,
    is_dataclass_instance,
    is_flat_sequence,
    is_namedtuple,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
# Lightning's accepted reductions (its ``_Metadata._parse_reduce_fx``): the names and the functions of each
REDUCTIONS: dict[str, tuple[Any, ...]] = {
    "mean": ("mean", "avg", torch.mean),
    "sum": ("sum", torch.sum, sum),
    "max": ("max", torch.max, max),
    "min": ("min", torch.min, min),
}


@dataclass
class LogCall:
    """One ``self.log`` call made while a piece of a step ran.

    Args:
        arguments: the call's arguments by name (``name``, ``value`` and every option it was given), as
            ``LightningModule.log`` names them.
        samples: how many samples the piece that made the call held; weighs its value in a mean.
    """

    arguments: dict[str, Any]
    samples: int

    @property
    def name(self) -> str:
        """The logged key."""
        return self.arguments["name"]

    @property
    def value(self) -> Any:
        """The logged value."""
        return self.arguments["value"]


def log_call(samples: int, *args: Any, **kwargs: Any) -> LogCall:
    """Record a ``self.log(*args, **kwargs)`` call made by a piece of ``samples`` samples, every argument by name.

    Example::

        >>> log_call(3, "loss", 2.0, prog_bar=True)
        LogCall(arguments={'name': 'loss', 'value': 2.0, 'prog_bar': True}, samples=3)
    """
    arguments = dict(_LOG_SIGNATURE.bind(None, *args, **kwargs).arguments)
    arguments.pop("self")
    return LogCall(arguments, samples)


def capture_logs(module: "pl.LightningModule", into: list[LogCall], samples: int) -> AbstractContextManager[None]:
    """Record the module's ``self.log`` (and so ``self.log_dict``) calls into ``into`` instead of logging them.

    A context manager: in this thread, for this module only, until the block ends (an exception included); see
    :class:`~lightning_mgpu.core.compat.LogCapture`. The module and its class are untouched. A call made in another
    thread meanwhile (a thread the step starts, or a tensor hook that autograd runs on its CUDA worker thread) is
    logged at once, as Lightning would; a module's own override of ``log`` runs for each piece.

    Args:
        module: the module, or a replica of it, whose calls are held back.
        into: where the calls go, in call order.
        samples: the samples of the piece that runs inside the block.
    """

    def record(*args: Any, **kwargs: Any) -> None:
        into.append(log_call(samples, *args, **kwargs))

    return compat.LogCapture(module, record)


def combine_log_calls(calls: Sequence[LogCall], device: torch.device | None = None) -> list[dict[str, Any]]:
    """Combine the pieces' calls into the arguments of one ``self.log`` call per key, by the rules of this module.

    Keys come in the order of their first call. A key logged once keeps its arguments as they are.

    Args:
        calls: every piece's calls, the pieces in order.
        device: where a combined tensor lives; by default the first non-CPU device among the values, else the CPU.

    Raises:
        ValueError: for a ``reduce_fx`` Lightning does not accept, or a combined tensor with more than one element.

    Example::

        >>> calls = [log_call(3, "acc", 1.0), log_call(1, "acc", 0.0), log_call(3, "seen", 3, reduce_fx="sum")]
        >>> combine_log_calls(calls)
        [{'name': 'acc', 'value': 0.75}, {'name': 'seen', 'value': 3, 'reduce_fx': 'sum'}]
    """
    by_name: dict[str, list[LogCall]] = {}
    for call in calls:
        by_name.setdefault(call.name, []).append(call)
    return [_combine_key(same_key, device) for same_key in by_name.values()]


def replay_logs(
    module: "pl.LightningModule", calls: Sequence[LogCall], hook_name: str, device: torch.device | None = None
) -> None:
    """Log each captured key once, combined by :func:`combine_log_calls`, as if from Lightning hook ``hook_name``.

    Args:
        module: the LightningModule that logs.
        calls: the captured calls, the pieces in order.
        hook_name: the hook the step runs in (``"training_step"``...), which decides Lightning's logging defaults.
        device: as for :func:`combine_log_calls`.
    """
    combined = combine_log_calls(calls, device)
    if not combined:
        return
    # Lightning's own log for a LightningModule: a subclass's override of it ran already, when the calls were captured
    log = pl.LightningModule.log if isinstance(module, pl.LightningModule) else type(module).log
    with compat.running_hook(module, hook_name):
        for arguments in combined:
            log(module, **arguments)


def merge_outputs(outputs: Sequence[Any], samples: Sequence[int], device: torch.device | int | None = None) -> Any:
    """Merge the pieces' step outputs into the output one run on the whole batch would have given.

    Args:
        outputs: one output per piece, in order, of the same structure.
        samples: the samples of each piece.
        device: where merged tensors live (DataParallel's output device); by default the first piece's.

    Returns:
        The merged output; the one output itself if there is one piece.

    Raises:
        ValueError: if ``outputs`` and ``samples`` differ in length, or the samples do not sum to a positive number.

    Example::

        >>> merge_outputs([{"pred": torch.zeros(2), "loss": torch.tensor(1.0), "tag": "a"},
        ...                {"pred": torch.ones(1), "loss": torch.tensor(4.0), "tag": "b"}], [2, 1])
        {'pred': tensor([0., 0., 1.]), 'loss': tensor(2.), 'tag': ['a', 'b']}
    """
    if len(outputs) != len(samples):
        raise ValueError(f"got {len(outputs)} outputs but {len(samples)} sample counts")
    if sum(samples) <= 0:
        raise ValueError(f"the sample counts must sum to a positive number, got {list(samples)}")
    if len(outputs) == 1:
        return outputs[0]
    target = torch.device(device) if isinstance(device, (str, int)) else device
    return _merge(list(outputs), list(samples), target)


# ------------------------------------------------------------------------------------------------ log calls
def _reduction(reduce_fx: Any, name: str) -> str:
    key = reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx
    for reduction, accepted in REDUCTIONS.items():
        if any(key is fn or (isinstance(key, str) and key == fn) for fn in accepted):
            return reduction
    raise ValueError(
        f"unsupported reduce_fx={reduce_fx!r} for logged key {name!r}: a step run in pieces combines its logged"
        " values with 'mean' (or 'avg'), 'sum', 'max' or 'min', the reductions Lightning accepts; log a"
        " torchmetrics.Metric for another reduction"
    )


def _combine_key(calls: list[LogCall], device: torch.device | None) -> dict[str, Any]:
    arguments = dict(calls[-1].arguments)
    reduction = _reduction(arguments.get("reduce_fx", "mean"), arguments["name"])
    if len(calls) == 1:
        return arguments
    sizes = [call.arguments.get("batch_size") for call in calls]
    explicit = all(size is not None for size in sizes)
    weights = [int(size) for size in sizes] if explicit else [call.samples for call in calls]
    values = [call.value for call in calls]
    if all(_is_loggable_number(value) for value in values):
        detach = not arguments.get("enable_graph", False)
        arguments["value"] = _reduce_values(values, reduction, weights, device, detach, arguments["name"])
    if explicit:
        arguments["batch_size"] = sum(weights)
    return arguments


def _is_loggable_number(value: Any) -> bool:
    return isinstance(value, (Tensor, numbers.Number))


def _reduce_values(
    values: list[Any], reduction: str, weights: list[int], device: torch.device | None, detach: bool, name: str
) -> Any:
    if not any(isinstance(value, Tensor) for value in values):
        if reduction == "mean":
            return sum(float(v) * w for v, w in zip(values, weights, strict=True)) / sum(weights)
        return {"sum": sum, "max": max, "min": min}[reduction](values)
    if device is None:
        on_device = (v.device for v in values if isinstance(v, Tensor) and v.device.type != "cpu")
        device = next(on_device, torch.device("cpu"))
    tensors = []
    for value in values:
        tensor = torch.as_tensor(value)
        if tensor.numel() != 1:
            raise ValueError(
                f"`self.log({name!r}, ...)` was called with a tensor of {tensor.numel()} elements; a logged tensor"
                " must have a single element"
            )
        tensor = tensor.detach() if detach else tensor
        tensors.append(tensor.reshape(()).to(device, torch.float64))
    stacked = torch.stack(tensors)
    last = next(v for v in reversed(values) if isinstance(v, Tensor))
    dtype = last.dtype if last.is_floating_point() or reduction != "mean" else torch.get_default_dtype()
    if reduction == "sum":
        return stacked.sum().to(dtype)
    if reduction == "max":
        return stacked.max().to(dtype)
    if reduction == "min":
        return stacked.min().to(dtype)
    total = float(sum(weights))
    # Python weights: no host-to-device copy, so no synchronisation
    return sum(t * (w / total) for t, w in zip(tensors, weights, strict=True)).to(dtype)  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ step outputs
def _merge(outputs: list[Any], samples: list[int], device: torch.device | None) -> Any:
    first = outputs[0]
    if _all(outputs, Tensor) and all(o.dim() == first.dim() for o in outputs):
        if first.dim() == 0:
            return _weighted_mean(outputs, samples, device)
        return torch.cat([o if device is None else o.to(device) for o in outputs], dim=0)
    if _all(outputs, Mapping) and all(list(o.keys()) == list(first.keys()) for o in outputs):
        return rebuild_mapping(first, {key: _merge([o[key] for o in outputs], samples, device) for key in first})
    same_type = all(type(o) is type(first) for o in outputs)
    if same_type and is_dataclass_instance(first):
        merged = {name: _merge([getattr(o, name) for o in outputs], samples, device) for name in init_fields(first)}
        return rebuild_dataclass(first, merged)
    if same_type and isinstance(first, (list, tuple)):
        if not is_namedtuple(first) and all(
            is_flat_sequence(o) and len(o) == n for o, n in zip(outputs, samples, strict=True)
        ):
            return rebuild_sequence(first, [item for output in outputs for item in output])
        if all(len(o) == len(first) for o in outputs):
            return rebuild_sequence(
                first, [_merge([o[i] for o in outputs], samples, device) for i in range(len(first))]
            )
    if all(_equal(first, o) for o in outputs[1:]):
        return first
    if all(_is_number(o) for o in outputs):
        return sum(float(o) * n for o, n in zip(outputs, samples, strict=True)) / sum(samples)
    return list(outputs)


def _all(values: list[Any], kind: type | tuple[type, ...]) -> bool:
    return all(isinstance(value, kind) for value in values)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # a comparison that is not a plain truth value (arrays, odd objects): not equal
        return False


def _weighted_mean(values: list[Tensor], samples: list[int], device: torch.device | None) -> Tensor:
    first = values[0]
    target = first.device if device is None else device
    dtype = first.dtype if first.is_floating_point() else torch.get_default_dtype()
    total = float(sum(samples))
    # float64 so that a value equal in every piece comes back exactly; still differentiable
    merged = sum(v.to(target, torch.float64) * (n / total) for v, n in zip(values, samples, strict=True))
    return merged.to(dtype)  # type: ignore[union-attr]
