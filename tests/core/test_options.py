"""The strategy options are declared once: every signature, docstring and README table agrees with the declarations."""

import importlib.util
import inspect
from typing import Any, Literal

import pytest

from lightning_mgpu import DDPStrategy, FSDPStrategy, MultiGPUStrategy
from lightning_mgpu.core.options import (
    NO_DEFAULT,
    Check,
    Option,
    boolean,
    choice,
    integer,
    markdown_table,
    validate,
    with_options,
)
from tests.helpers.processes import REPO

STRATEGIES = [DDPStrategy, FSDPStrategy, MultiGPUStrategy]
# the options nothing checks: what the Trainer sets, what Lightning checks itself, what DDPStrategy checks on its own
UNCHECKED = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "timeout",
    "process_group_backend",
    "**kwargs",
}


def _signature(strategy: type) -> dict[str, inspect.Parameter]:
    parameters = list(inspect.signature(strategy.__init__).parameters.values())[1:]  # without self
    return {f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name: p for p in parameters}


def _gen_options():
    spec = importlib.util.spec_from_file_location("gen_options", f"{REPO}/docs/gen_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.__name__)
def test_the_signature_agrees_with_the_declarations(strategy):
    signature = _signature(strategy)
    declared = {option.name: option for option in strategy.OPTIONS}
    assert list(declared) == list(signature)  # the same names, in the signature's order
    for name, option in declared.items():
        parameter = signature[name]
        assert parameter.annotation == option.annotation, name
        assert parameter.default == option.default_for(strategy.__name__), name
        if option.default is NO_DEFAULT:
            assert parameter.kind is parameter.VAR_KEYWORD, name


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.__name__)
def test_every_option_has_a_doc_line_in_the_args_section_and_a_check(strategy):
    doc = inspect.getdoc(strategy)
    args = doc.index("\nArgs:\n")
    assert args < doc.index("\nRaises:\n") < doc.index("\nExample::\n")
    for option in strategy.OPTIONS:
        assert option.doc.strip() and option.doc.endswith("."), option.name
        assert f"\n    {option.name}: " in doc[args:], option.name
        assert (option.check is None) == (option.name in UNCHECKED), option.name
    assert doc.count("\nArgs:\n") == 1


def test_each_option_is_declared_once_and_shared():
    by_name: dict[str, Option] = {}
    for strategy in STRATEGIES:
        for option in strategy.OPTIONS:
            assert by_name.setdefault(option.name, option) is option, option.name
            assert strategy.__name__ in option.strategies
    for option in by_name.values():
        for name in option.strategies:  # the strategies an option names all take it
            assert option in next(s for s in STRATEGIES if s.__name__ == name).OPTIONS, (option.name, name)
    assert by_name["sync_batchnorm"].default_for("DDPStrategy") is False
    assert by_name["sync_batchnorm"].default_for("MultiGPUStrategy") == "auto"
    assert by_name["bucket_cap_mb"].default_for("MultiGPUStrategy") == "auto"


def test_the_docs_option_tables_are_the_generated_ones():
    gen_options = _gen_options()
    texts = {page.name: page.read_text() for page in gen_options.pages()}
    assert sum(text.count("<!-- generated: options of ") for text in texts.values()) == 3
    for name, text in texts.items():
        assert gen_options.regenerate(text) == text, f"{name} is stale: run python docs/gen_options.py --readme"
    text = texts["options.md"]
    stale = text.replace("| `powersgd_rank` | `int` | `1` |", "| `powersgd_rank` | `int` | `2` |")
    assert stale != text and gen_options.regenerate(stale) == text


def test_the_table_of_a_strategy():
    table = markdown_table(MultiGPUStrategy).splitlines()
    assert table[0] == "| option | type | default | allowed | meaning |"
    rows = {row.split(" | ")[0][3:-1]: row for row in table[2:]}
    assert list(rows) == [o.name for o in MultiGPUStrategy.OPTIONS if not o.set_by_trainer]
    assert rows["sync_batchnorm"].startswith(
        "| `sync_batchnorm` | `bool \\| Literal['auto']` | `'auto'` (`DDPStrategy`: `False`) "
        "| `True`, `False`, `'auto'` |"
    )
    assert "| FSDP only: " in rows["sharding"] and "| DDP only: " in rows["comm_hook"]
    assert " only: " not in markdown_table(DDPStrategy) + markdown_table(FSDPStrategy)  # one engine: no marks
    assert markdown_table(DDPStrategy, ["start_method"]).count("\n") == 2


def test_validate_checks_in_order_and_across_options():
    with pytest.raises(TypeError, match=r"^Owner: a must be True or False, got 1$"):
        validate("Owner", [Option("a", bool, False, "a.", ("X",), boolean()), _never("b")], {"a": 1, "b": 0})
    with pytest.raises(ValueError, match=r"^MultiGPUStrategy: sharding must be one of 'full'.*got 'zero3'$"):
        MultiGPUStrategy(sharding="zero3")  # checked by MultiGPUStrategy itself, in every mode
    with pytest.raises(ValueError, match=r"^DDPStrategy: comm_hook_candidates=\['bf16'\] only applies"):
        DDPStrategy(comm_hook_candidates=["bf16"])
    with pytest.raises(ValueError, match=r"^DDPStrategy: comm_hook='auto' chooses the hook itself"):
        DDPStrategy(comm_hook="auto", ddp_comm_hook=print)  # a keyword argument passed on, seen by the check


def _never(name: str) -> Option:
    def run(*_: Any) -> None:
        raise AssertionError(f"{name} is checked after the first bad option")

    return Option(name, int, 0, f"{name}.", ("X",), Check("anything", run))


def test_with_options_orders_by_the_signature_and_writes_the_args_section():
    first = Option("first", int, 1, "the `first` one.", ("Demo",), integer(0))
    second = Option("second", Literal["x", "y"], "x", "the second.", ("Demo", "Other"), choice(("x", "y")))
    elsewhere = Option("elsewhere", int, 0, "not the demo's.", ("Other",))

    @with_options((second, first, elsewhere))
    class Demo:
        """A demo.

        Raises:
            ValueError: never.
        """

        def __init__(self, first: int = 1, second: Literal["x", "y"] = "x") -> None:
            validate("Demo", Demo.OPTIONS, locals())

    assert (first, second) == Demo.OPTIONS
    assert inspect.getdoc(Demo) == (
        "A demo.\n\nArgs:\n    first: the ``first`` one.\n    second: the second.\n\nRaises:\n    ValueError: never."
    )
    with pytest.raises(ValueError, match=r"^Demo: second must be one of 'x', 'y', got 'z'$"):
        Demo(second="z")
