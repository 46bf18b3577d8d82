"""Cut a batch into micro-batches and glue the micro-batches' step outputs back together.

Pure functions on nested collections (tensors, mappings, lists, tuples, namedtuples, dataclass instances) for a
callback that recovers from a CUDA out-of-memory error by running the same batch in smaller pieces. A tensor's
first dimension is the sample dimension when it equals the batch size; tensors are cut with slicing views, so
splitting copies no tensor data.
"""

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def batch_size_of(batch: Any) -> int:
    """The number of samples in ``batch``: the size of dim 0 of its first tensor with at least one dimension.

    The batch is searched depth-first, in order: mapping values in iteration order, list and tuple items, and the
    ``init`` fields of a dataclass instance in declaration order. 0-dim tensors are skipped.

    Args:
        batch: a tensor, or a (nested) mapping, list, tuple, namedtuple or dataclass instance holding tensors.

    Returns:
        The size of the first tensor's dim 0.

    Raises:
        ValueError: if ``batch`` holds no tensor with at least one dimension.

    Example::

        >>> batch_size_of({"label": torch.tensor(1), "x": (torch.zeros(5, 3), torch.zeros(7))})
        5
    """
    size = _find_batch_size(batch)
    if size is None:
        raise ValueError(
            f"cannot find the batch size of a {type(batch).__name__} batch: it holds no tensor with at least one"
            " dimension; a batch must contain a tensor whose dim 0 is the sample dimension"
        )
    return size


