"""One way to check a constructor option: ``TypeError`` for a wrong type, ``ValueError`` for a wrong value.

Every message names the class, the parameter, the value given and what is allowed, and may end with a hint:
``NaNSkip: max_consecutive must be an int >= 1 or None, got 0; use None for no limit``.

Example::

    owner = type(self).__name__
    check_int(owner, "max_consecutive", max_consecutive, minimum=1, allow_none=True, hint="use None for no limit")
    check_choice(owner, "check", check, ("loss", "grads", "both"))
"""

import math
import numbers
from collections.abc import Collection, Sequence, Set
from typing import Any

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_positive",
    "check_sequence",
    "check_str",
]

# what check_sequence takes as "a list": any sequence or set (omegaconf's ListConfig, dict keys too), but a str is
# one value, not a list of characters
_SEQUENCE_TYPES = (Sequence, Set)
_TEXT_TYPES = (str, bytes)


def _fail(
    error: type[Exception], owner: str, name: str, allowed: str, value: Any, hint: str, detail: str = ""
) -> Exception:
    # "Owner: name must be <allowed>, got <value>[; detail][; hint]"
    return error(
        "; ".join(part for part in (f"{owner}: {name} must be {allowed}, got {value!r}", detail, hint) if part)
    )


def _is_bool(value: Any) -> bool:
    # numpy's bool_ is no int subclass: recognised by its dtype
    return isinstance(value, bool) or (
        getattr(value, "shape", None) == () and str(getattr(value, "dtype", "")) == "bool"
    )


def _is_number(value: Any) -> bool:
    # numbers.Real covers numpy and torch-free scalar types that register with it; a bool is not a number here
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _of(unit: str) -> str:
    return f" of {unit}" if unit else ""


def check_bool(owner: str, name: str, value: Any, allow_none: bool = False, hint: str = "") -> bool | None:
    """Return ``value`` if it is ``True`` or ``False`` (or ``None`` when allowed).

    Raises:
        TypeError: anything else, ``1`` and ``"yes"`` included.
    """
    if value is None and allow_none:
        return None
    if _is_bool(value):
        return bool(value)
    raise _fail(TypeError, owner, name, "True, False or None" if allow_none else "True or False", value, hint)


def check_int(
    owner: str,
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    hint: str = "",
) -> int | None:
    """Return ``value`` if it is an int within ``[minimum, maximum]`` (or ``None`` when allowed).

    Raises:
        TypeError: not an int (a bool is not an int here), or ``None`` where it is not allowed.
        ValueError: outside the bounds.
    """
    bounds = " and ".join(
        part
        for part in (f">= {minimum}" if minimum is not None else "", f"<= {maximum}" if maximum is not None else "")
        if part
    )
    allowed = f"an int {bounds}".rstrip() + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise _fail(TypeError, owner, name, allowed, value, hint)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _fail(ValueError, owner, name, allowed, value, hint)
    return value


def check_positive(
    owner: str,
    name: str,
    value: Any,
    allow_inf: bool = False,
    allow_none: bool = False,
    unit: str = "",
    hint: str = "",
) -> float | None:
    """Return ``value`` if it is a finite number > 0 (``inf`` too when allowed, ``None`` when allowed).

    ``unit`` goes into the message: ``"MB"`` gives "must be a positive number of MB".

    Raises:
        TypeError: not an int or float (a bool is not a number here).
        ValueError: zero, negative, NaN, or infinite where that is not allowed.
    """
    allowed = f"a positive number{_of(unit)}" + (" or inf" if allow_inf else "") + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if not _is_number(value):
        raise _fail(TypeError, owner, name, allowed, value, hint)
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise _fail(ValueError, owner, name, allowed, value, hint)
    return value


def check_number(
    owner: str,
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    allow_none: bool = False,
    unit: str = "",
    hint: str = "",
) -> float | None:
    """Return ``value`` if it is a finite number within the bounds (or ``None`` when allowed).

    The bounds are inclusive unless ``min_inclusive``/``max_inclusive`` say otherwise; the message writes them as an
    interval: ``a number of samples per second in (0, 100]``, ``a non-negative number of MiB``.

    Raises:
        TypeError: not an int or float (a bool is not a number here).
        ValueError: NaN, infinite, or outside the bounds.
    """
    of = _of(unit)
    if minimum is not None and maximum is not None:
        interval = f"{'[' if min_inclusive else '('}{minimum}, {maximum}{']' if max_inclusive else ')'}"
        allowed = f"a number{of} in {interval}"
    elif minimum == 0:
        allowed = f"a {'non-negative' if min_inclusive else 'positive'} number{of}"
    elif minimum is not None:
        allowed = f"a number{of} {'>=' if min_inclusive else '>'} {minimum}"
    elif maximum is not None:
        allowed = f"a number{of} {'<=' if max_inclusive else '<'} {maximum}"
    else:
        allowed = f"a finite number{of}"
    allowed += " or None" if allow_none else ""
    if value is None and allow_none:
        return None
    if not _is_number(value):
        raise _fail(TypeError, owner, name, allowed, value, hint)
    below = minimum is not None and (value < minimum if min_inclusive else value <= minimum)
    above = maximum is not None and (value > maximum if max_inclusive else value >= maximum)
    if not math.isfinite(value) or below or above:
        raise _fail(ValueError, owner, name, allowed, value, hint)
    return value


