import math

import pytest

from lightning_mgpu.core.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive,
    check_sequence,
    check_str,
)


def test_check_bool():
    assert check_bool("Owner", "flag", False) is False
    with pytest.raises(TypeError, match=r"^Owner: flag must be True or False, got 1$"):
        check_bool("Owner", "flag", 1)
    with pytest.raises(TypeError, match=r"^Owner: flag must be True or False, got None$"):
        check_bool("Owner", "flag", None)


def test_check_bool_with_none_allowed():
    assert check_bool("Owner", "flag", None, allow_none=True) is None
    assert check_bool("Owner", "flag", True, allow_none=True) is True
    with pytest.raises(TypeError, match=r"^Owner: flag must be True, False or None, got 'no'; say yes$"):
        check_bool("Owner", "flag", "no", allow_none=True, hint="say yes")


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (0, {"minimum": 1}, ValueError, r"^NaNSkip: n must be an int >= 1, got 0$"),
        (1.0, {"minimum": 1}, TypeError, r"^NaNSkip: n must be an int >= 1, got 1.0$"),
        (True, {}, TypeError, r"^NaNSkip: n must be an int, got True$"),
        (None, {"minimum": 1}, TypeError, r"^NaNSkip: n must be an int >= 1, got None$"),
        (11, {"minimum": 1, "maximum": 10}, ValueError, r"^NaNSkip: n must be an int >= 1 and <= 10, got 11$"),
        (
            0,
            {"minimum": 1, "allow_none": True, "hint": "use None for no limit"},
            ValueError,
            r"^NaNSkip: n must be an int >= 1 or None, got 0; use None for no limit$",
        ),
    ],
)
def test_check_int_refuses(value, kwargs, error, message):
    with pytest.raises(error, match=message):
        check_int("NaNSkip", "n", value, **kwargs)


def test_check_int_accepts():
    assert check_int("O", "n", 5, minimum=1, maximum=5) == 5
    assert check_int("O", "n", None, allow_none=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "error"),
    [
        (0, {}, ValueError),
        (-1.5, {}, ValueError),
        (math.nan, {}, ValueError),
        (math.inf, {}, ValueError),
        ("1", {}, TypeError),
        (False, {}, TypeError),
        (None, {}, TypeError),
    ],
)
def test_check_positive_refuses(value, kwargs, error):
    with pytest.raises(error, match=r"^O: x must be a positive number, got "):
        check_positive("O", "x", value, **kwargs)


def test_check_positive_accepts():
    assert check_positive("O", "x", 0.5) == 0.5
    assert check_positive("O", "x", math.inf, allow_inf=True) == math.inf
    assert check_positive("O", "x", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"must be a positive number or inf, got -inf"):
        check_positive("O", "x", -math.inf, allow_inf=True)


def test_check_choice():
    assert check_choice("O", "mode", "auto", (True, False, "auto")) == "auto"
    assert check_choice("O", "mode", True, (True, False, "auto")) is True
    with pytest.raises(ValueError, match=r"^O: mode must be one of 'loss', 'grads', got 'los'$"):
        check_choice("O", "mode", "los", ("loss", "grads"))
    with pytest.raises(TypeError, match=r"^O: mode must be one of True, False, 'auto', got 1$"):
        check_choice("O", "mode", 1, (True, False, "auto"))
    with pytest.raises(TypeError, match=r"must be one of 'loss', 'grads', got 3; say which"):
        check_choice("O", "mode", 3, ("loss", "grads"), hint="say which")


def test_check_positive_names_its_unit():
    with pytest.raises(ValueError, match=r"^O: size must be a positive number of MB or None, got 0; use None$"):
        check_positive("O", "size", 0, allow_none=True, unit="MB", hint="use None")


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (0, {"minimum": 0, "maximum": 100, "min_inclusive": False}, ValueError, r"a number in \(0, 100\], got 0$"),
        (101, {"minimum": 0, "maximum": 100, "min_inclusive": False}, ValueError, r"a number in \(0, 100\], got 101$"),
        (1.0, {"minimum": 0, "maximum": 1, "max_inclusive": False}, ValueError, r"a number in \[0, 1\), got 1.0$"),
        (-1, {"minimum": 0, "unit": "MiB"}, ValueError, r"a non-negative number of MiB, got -1$"),
        (0, {"minimum": 0, "min_inclusive": False}, ValueError, r"a positive number, got 0$"),
        (2, {"minimum": 3}, ValueError, r"a number >= 3, got 2$"),
        (3, {"minimum": 3, "min_inclusive": False}, ValueError, r"a number > 3, got 3$"),
        (5, {"maximum": 4}, ValueError, r"a number <= 4, got 5$"),
        (math.inf, {}, ValueError, r"a finite number, got inf$"),
        (math.nan, {"minimum": 0}, ValueError, r"a non-negative number, got nan$"),
        ("1", {"minimum": 0, "allow_none": True}, TypeError, r"a non-negative number or None, got '1'$"),
        (True, {}, TypeError, r"a finite number, got True$"),
        (None, {}, TypeError, r"a finite number, got None$"),
    ],
)
def test_check_number_refuses(value, kwargs, error, message):
    with pytest.raises(error, match=r"^O: x must be " + message):
        check_number("O", "x", value, **kwargs)


