"""Strategy options declared once: name, type, default, check and doc, shared by every strategy that takes them.

An :class:`Option` lives in the room of the feature it configures (``ddp/options.py``, ``fsdp/options.py``,
``multi_gpu/options.py``, ``hang_timeout`` in ``long_runs/hang_watch.py``; here the options every parallel engine
takes): the lowest room that every strategy taking it can import. A strategy keeps its explicit
``__init__`` signature, since IDEs and LightningCLI read it, and :func:`with_options` gives the class its
``OPTIONS`` (the declarations it takes, in its signature's order) and the ``Args:`` section of its docstring. Its
``__init__`` checks them with one :func:`validate` call; a test pins every signature to the declarations.
:func:`markdown_table` renders the option table of the docs.

Example::

    @with_options(ENGINE_OPTIONS, DDP_OPTIONS)
    class DDPStrategy(...):
        def __init__(self, sync_batchnorm: SyncBatchNormSetting = False, ...) -> None:
            validate(type(self).__name__, DDPStrategy.OPTIONS, locals())
"""

import inspect
import re
import textwrap
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeAlias, TypeVar, Union, get_args, get_origin

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from lightning_mgpu.core.blocks import check_class_names
from lightning_mgpu.core.validation import check_bool, check_choice, check_int, check_positive

__all__ = [
    "DDP",
    "ENGINE_OPTIONS",
    "FSDP",
    "MGPU",
    "NO_DEFAULT",
    "Check",
    "Option",
    "SyncBatchNormSetting",
    "args_section",
    "boolean",
    "choice",
    "class_names",
    "integer",
    "markdown_table",
    "positive",
    "validate",
    "with_options",
]

# the strategies, by class name (the classes live in rooms above this one)
DDP, FSDP, MGPU = "DDPStrategy", "FSDPStrategy", "MultiGPUStrategy"
# the parallel engines: an option of one engine only is marked so for a strategy that runs either
_ENGINES = {DDP: "DDP", FSDP: "FSDP"}
NO_DEFAULT = inspect.Parameter.empty  # the default of ``**kwargs``

SyncBatchNormSetting: TypeAlias = bool | Literal["auto"]

Run: TypeAlias = Callable[[str, str, Any, Mapping[str, Any]], Any]
_Class = TypeVar("_Class", bound=type)


@dataclass(frozen=True)
class Check:
    """How an option is checked at construction, and what it allows, as the option table writes it.

    Args:
        allowed: the allowed values, in Markdown, for the table.
        run: ``run(owner, name, value, values)`` raises ``TypeError``/``ValueError`` for a bad ``value``; ``values``
            holds every argument of the constructor (``**kwargs`` spread in), for checks across options.
    """

    allowed: str
    run: Run


@dataclass(frozen=True, eq=False)
class Option:
    """One constructor option of the strategies, declared once.

    Args:
        name: the parameter's name (``"**kwargs"`` for the keyword arguments passed on).
        annotation: its type hint, as the signatures write it.
        default: its default; :data:`NO_DEFAULT` for ``**kwargs``.
        doc: what it does, in Markdown (backticks for code): the docstrings' ``Args:`` line and the table's.
        strategies: the class names of the strategies that take it.
        check: how it is checked; ``None`` for no check.
        defaults: a strategy's own default where it differs from ``default``.
        set_by_trainer: a plugin the Trainer sets (documented, left out of the option tables).
    """

    name: str
    annotation: Any
    default: Any
    doc: str
    strategies: tuple[str, ...]
    check: Check | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    set_by_trainer: bool = False

    def default_for(self, strategy: str) -> Any:
        """The default this option has on ``strategy``."""
        return self.defaults.get(strategy, self.default)


def boolean(allow_none: bool = False) -> Check:
    """``True`` or ``False`` (or ``None``)."""
    return Check(
        "`True`, `False`" + (", `None`" if allow_none else ""),
        lambda owner, name, value, _: check_bool(owner, name, value, allow_none=allow_none),
    )


