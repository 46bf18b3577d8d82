"""Cut a batch into micro-batches, and the rules for rebuilding the collections a batch is made of.

Pure functions on nested collections (tensors, mappings, lists, tuples, namedtuples, dataclass instances) for a
callback that recovers from a CUDA out-of-memory error by running the same batch in smaller pieces. A tensor's
first dimension is the sample dimension when it equals the batch size; tensors are cut with slicing views, so
splitting copies no tensor data. Gluing the pieces' step outputs back together is
:func:`lightning_mgpu.core.step_pieces.merge_outputs`, which rebuilds collections with the helpers here.
"""

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

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


def is_namedtuple(obj: Any) -> bool:
    """Whether ``obj`` is a namedtuple instance (a record: never cut or joined as a per-sample list)."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a dataclass (not the class itself)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_collection(obj: Any) -> bool:
    return isinstance(obj, (Mapping, list, tuple)) or is_dataclass_instance(obj)


def is_flat_sequence(obj: Any) -> bool:
    """A list or tuple (not a namedtuple) holding neither tensors nor collections: a candidate per-sample list."""
    return (
        isinstance(obj, (list, tuple))
        and not is_namedtuple(obj)
        and not any(isinstance(item, Tensor) or _is_collection(item) for item in obj)
    )


def init_fields(obj: Any) -> list[str]:
    """The names of a dataclass instance's ``init`` fields, in declaration order."""
    return [f.name for f in dataclasses.fields(obj) if f.init]


def _find_batch_size(obj: Any) -> int | None:
    if isinstance(obj, Tensor):
        return obj.shape[0] if obj.dim() > 0 else None
    if isinstance(obj, Mapping):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif is_dataclass_instance(obj):
        children = (getattr(obj, name) for name in init_fields(obj))
    else:
        return None
    for child in children:
        size = _find_batch_size(child)
        if size is not None:
            return size
    return None


def rebuild_mapping(template: Mapping, items: dict[Any, Any]) -> Mapping:
    """``items`` in a mapping of ``template``'s type (a defaultdict keeps its factory), else in a plain dict."""
    if isinstance(template, defaultdict):
        return type(template)(template.default_factory, items)
    try:
        return type(template)(items)
    except TypeError:
        return items


def rebuild_sequence(template: list | tuple, items: list[Any]) -> list | tuple:
    """``items`` in a sequence of ``template``'s type (namedtuples included), else in a plain list or tuple."""
    if is_namedtuple(template):
        return type(template)(*items)
    try:
        return type(template)(items)
    except TypeError:
        return list(items) if isinstance(template, list) else tuple(items)


def rebuild_dataclass(template: Any, init_values: dict[str, Any]) -> Any:
    """A copy of dataclass instance ``template`` with ``init_values``; its ``init=False`` fields copied unchanged."""
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
        return rebuild_mapping(obj, {key: _slice(value, start, stop, size) for key, value in obj.items()})
    if isinstance(obj, (list, tuple)):
        if len(obj) == size and is_flat_sequence(obj):
            return rebuild_sequence(obj, list(obj[start:stop]))
        return rebuild_sequence(obj, [_slice(item, start, stop, size) for item in obj])
    if is_dataclass_instance(obj):
        return rebuild_dataclass(
            obj, {name: _slice(getattr(obj, name), start, stop, size) for name in init_fields(obj)}
        )
    return obj