def check_choice(owner: str, name: str, value: Any, choices: Collection[Any], hint: str = "") -> Any:
    """Return ``value`` if it is one of ``choices``; raise ``ValueError`` naming them all otherwise.

    A value of another type than every choice (``3`` for a string option) is a ``TypeError``.
    """
    allowed = "one of " + ", ".join(map(repr, choices))
    # a str-valued Enum member is its string; True is no choice of 1 (bool is an int subclass)
    if any(
        value == choice and isinstance(value, type(choice)) and _is_bool(value) == _is_bool(choice)
        for choice in choices
    ):
        return value
    if not any(isinstance(value, type(choice)) and _is_bool(value) == _is_bool(choice) for choice in choices):
        raise _fail(TypeError, owner, name, allowed, value, hint)
    raise _fail(ValueError, owner, name, allowed, value, hint)


def check_str(
    owner: str, name: str, value: Any, allow_empty: bool = False, hint: str = "", what: str | None = None
) -> str:
    """Return ``value`` if it is a string (a non-empty one unless ``allow_empty``).

    Args:
        owner: the class, for the message.
        name: the parameter.
        value: what was given.
        allow_empty: whether ``""`` is allowed.
        hint: appended to the message.
        what: what the message says is allowed ("a non-empty string" by default).

    Raises:
        TypeError: not a str.
        ValueError: an empty string where it is not allowed.
    """
    allowed = what or ("a string" if allow_empty else "a non-empty string")
    if not isinstance(value, str):
        raise _fail(TypeError, owner, name, allowed, value, hint)
    if not value and not allow_empty:
        raise _fail(ValueError, owner, name, allowed, value, hint)
    return value


def check_sequence(
    owner: str,
    name: str,
    value: Any,
    items: str,
    item_type: type | tuple[type, ...] | None = None,
    choices: Collection[Any] | None = None,
    allow_empty: bool = True,
    allow_none: bool = False,
    hint: str = "",
) -> list[Any] | None:
    """Return ``value`` as a list if it is a list, tuple or set whose every item is allowed (``None`` when allowed).

    Args:
        owner: the class named in the message.
        name: the parameter.
        value: what was given.
        items: what the items are, for the message: ``"name patterns"`` gives "must be a list of name patterns".
        item_type: the type every item must have; ``None`` for any.
        choices: the values an item may take (listed in the message); ``None`` for any.
        allow_empty: accept an empty list.
        allow_none: accept ``None`` (returned as is).
        hint: appended to the message.

    Raises:
        TypeError: not a list, tuple or set (a str is one value, not a list), or an item that is not an
            ``item_type``, or of another type than every choice.
        ValueError: an empty list where it is not allowed, or an item that is not among ``choices``.
    """
    allowed = f"{'a' if allow_empty else 'a non-empty'} list of {items}"
    if choices is not None:
        allowed += " from " + ", ".join(map(repr, choices))
    allowed += " or None" if allow_none else ""
    if value is None and allow_none:
        return None
    if not isinstance(value, _SEQUENCE_TYPES) or isinstance(value, _TEXT_TYPES):
        raise _fail(TypeError, owner, name, allowed, value, hint)
    if item_type is not None:
        for item in value:
            if not isinstance(item, item_type):
                raise _fail(TypeError, owner, name, allowed, value, hint, f"{item!r} is of type {type(item).__name__}")
    if not value and not allow_empty:
        raise _fail(ValueError, owner, name, allowed, value, hint)
    if choices is not None:
        for item in value:
            if any(item == choice and type(item) is type(choice) for choice in choices):
                continue
            error = TypeError if not any(isinstance(item, type(choice)) for choice in choices) else ValueError
            raise _fail(error, owner, name, allowed, value, hint, f"{item!r} is not among them")
    return list(value)