def split_batch(batch: Any, micro_batch_size: int) -> list[tuple[Any, int]]:
    """Cut ``batch`` in order into consecutive micro-batches of at most ``micro_batch_size`` samples.

    With ``N = batch_size_of(batch)``, every tensor whose dim 0 equals ``N`` is sliced along dim 0 (a view, no
    copy); a 0-dim tensor or a tensor with another first dimension goes unchanged into every piece. A list or tuple
    (not a namedtuple) of length ``N`` whose items are neither tensors nor collections (file names, string labels,
    ids) is per-sample and sliced too. Mappings, namedtuples, lists, tuples and dataclass instances are rebuilt with
    their own type around their split contents (a dataclass through :func:`dataclasses.replace` on its ``init``
    fields; ``init=False`` fields are copied unchanged); any other object (``None``, a string, a number) goes
    unchanged into every piece. Concatenating the pieces' per-sample parts gives the batch back.

    Args:
        batch: a tensor, or a (nested) mapping, list, tuple, namedtuple or dataclass instance holding tensors.
        micro_batch_size: the most samples a piece may hold; the last piece may hold fewer.

    Returns:
        ``(piece, number_of_samples)`` for every piece, in order; ``[(batch, N)]``, the very object passed in, if
        ``micro_batch_size >= N``.

    Raises:
        TypeError: if ``micro_batch_size`` is not an int.
        ValueError: if ``micro_batch_size`` is smaller than 1, or ``batch`` holds no tensor (see :func:`batch_size_of`).

    Example::

        >>> pieces = split_batch((torch.arange(10), ["a"] * 10), micro_batch_size=4)
        >>> [size for _, size in pieces]
        [4, 4, 2]
        >>> pieces[-1][0]
        (tensor([8, 9]), ['a', 'a'])
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(
            f"micro_batch_size must be a positive int, got {micro_batch_size!r}"
            f" of type {type(micro_batch_size).__name__}"
        )
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size}; use 1 or more samples")
    size = batch_size_of(batch)
    if micro_batch_size >= size:
        return [(batch, size)]
    return [
        (_slice(batch, start, min(start + micro_batch_size, size), size), min(micro_batch_size, size - start))
        for start in range(0, size, micro_batch_size)
    ]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """The samples ``start:stop`` of ``batch``, cut by the same rules as :func:`split_batch` (views, no copies).

    Args:
        batch: as for :func:`split_batch`.
        start: the first sample kept.
        stop: one past the last sample kept.

    Example::

        >>> slice_batch((torch.arange(10), ["a"] * 10), 8, 10)
        (tensor([8, 9]), ['a', 'a'])
    """
    size = batch_size_of(batch)
    if not 0 <= start <= stop <= size:
        raise ValueError(f"slice {start}:{stop} is outside a batch of {size} samples")
    if start == 0 and stop == size:
        return batch
    return _slice(batch, start, stop, size)


def combine_outputs(outputs: list[Any], samples: list[int]) -> Any:
    """Glue the step outputs of consecutive micro-batches into the output the whole batch would have given.

    Tensors with a batch dimension are concatenated along it (predictions keep their order); scalars (a 0-dim
    tensor, a Python number) are averaged, weighted by the samples, which gives the batch's value for a mean such as
    a loss or an accuracy; a list or tuple of plain items (file names) is concatenated; mappings, namedtuples,
    lists, tuples and dataclass instances are combined entry by entry; anything else (a string, None) is taken from
    the first micro-batch.

    Args:
        outputs: one output per micro-batch, in order, all of the same structure.
        samples: the number of samples of each micro-batch.

    Example::

        >>> combine_outputs([{"pred": torch.zeros(2), "loss": torch.tensor(1.0)},
        ...                  {"pred": torch.ones(1), "loss": torch.tensor(4.0)}], [2, 1])
        {'pred': tensor([0., 0., 1.]), 'loss': tensor(2.)}
    """
    if len(outputs) != len(samples):
        raise ValueError(f"got {len(outputs)} outputs but {len(samples)} sample counts")
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            stacked = torch.stack([o.detach().double() for o in outputs])
            weights = torch.tensor(samples, dtype=torch.float64, device=stacked.device)
            return ((stacked * weights).sum() / weights.sum()).to(first.dtype)
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return float(sum(o * n for o, n in zip(outputs, samples, strict=True)) / sum(samples))
    if isinstance(first, Mapping):
        return _rebuild_mapping(first, {key: combine_outputs([o[key] for o in outputs], samples) for key in first})
    if _is_dataclass_instance(first):
        values = {name: combine_outputs([getattr(o, name) for o in outputs], samples) for name in _init_fields(first)}
        return _rebuild_dataclass(first, values)
    if isinstance(first, (list, tuple)):
        if _is_flat_sequence(first) and not _is_namedtuple(first):
            return _rebuild_sequence(first, [item for output in outputs for item in output])
        combined = [combine_outputs([o[i] for o in outputs], samples) for i in range(len(first))]
        return _rebuild_sequence(first, combined)
    return first


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_collection(obj: Any) -> bool:
    return isinstance(obj, (Mapping, list, tuple)) or _is_dataclass_instance(obj)


def _is_flat_sequence(obj: Any) -> bool:
    """A list or tuple (not a namedtuple) holding neither tensors nor collections: a candidate per-sample list."""
    return (
        isinstance(obj, (list, tuple))
        and not _is_namedtuple(obj)
        and not any(isinstance(item, Tensor) or _is_collection(item) for item in obj)
    )


def _init_fields(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.init]


def _find_batch_size(obj: Any) -> int | None:
    if isinstance(obj, Tensor):
        return obj.shape[0] if obj.dim() > 0 else None
    if isinstance(obj, Mapping):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif _is_dataclass_instance(obj):
        children = (getattr(obj, name) for name in _init_fields(obj))
    else:
        return None
    for child in children:
        size = _find_batch_size(child)
        if size is not None:
            return size
    return None


def _rebuild_mapping(template: Mapping, items: dict[Any, Any]) -> Mapping:
    if isinstance(template, defaultdict):
        return type(template)(template.default_factory, items)
    try:
        return type(template)(items)
    except TypeError:
        return items


def _rebuild_sequence(template: list | tuple, items: list[Any]) -> list | tuple:
    if _is_namedtuple(template):
        return type(template)(*items)
    try:
        return type(template)(items)
    except TypeError:
        return list(items) if isinstance(template, list) else tuple(items)


def _rebuild_dataclass(template: Any, init_values: dict[str, Any]) -> Any:
    rebuilt = dataclasses.replace(template, **init_values)
    for f in dataclasses.fields(template):
        if not f.init and hasattr(template, f.name):
            # object.__setattr__ also writes the fields of a frozen dataclass
            object.__setattr__(rebuilt, f.name, getattr(template, f.name))
    return rebuilt


def _slice(obj: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(obj, Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == size else obj
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {key: _slice(value, start, stop, size) for key, value in obj.items()})
    if isinstance(obj, (list, tuple)):
        if len(obj) == size and _is_flat_sequence(obj):
            return _rebuild_sequence(obj, list(obj[start:stop]))
        return _rebuild_sequence(obj, [_slice(item, start, stop, size) for item in obj])
    if _is_dataclass_instance(obj):
        return _rebuild_dataclass(
            obj, {name: _slice(getattr(obj, name), start, stop, size) for name in _init_fields(obj)}
        )
    return obj