def integer(minimum: int) -> Check:
    """An int (not a bool) of at least ``minimum``."""
    return Check(f"int >= {minimum}", lambda owner, name, value, _: check_int(owner, name, value, minimum=minimum))


def positive(unit: str, hint: str = "") -> Check:
    """A finite number > 0 of ``unit``, or ``None``."""
    return Check(
        "number > 0, `None`",
        lambda owner, name, value, _: check_positive(owner, name, value, allow_none=True, unit=unit, hint=hint),
    )


def choice(choices: Iterable[Any]) -> Check:
    """One of ``choices`` (a value of another type than every choice is a ``TypeError``)."""
    allowed = tuple(choices)
    return Check(
        ", ".join(f"`{item!r}`" for item in allowed),
        lambda owner, name, value, _: check_choice(owner, name, value, allowed),
    )


def class_names(allow_none: bool) -> Check:
    """``"auto"`` or a non-empty list of class names (or ``None``)."""
    return Check(
        "`'auto'`, list of class names" + (", `None`" if allow_none else ""),
        lambda owner, name, value, _: check_class_names(owner, name, value, allow_none=allow_none),
    )


def validate(owner: str, options: Iterable[Option], values: Mapping[str, Any]) -> None:
    """Check each of ``options`` in turn against its value in ``values``; the first bad one raises.

    Args:
        owner: the class named in the message.
        options: the options to check, in the order they are checked.
        values: the constructor's arguments by name: its ``locals()``, whose ``kwargs`` (the keyword arguments it
            passes on) are spread in, so that a check can look at them too.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option outside its allowed values.
    """
    if "kwargs" in values and isinstance(values["kwargs"], Mapping):
        values = {**values["kwargs"], **values}
    for option in options:
        if option.check is not None:
            option.check.run(owner, option.name, values[option.name], values)


def with_options(*groups: Iterable[Option]) -> Callable[[_Class], _Class]:
    """Class decorator: the options of ``groups`` the class takes become its ``OPTIONS`` and its ``Args:`` section.

    ``OPTIONS`` follows the order of the class's ``__init__`` signature. The ``Args:`` section goes before the
    docstring's ``Raises:`` section (or its example, or at its end).
    """

    def apply(cls: _Class) -> _Class:
        taken = {option.name: option for group in groups for option in group if cls.__name__ in option.strategies}
        order = [_declared_name(parameter) for parameter in inspect.signature(cls.__init__).parameters.values()]
        undeclared = sorted(set(taken) - set(order))
        if undeclared:  # a declaration the signature lost: validate() would fail on every construction
            raise TypeError(f"{cls.__name__}.__init__ takes no {undeclared}, which its options declare")
        cls.OPTIONS = tuple(sorted(taken.values(), key=lambda o: order.index(o.name)))
        cls.__doc__ = _insert_args(cls.__doc__ or "", args_section(cls))
        return cls

    return apply