def test_check_number_accepts_the_bounds_it_includes():
    assert check_number("O", "x", 100, minimum=0, maximum=100, min_inclusive=False) == 100
    assert check_number("O", "x", 0, minimum=0) == 0
    assert check_number("O", "x", 0.5, minimum=0, maximum=1, min_inclusive=False, max_inclusive=False) == 0.5
    assert check_number("O", "x", None, minimum=0, allow_none=True) is None


def test_check_str():
    assert check_str("O", "prefix", "gpu") == "gpu"
    assert check_str("O", "prefix", "", allow_empty=True) == ""
    with pytest.raises(ValueError, match=r"^O: prefix must be a non-empty string, got ''$"):
        check_str("O", "prefix", "")
    with pytest.raises(TypeError, match=r"^O: prefix must be a string, got b'gpu'$"):
        check_str("O", "prefix", b"gpu", allow_empty=True)


def test_check_sequence_accepts_lists_tuples_and_sets():
    assert check_sequence("O", "names", ("a", "b"), "names", item_type=str) == ["a", "b"]
    assert check_sequence("O", "names", [], "names") == []
    assert sorted(check_sequence("O", "names", {"b", "a"}, "names", choices=("a", "b"))) == ["a", "b"]
    assert check_sequence("O", "names", None, "names", allow_none=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        ("a", {}, TypeError, r"a list of names, got 'a'$"),
        (None, {}, TypeError, r"a list of names, got None$"),
        ({"a": 1}, {}, TypeError, r"a list of names, got \{'a': 1\}$"),
        (["a", 2], {"item_type": str}, TypeError, r"a list of names, got \['a', 2\]; 2 is of type int$"),
        ([], {"allow_empty": False}, ValueError, r"a non-empty list of names, got \[\]$"),
        (["c"], {"choices": ("a", "b")}, ValueError, r"a list of names from 'a', 'b', got \['c'\]; 'c' is not among"),
        (
            [1],
            {"choices": ("a", "b"), "hint": "see the docs"},
            TypeError,
            r"a list of names from 'a', 'b', got \[1\]; 1 is not among them; see the docs$",
        ),
    ],
)
def test_check_sequence_refuses(value, kwargs, error, message):
    with pytest.raises(error, match=r"^O: names must be " + message):
        check_sequence("O", "names", value, "names", **kwargs)


def test_numpy_scalars_and_other_sequences_are_accepted_as_users_pass_them():
    import numpy as np
    from omegaconf import OmegaConf

    assert check_int("O", "n", np.int64(3), minimum=1) == 3
    assert check_positive("O", "x", np.float32(0.5)) == pytest.approx(0.5)
    assert check_bool("O", "flag", np.bool_(True)) is True
    with pytest.raises(TypeError, match="must be an int"):
        check_int("O", "n", np.bool_(True))
    patterns = OmegaConf.create({"exclude": ["head.*"]}).exclude  # what Hydra's instantiate passes
    assert check_sequence("O", "exclude", patterns, "name patterns", item_type=str) == ["head.*"]
    assert check_sequence("O", "keys", {"a": 1}.keys(), "names", item_type=str) == ["a"]
    with pytest.raises(TypeError, match="must be a list of name patterns"):
        check_sequence("O", "exclude", "head.*", "name patterns", item_type=str)


def test_a_str_enum_member_is_its_string_choice_and_a_bool_is_no_int_choice():
    import enum

    class Mode(str, enum.Enum):
        DDP = "ddp"
        DP = "dp"

    assert check_choice("Owner", "mode", Mode.DDP, ("ddp", "dp", "auto")) == "ddp"
    with pytest.raises(ValueError, match=r"Owner: mode must be one of 'ddp', 'auto', got <Mode.DP: 'dp'>"):
        check_choice("Owner", "mode", Mode.DP, ("ddp", "auto"))
    with pytest.raises(TypeError, match=r"Owner: steps must be one of 1, 2, got True"):
        check_choice("Owner", "steps", True, (1, 2))
