"""The repeated blocks of a model (a transformer's layers), found without help, and activation checkpointing of them.

A block is a submodule with parameters whose class appears at least twice among the children of one container
(``nn.ModuleList``, ``nn.Sequential`` or any module), the outermost such modules: for a transformer that is its layers,
not the linear layers inside them. The blocks are FSDP's sharding units and the units activation checkpointing
recomputes. Users name classes instead where the rule finds the wrong ones (``class_names``).
"""

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_repeated_blocks(module: nn.Module, class_names: Iterable[str] | None = None) -> list[nn.Module]:
    """The outermost repeated blocks of ``module``, in the order of ``module.modules()``.

    Args:
        module: the model (the LightningModule itself, or any ``nn.Module``).
        class_names: class names (``type(m).__name__``) to take instead of finding the blocks; the outermost modules of
            these classes are returned.

    Raises:
        ValueError: a name of ``class_names`` matches no submodule; the message lists the classes the model has.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        ...                     nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> [type(block).__name__ for block in find_repeated_blocks(net)]
        ['Sequential', 'Sequential']
    """
    if class_names is not None:
        wanted = set(class_names)
        found = {type(sub).__name__ for sub in module.modules()}
        missing = sorted(wanted - found)
        if missing:
            raise ValueError(
                f"no submodule of {type(module).__name__} has the class name(s) {missing}; its classes are "
                f"{sorted(found)}"
            )
        return _outermost(module, lambda sub: type(sub).__name__ in wanted and sub is not module)
    return _outermost(module, _is_repeated_child_finder(module))


def _is_repeated_child_finder(root: nn.Module) -> Callable[[nn.Module], bool]:
    repeated: set[int] = set()
    for parent in root.modules():
        children = [child for child in parent.children() if _has_parameters(child)]
        counts = Counter(type(child) for child in children)
        repeated.update(id(child) for child in children if counts[type(child)] >= 2)
    return lambda sub: id(sub) in repeated


def _outermost(root: nn.Module, is_block: Callable[[nn.Module], bool]) -> list[nn.Module]:
    blocks: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if is_block(child):
                blocks.append(child)
            else:
                visit(child)

    visit(root)
    return blocks


def check_class_names(owner: str, name: str, value: Any, allow_none: bool) -> None:
    """Check a ``"auto"`` / list-of-class-names option (``shard_units``, ``activation_checkpointing``).

    Raises:
        TypeError: ``value`` is neither ``"auto"``, a list nor (when allowed) ``None``.
        ValueError: an empty list, or an item that is not a non-empty string.
    """
    if value == "auto" or (allow_none and value is None):
        return
    allowed = "'auto' or a non-empty list of class names" + (" or None" if allow_none else "")
    if isinstance(value, str) or not isinstance(value, (list, tuple, Sequence)):
        raise TypeError(f"{owner}: {name} must be {allowed}, got {value!r}")
    if not value or not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")


def apply_activation_checkpointing(owner: str, module: nn.Module, setting: str | Sequence[str]) -> list[str]:
    """Checkpoint the activations of ``module``'s repeated blocks (``"auto"``) or of the named classes.

    Returns:
        The names of the checkpointed modules (as ``module.named_modules()`` gives them).

    Raises:
        ValueError: ``"auto"`` found no repeated blocks, or a class name matches no module.
    """
    blocks = find_repeated_blocks(module, None if setting == "auto" else setting)
    if not blocks:
        raise ValueError(
            f"{owner}(activation_checkpointing='auto') found no repeated blocks in {type(module).__name__}; name the "
            "classes of the modules to recompute, e.g. activation_checkpointing=['TransformerBlock']"
        )
    checkpoint_activations(blocks)
    names = {sub: name for name, sub in module.named_modules()}
    return [names[block] for block in blocks]


def checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in the backward instead of keeping them (torch's non-reentrant checkpoint).

    The block's ``forward`` is replaced on the instance, so parameter names and state-dict keys stay as they were
    (torch's ``checkpoint_wrapper`` adds a prefix). Idempotent; :func:`undo_checkpoint_activations` reverts it.
    Random operations inside a block (dropout) replay the same random numbers in the recomputation.
    """
    for block in blocks:
        if getattr(block.forward, "mgpu_checkpointed", False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        forward.mgpu_checkpointed = True  # type: ignore[attr-defined]
        forward.mgpu_instance_forward = vars(block).get("forward")  # type: ignore[attr-defined]
        block.forward = forward


def undo_checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    """Give the blocks their own ``forward`` back."""
    for block in blocks:
        if not getattr(block.forward, "mgpu_checkpointed", False):
            continue
        previous = block.forward.mgpu_instance_forward
        if previous is None:
            del block.forward  # the class's own method shows through again
        else:
            block.forward = previous