def args_section(strategy: type) -> list[str]:
    """The lines of ``strategy``'s ``Args:`` section, unindented, generated from its ``OPTIONS``."""
    lines = ["Args:"]
    for option in strategy.OPTIONS:
        text = f"{option.name}: {_scope(strategy, option)}{_rst(option.doc)}"
        lines += textwrap.wrap(
            text,
            width=112,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return lines


def markdown_table(strategy: type, names: Iterable[str] | None = None) -> str:
    """The option table of ``strategy`` in Markdown: name, type, default, allowed values and doc.

    Args:
        strategy: a class decorated with :func:`with_options` (``DDPStrategy``, ``FSDPStrategy``,
            ``MultiGPUStrategy``).
        names: only these options, in the class's order; ``None`` for every option but the Trainer's plugins.

    Example::

        print(markdown_table(DDPStrategy))
    """
    wanted = None if names is None else set(names)
    rows = ["| option | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for option in strategy.OPTIONS:
        if option.set_by_trainer or (wanted is not None and option.name not in wanted):
            continue
        cells = (
            f"`{option.name}`",
            f"`{_type_name(option.annotation)}`" if option.default is not NO_DEFAULT else "",
            _default_cell(strategy, option),
            option.check.allowed if option.check is not None else "",
            _scope(strategy, option) + option.doc,
        )
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def _declared_name(parameter: inspect.Parameter) -> str:
    return f"**{parameter.name}" if parameter.kind is inspect.Parameter.VAR_KEYWORD else parameter.name


def _engine(option: Option) -> str | None:
    mine = [label for name, label in _ENGINES.items() if name in option.strategies]
    return mine[0] if len(mine) == 1 else None


def _scope(strategy: type, option: Option) -> str:
    # for a strategy that runs either engine (it takes options of each alone), the options of one engine only
    engines = {_engine(o) for o in strategy.OPTIONS} - {None}
    engine = _engine(option)
    return f"{engine} only: " if engine is not None and len(engines) > 1 else ""


def _rst(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def _insert_args(doc: str, section: list[str]) -> str:
    lines = doc.splitlines()
    for heading in ("Raises:", "Example::", "Examples::"):
        at = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
        if at is not None:
            indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
            return "\n".join([*lines[:at], *(indent + line for line in section), "", *lines[at:]])
    indent = "    " if len(lines) > 1 and lines[-1].startswith("    ") else ""
    return "\n".join([*lines, "", *(indent + line for line in section), indent])


def _default_cell(strategy: type, option: Option) -> str:
    if option.default is NO_DEFAULT:
        return ""
    own = option.default_for(strategy.__name__)
    others = [
        f"`{name}`: `{_value(option.default_for(name))}`"
        for name in option.strategies
        if name != strategy.__name__ and option.default_for(name) != own
    ]
    return f"`{_value(own)}`" + (f" ({', '.join(others)})" if others else "")


def _value(value: Any) -> str:
    if isinstance(value, timedelta):
        return f"timedelta(seconds={value.total_seconds():g})"
    return repr(value)


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        # the union's Literals written as one, where the first stands
        parts: list[str | None] = []
        literals: list[Any] = []
        for arg in args:
            if get_origin(arg) is not Literal:
                parts.append(_type_name(arg))
                continue
            if not literals:
                parts.append(None)
            literals += get_args(arg)
        merged = f"Literal[{', '.join(map(repr, literals))}]"
        return " | ".join(merged if part is None else part for part in parts)
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is not None:
        return f"{_type_name(origin)}[{', '.join(map(_type_name, args))}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", repr(annotation))


_ALL = (DDP, FSDP, MGPU)
_TRAINER_PLUGINS = (
    ("accelerator", Accelerator | None),
    ("parallel_devices", list[torch.device] | None),
    ("cluster_environment", ClusterEnvironment | None),
    ("checkpoint_io", CheckpointIO | None),
    ("precision_plugin", Precision | None),
)

# what every parallel engine takes: the Trainer's plugins, BatchNorm sync, activation checkpointing, the process group
ENGINE_OPTIONS: tuple[Option, ...] = (
    *(Option(name, hint, None, "set by the Trainer.", _ALL, set_by_trainer=True) for name, hint in _TRAINER_PLUGINS),
    Option(
        "sync_batchnorm",
        SyncBatchNormSetting,
        "auto",
        "`True` converts BatchNorm layers into `DistributedBatchNorm`, which synchronises their statistics across "
        "processes over gloo as well as NCCL; `'auto'` does so when the model has BatchNorm layers (under DDP, when "
        "more than one process trains too, and logs it).",
        _ALL,
        choice((True, False, "auto")),
        defaults={DDP: False},
    ),
    Option(
        "activation_checkpointing",
        Literal["auto"] | list[str] | None,
        None,
        "recompute these modules' activations in the backward instead of keeping them (torch's non-reentrant "
        "checkpoint), applied at `setup`: `'auto'` takes the model's repeated blocks, or name their classes.",
        _ALL,
        class_names(allow_none=True),
    ),
    Option("timeout", timedelta | None, default_pg_timeout, "the process group's timeout.", _ALL),
    Option(
        "process_group_backend",
        str | None,
        None,
        "`'gloo'`, `'nccl'`, ...; `None` picks gloo for CPU and NCCL for CUDA.",
        _ALL,
    ),
)
