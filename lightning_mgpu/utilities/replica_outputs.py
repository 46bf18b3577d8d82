"""Merge what DataParallel replicas return and log into what one device on the whole batch would have given."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_MEAN_NAMES = ("mean", "avg")


@dataclass
class LogCall:
    """One ``self.log`` call captured inside a replica.

    Args:
        name: the logged key.
        value: the logged value (a scalar tensor or a Python number).
        kwargs: every other argument of the call, by name.
    """

    name: str
    value: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReplicaRecord:
    """What one replica saw during one step: its share of the batch and its log calls.

    Args:
        batch_size: samples in this replica's chunk of the batch.
        calls: the replica's ``self.log`` calls, in call order.
    """

    batch_size: int
    calls: list[LogCall] = field(default_factory=list)


def weighted_mean(values: Sequence[Any], weights: Sequence[float], device: torch.device | int | None = None) -> Any:
    """Mean of per-replica scalars weighted by ``weights``, computed in fp32 and kept differentiable.

    Args:
        values: scalar tensors (possibly on different devices) or Python numbers, one per replica.
        weights: the weight of each value, usually the replica's batch size.
        device: where a tensor result lives; defaults to the first tensor's device.

    Example::

        >>> weighted_mean([torch.tensor(1.0), torch.tensor(4.0)], [3, 1])
        tensor(1.7500)
    """
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    if not any(isinstance(v, Tensor) for v in values):
        return sum(float(v) * w for v, w in zip(values, weights, strict=True)) / total
    first = next(v for v in values if isinstance(v, Tensor))
    target = first.device if device is None else torch.device(device) if isinstance(device, str) else device
    acc = sum(torch.as_tensor(v).to(target, torch.float32) * (w / total) for v, w in zip(values, weights, strict=True))
    return acc.to(first.dtype) if first.is_floating_point() else acc


def merge_replica_outputs(outputs: Sequence[Any], weights: Sequence[float], device: torch.device | int) -> Any:
    """Merge the step outputs of all replicas into one.

    Scalar tensors (a loss, a metric) become their ``weights``-weighted mean; tensors with a batch dimension are
    concatenated in replica order, as one device would have produced them; dicts, lists and tuples merge key by
    key; equal non-tensor values collapse to one, differing ones become a list.

    Args:
        outputs: one output per replica, all of the same structure.
        weights: one weight per replica, usually its batch size.
        device: where merged tensors live (the output device).

    Example::

        >>> merge_replica_outputs([{"loss": torch.tensor(2.0)}, {"loss": torch.tensor(5.0)}], [2, 1], "cpu")
        {'loss': tensor(3.)}
    """
    if len(outputs) != len(weights):
        raise ValueError(f"got {len(outputs)} replica outputs but {len(weights)} weights")
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            return weighted_mean(outputs, weights, device)
        return torch.cat([out.to(device) for out in outputs], dim=0)
    if isinstance(first, Mapping):
        return type(first)(
            {key: merge_replica_outputs([out[key] for out in outputs], weights, device) for key in first}
        )
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(
            *(merge_replica_outputs(list(items), weights, device) for items in zip(*outputs, strict=True))
        )
    if isinstance(first, (list, tuple)):
        return type(first)(merge_replica_outputs(list(items), weights, device) for items in zip(*outputs, strict=True))
    if all(_equal(first, out) for out in outputs[1:]):
        return first
    return list(outputs)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def merge_log_calls(records: Sequence[ReplicaRecord], device: torch.device | int) -> list[LogCall]:
    """Merge the replicas' ``self.log`` calls into one call per key, in the first replica's call order.

    Values logged with the default ``reduce_fx="mean"`` are averaged weighted by the call's ``batch_size`` (or the
    replica's batch size) and re-logged with the total batch size; ``"sum"``, ``"max"`` and ``"min"`` (or the
    matching torch functions) are reduced with that function. A key logged by only some replicas merges over
    those.

    Args:
        records: one record per replica, in replica order.
        device: where merged tensors live.

    Example::

        >>> a = ReplicaRecord(3, [LogCall("acc", torch.tensor(1.0))])
        >>> b = ReplicaRecord(1, [LogCall("acc", torch.tensor(0.0))])
        >>> merged = merge_log_calls([a, b], "cpu")[0]
        >>> merged.value, merged.kwargs["batch_size"]
        (tensor(0.7500), 4)
    """
    order: list[str] = []
    by_name: dict[str, list[tuple[LogCall, int]]] = {}
    for record in records:
        for call in record.calls:
            if call.name not in by_name:
                order.append(call.name)
                by_name[call.name] = []
            by_name[call.name].append((call, record.batch_size))
    return [_merge_one_key(by_name[name], device) for name in order]


def _merge_one_key(calls: list[tuple[LogCall, int]], device: torch.device | int) -> LogCall:
    first = calls[0][0]
    kwargs = dict(first.kwargs)
    values = [call.value for call, _ in calls]
    reduce_fx = kwargs.get("reduce_fx", "mean")
    if _is_reduction(reduce_fx, "mean"):
        weights = [int(call.kwargs.get("batch_size") or size) for call, size in calls]
        kwargs["batch_size"] = sum(weights)
        return LogCall(first.name, weighted_mean(values, weights, device), kwargs)
    for name, fn in (("sum", torch.sum), ("max", torch.max), ("min", torch.min)):
        if _is_reduction(reduce_fx, name):
            return LogCall(first.name, _reduce_stack(values, fn, device), kwargs)
    if callable(reduce_fx):
        return LogCall(first.name, _reduce_stack(values, reduce_fx, device), kwargs)
    raise ValueError(f"unsupported reduce_fx={reduce_fx!r} for logged key {first.name!r}")


def _is_reduction(reduce_fx: Any, name: str) -> bool:
    if isinstance(reduce_fx, str):
        return reduce_fx.lower() in (_MEAN_NAMES if name == "mean" else (name,))
    return reduce_fx is getattr(torch, name)


def _reduce_stack(values: Sequence[Any], fn: Callable[[Tensor], Tensor], device: torch.device | int) -> Any:
    stacked = torch.stack([torch.as_tensor(v).to(device) for v in values])
    result = fn(stacked)
    if not isinstance(result, Tensor):  # torch.max/min without dim return a tensor; guard other callables
        result = torch.as_tensor(result)
    if not any(isinstance(v, Tensor) for v in values):
        return result.item()
    return result
