"""The repeated blocks of a model (a transformer's layers), found without help, and activation checkpointing of them.

A block is a module with parameters whose class appears at least twice among the modules of one container
(``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``): a transformer's layers, a CNN stage's residual blocks, or
the linear layers of an ``nn.Sequential`` MLP. Repeats kept as plain attributes (``self.encoder`` and
``self.decoder`` of one class) are blocks too when they hold layers of their own and no container inside them repeats
anything; leaf layers side by side (GPT-2's token and position embeddings) are not. The outermost blocks are taken, and
a ``ModuleList`` or ``ModuleDict``, which has no ``forward``, is never one: its members are looked at instead. The
blocks are the units activation checkpointing recomputes, and FSDP's sharding units once tied parameters are kept
together (:func:`sharding_units`). Users name classes instead where the rule finds the wrong ones (``class_names``).
"""

import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_WITHOUT_FORWARD = (nn.ModuleList, nn.ModuleDict)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_leaf(module: nn.Module) -> bool:
    # a layer whose parameters are all its own: an embedding, a linear layer, a norm
    return not any(_has_parameters(child) for child in module.children())


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
        return _outermost(module, _named_classes(module, class_names))
    return _outermost(module, _block_finder(module))


def _named_classes(module: nn.Module, class_names: Iterable[str]) -> Callable[[nn.Module], bool]:
    wanted = set(class_names)
    found = {type(sub).__name__ for sub in module.modules()}
    missing = sorted(wanted - found)
    if missing:
        raise ValueError(
            f"no submodule of {type(module).__name__} has the class name(s) {missing}; its classes are {sorted(found)}"
        )
    return lambda sub: type(sub).__name__ in wanted and sub is not module


def _repeats(children: list[nn.Module]) -> list[nn.Module]:
    counts = Counter(type(child) for child in children)
    return [child for child in children if counts[type(child)] >= 2]


def _block_finder(root: nn.Module) -> Callable[[nn.Module], bool]:
    in_containers: set[int] = set()
    as_attributes: set[int] = set()
    for parent in root.modules():
        children = [child for child in parent.children() if _has_parameters(child)]
        if isinstance(parent, _CONTAINERS):
            in_containers.update(id(child) for child in _repeats(children))
        else:
            as_attributes.update(id(child) for child in _repeats([c for c in children if not _is_leaf(c)]))

    def is_block(module: nn.Module) -> bool:
        if isinstance(module, _WITHOUT_FORWARD):
            return False
        if id(module) in in_containers:
            return True
        # repeated attributes (an encoder and a decoder) give way to the layers a container inside them repeats
        return id(module) in as_attributes and not any(
            id(inner) in in_containers for inner in module.modules() if inner is not module
        )

    return is_block


def _outermost(
    root: nn.Module, is_block: Callable[[nn.Module], bool], opened: Callable[[nn.Module], bool] = lambda _: False
) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    seen: set[int] = set()

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if id(child) in seen:  # a module reachable under two names (T5's shared embedding) is visited once
                continue
            seen.add(id(child))
            if is_block(child) and not opened(child):
                blocks.append(child)
            else:
                visit(child)

    visit(root)
    return blocks


@dataclass(frozen=True)
class TiedParameter:
    """One parameter reachable under several names: an output head that reuses the input embedding's weight.

    Attributes:
        names: every name of it, as ``named_parameters(remove_duplicate=False)`` gives them, first one first.
        numel: its elements (counted once).
    """

    names: tuple[str, ...]
    numel: int


def tied_parameters(module: nn.Module) -> list[TiedParameter]:
    """The parameters of ``module`` that several modules hold (by identity), in the order of first appearance.

    Example::

        >>> net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
        >>> net[1].weight = net[0].weight
        >>> tied_parameters(net)
        [TiedParameter(names=('0.weight', '1.weight'), numel=32)]
    """
    names: dict[int, list[str]] = defaultdict(list)
    sizes: dict[int, int] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
        sizes[id(param)] = param.numel()
    return [TiedParameter(tuple(found), sizes[key]) for key, found in names.items() if len(found) > 1]


class TiedParameterSplitError(ValueError):
    """A sharding unit holds some, but not all, of the modules that share a parameter."""


def sharding_units(
    module: nn.Module, class_names: Sequence[str] | None = None, owner: str = "FSDPStrategy"
) -> list[nn.Module]:
    """FSDP's sharding units of ``module``: its repeated blocks, never splitting a tied parameter between two units.

    FSDP2 manages each parameter in one group, so every module holding a tied parameter must be in the same unit (or
    in none, that is in the root's). With ``class_names=None`` a repeated block that holds some of a tied parameter's
    modules but not all of them is opened: the repeated blocks inside it become the units instead, and the rest of it
    goes to the root. For a language model whose head reuses the input embedding that leaves both with the root and the
    transformer layers as units; T5's encoder and decoder, which share one embedding, are opened into their layers.

    Args:
        module: the model.
        class_names: the classes to shard as units (``shard_units``), or ``None`` to find them.
        owner: the name that error messages start with.

    Raises:
        TiedParameterSplitError: a unit of ``class_names`` would split a tied parameter; the message names the
            parameter, a module inside the unit and one outside it.
        ValueError: a name of ``class_names`` matches no submodule.
    """
    tied = tied_parameters(module)
    module_names: dict[int, list[str]] = defaultdict(list)
    for name, sub in module.named_modules(remove_duplicate=False):
        module_names[id(sub)].append(name)

    def split(unit: nn.Module) -> tuple[TiedParameter, str, str] | None:
        prefixes = tuple(f"{name}." for name in module_names[id(unit)])
        for param in tied:
            inside = [name for name in param.names if name.startswith(prefixes)]
            if inside and len(inside) < len(param.names):
                outside = next(name for name in param.names if not name.startswith(prefixes))
                return param, inside[0].rpartition(".")[0], outside.rpartition(".")[0]
        return None

    if class_names is None:
        return _outermost(module, _block_finder(module), opened=lambda sub: split(sub) is not None)
    units = _outermost(module, _named_classes(module, class_names))
    for unit in units:
        found = split(unit)
        if found is not None:
            param, inside, outside = found
            unit_name = module_names[id(unit)][0]
            raise TiedParameterSplitError(
                f"{owner}: shard_units={list(class_names)!r} would split the tied parameter {param.names[0]!r} "
                f"(also named {', '.join(repr(name) for name in param.names[1:])}): module {inside!r} is in the unit "
                f"{unit_name!r} ({type(unit).__name__}) and module {outside or '<root>'!r} is outside it, and FSDP "
                "manages a parameter in one unit only. Name classes whose modules hold every use of it, or leave "
                f"{type(unit).__name__!r} out so that it stays with the root; shard_units='auto' does that for you."
            )
    return units


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


def _checkpointed_forward(block: nn.Module, previous: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    # the block's own forward (or one set on it before), run under torch's non-reentrant checkpoint
    forward = previous if previous is not None else type(block).forward.__get__(block)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in the backward instead of keeping them (torch's non-reentrant checkpoint).

    The block's ``forward`` is set on the instance to run its own forward under ``torch.utils.checkpoint``: its class,
    parameter names and state-dict keys stay as they were (torch's ``checkpoint_wrapper`` adds a prefix to every
    name), its hooks run once a step, outside the checkpoint, and ``torch.compile`` traces the checkpoint as one
    region (the forward's saved tensors and the recomputation's then match; hooks that checkpoint around a compiled
    forward recompute in eager mode, whose saved tensors differ). The forward is a ``functools.partial`` of a module
    function and the block, so a copy of the model (``copy.deepcopy``) recomputes its own blocks and the model
    pickles. Idempotent; :func:`undo_checkpoint_activations` reverts it. Random operations inside a block (dropout)
    replay the same random numbers in the recomputation.
    """
    for block in blocks:
        if _is_checkpointed(block):
            continue
        previous = vars(block).get("forward")  # a forward set on the instance before (an adapter's), kept
        block.forward = functools.partial(_checkpointed_forward, block, previous)


def _is_checkpointed(block: nn.Module) -> bool:
    forward = block.forward
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def undo_checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    """Give the blocks their own ``forward`` back."""
    for block in blocks:
        if not _is_checkpointed(block):
            continue
        previous = block.forward.args[1]
        if previous is None:
            del block.forward  # the class's own method shows through again
        else:
            block.forward = previous
