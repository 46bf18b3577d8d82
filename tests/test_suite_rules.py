"""Rules over the test suite itself, read from its source (no test is run): cheap checks for the kinds of defect a
review found in tests that could not fail for the reason their names give.

- A test that starts several processes carries the ``distributed`` mark (or sits in a ``*_distributed.py`` module,
  which ``tests/conftest.py`` marks), so the fast subset (``-m "not slow"``) leaves it out. GPU tests
  (``run_if(min_cuda_gpus=...)``, the ``cuda`` mark) are left to that mark.
- An assertion that bounds a wall-clock time from above by a plain number says, in a comment on it or just above it,
  which hang it catches; any other timing bound is relative (to an injected sleep or timeout, or to a reference
  measured in the same test).
- No comparison compares a value with itself, or with a copy of itself (``{**x, ...}`` against ``x``).

"Starts processes" is read from the source: a call of ``run_processes`` (but ``run_processes(fn, 1)``), of
``run_script``/``run_recorded_script`` on a script named at module level or with ``ranks``, of torch's ``spawn`` or a
``Process``; a ``subprocess`` call in a function that names a helper fit script or ``torchrun``; a ``Trainer`` built
with 2 or more CPU devices and a multi-process strategy in a function that runs a stage (``fit``, ``validate``,
``test``, ``predict``); or a call of a function of the suite, or a fixture, that does one of these.

The whole scan (about 100 files) takes about 0.3-0.5 s on 2 cores.
"""

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).parent
PROCESS_CALLS = {"run_processes", "run_script", "run_recorded_script", "spawn", "start_processes", "Process"}
SUBPROCESS_CALLS = {"Popen", "run", "check_output", "check_call"}
STAGES = {"fit", "validate", "test", "predict"}
# names whose value is a duration (seconds, elapsed, waited, ..._ms, ..._s) or a time (start, ended, ..._at, ..._time)
DURATION_NAME = re.compile(
    r"(^|_)(seconds|elapsed|waited|duration|wall)($|_)|_ms$|^ms$|_s$|^(start|started|end|ended|now)$|_at$|_time$"
)
CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns"}
COMPARISON_HELPERS = re.compile(r"^(assert\w*|equal|allclose|isclose|max_difference)$")
MULTI_PROCESS_STRATEGY = re.compile(r"ddp|fsdp|mgpu|DDPStrategy|FSDPStrategy|MultiGPUStrategy|strategy", re.I)
ONE_PROCESS_STRATEGY = re.compile(r"\bdp\b|DataParallel|mode=['\"](dp|single)")


@dataclass
class Module:
    path: Path
    tree: ast.Module
    lines: list[str]
    functions: dict[str, "Function"] = field(default_factory=dict)  # module level, and methods as Class.name
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module path, name)
    globals: set[str] = field(default_factory=set)  # names assigned or imported at module level
    helper_scripts: set[str] = field(default_factory=set)  # module-level names bound to a path under helpers/


@dataclass
class Function:
    """What the rules need of one function of the suite (a test, a helper or a fixture), from one walk of it."""

    module: Module
    node: ast.FunctionDef
    calls: set[str] = field(default_factory=set)  # functions called by name, and methods of its class (Class.name)
    starts: bool = False  # starts processes (itself, then through what it calls: see _propagate)
    asserts: list[ast.Assert] = field(default_factory=list)
    comparisons: list[ast.AST] = field(default_factory=list)  # Compare nodes and calls of comparison helpers


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""


def _starts_processes(module: Module, call: ast.Call, name: str) -> bool:
    """Whether a call of one of :data:`PROCESS_CALLS` starts several processes."""
    if _dotted(call.func).startswith(("os.", "self.")):
        return False
    keywords = {k.arg: k.value for k in call.keywords}
    if name == "run_processes":
        size = call.args[1] if len(call.args) > 1 else keywords.get("world_size")
        return not (isinstance(size, ast.Constant) and size.value == 1)
    if name in ("run_script", "run_recorded_script"):
        # a script named at module level is a helper fit script or an example (2 devices); one the test wrote, one
        script = call.args[0] if call.args else None
        named = script is not None and any(isinstance(n, ast.Name) and n.id in module.globals for n in ast.walk(script))
        return named or "ranks" in keywords
    return True


def _is_multi_process_trainer(call: ast.Call) -> bool:
    """``Trainer(devices=N>=2, strategy=...)`` on the CPU with a strategy that starts processes."""
    keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
    devices, accelerator, strategy = keywords.get("devices"), keywords.get("accelerator"), keywords.get("strategy")
    if not (isinstance(devices, ast.Constant) and isinstance(devices.value, int) and devices.value >= 2):
        return False
    if isinstance(accelerator, ast.Constant) and accelerator.value not in ("cpu", "auto"):
        return False  # a GPU test
    text = ast.unparse(strategy) if strategy is not None else ""
    return bool(MULTI_PROCESS_STRATEGY.search(text)) and not ONE_PROCESS_STRATEGY.search(text)


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` (itself included), in no particular order: ``ast.walk``'s nodes, in half its time."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for name in current._fields:
            value = getattr(current, name, None)
            if value.__class__ is list:
                stack.extend(item for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)


def _scan(module: Module, node: ast.FunctionDef, owner: str) -> "Function":
    function = Function(module, node)
    called: list[tuple[str, ast.Call]] = []
    local: set[str] = set()  # names bound in the function shadow the module's: their calls are not followed
    trainer = stage = subprocess_call = names_script = False
    for child in _walk(node):
        kind = child.__class__
        if kind is ast.Call:
            name = _called_name(child)
            if name is None:
                continue
            called.append((name, child))
            if name in PROCESS_CALLS and _starts_processes(module, child, name):
                function.starts = True
            elif name in SUBPROCESS_CALLS and _dotted(child.func).startswith("subprocess."):
                subprocess_call = True
            elif name in STAGES:
                stage = True
            elif name == "Trainer":
                trainer = trainer or _is_multi_process_trainer(child)
            if COMPARISON_HELPERS.match(name):
                function.comparisons.append(child)
        elif kind is ast.Name:
            if child.ctx.__class__ is ast.Store:
                local.add(child.id)
            elif child.id in module.helper_scripts:
                names_script = True
        elif kind is ast.Compare:
            function.comparisons.append(child)
        elif kind is ast.Assert:
            function.asserts.append(child)
        elif kind is ast.FunctionDef and child is not node:
            local.add(child.name)
        elif kind is ast.Constant and isinstance(child.value, str) and "torchrun" in child.value:
            names_script = True
    for name, call in called:
        func = call.func
        if func.__class__ is ast.Name and name not in local:
            function.calls.add(name)
        elif owner and func.__class__ is ast.Attribute and getattr(func.value, "id", None) == "self":
            function.calls.add(f"{owner}.{name}")
    function.starts = function.starts or (trainer and stage) or (subprocess_call and names_script)
    return function


def _parse(path: Path) -> Module:
    source = path.read_text()
    module = Module(path, ast.parse(source), source.splitlines())
    for node in module.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module.globals.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
            target = str(TESTS.parent / Path(*node.module.split("."))) + ".py"
            module.imported.update({alias.asname or alias.name: (target, alias.name) for alias in node.names})
        elif isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            module.globals.update(names)
            if any(isinstance(n, ast.Constant) and "helpers" in str(n.value) for n in _walk(node.value)):
                module.helper_scripts.update(names)
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module.functions[node.name] = _scan(module, node, "")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    module.functions[f"{node.name}.{item.name}"] = _scan(module, item, node.name)
    return module


def _resolve(modules: dict[str, Module], module: Module, name: str) -> Function | None:
    if name in module.functions:
        return module.functions[name]
    path, original = module.imported.get(name, ("", ""))
    return modules[path].functions.get(original) if path in modules else None


def _propagate(modules: dict[str, Module]) -> None:
    """A function that calls one that starts processes does too, and so does a test or fixture that takes such a
    fixture; repeated until nothing changes. Calls of run_script & co are judged where they are made."""
    conftests = [m for p, m in modules.items() if p.endswith("conftest.py")]
    links: list[tuple[Function, list[Function]]] = []
    for module in modules.values():
        for function in module.functions.values():
            arguments = [a.arg for a in function.node.args.args]
            linked = [_resolve(modules, module, name) for name in (*(function.calls - PROCESS_CALLS), *arguments)]
            linked += [c.functions.get(name) for c in conftests for name in arguments]
            links.append((function, [other for other in linked if other is not None]))
    changed = True
    while changed:
        changed = False
        for function, others in links:
            if not function.starts and any(other.starts for other in others):
                function.starts = changed = True


def _marks_in(text: str) -> set[str]:
    """The marks ``pytest.mark.<name>`` in ``text``; ``run_if(...)`` stands for the ``cuda`` mark (see conftest.py)."""
    return set(re.findall(r"pytest\.mark\.(\w+)", text)) | ({"cuda"} if "run_if(" in text else set())


def _tests(modules: dict[str, Module]) -> Iterator[tuple[str, Module, Function, set[str]]]:
    """Every test function, with the marks it carries (its own, its class's, its module's)."""
    for module in modules.values():
        if not module.path.name.startswith("test_"):
            continue
        module_marks: set[str] = set()
        classes: dict[str, set[str]] = {}
        for node in module.tree.body:
            if isinstance(node, ast.Assign) and "pytestmark" in {getattr(t, "id", "") for t in node.targets}:
                module_marks = _marks_in(ast.unparse(node.value))
            elif isinstance(node, ast.ClassDef):
                classes[node.name] = _marks_in(" ".join(ast.unparse(d) for d in node.decorator_list))
        for qualified, function in module.functions.items():
            owner, _, name = qualified.rpartition(".")
            if name.startswith("test_") and (not owner or owner.startswith("Test")):
                own = _marks_in(" ".join(ast.unparse(d) for d in function.node.decorator_list))
                yield (
                    f"{module.path.relative_to(TESTS.parent)}::{qualified}",
                    module,
                    function,
                    (module_marks | classes.get(owner, set()) | own),
                )


def _mentions_a_duration(node: ast.AST) -> bool:
    for child in ast.walk(node):
        if isinstance(child, ast.Call) and _called_name(child) in CLOCKS and "time" in _dotted(child.func):
            return True
        if isinstance(child, ast.Name):
            name = child.id
        elif isinstance(child, ast.Attribute):
            name = child.attr
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            name = child.value  # a subscript's key: result["seconds"], window["fwd_bwd_ms"]
        else:
            continue
        if DURATION_NAME.search(name):
            return True
    return False


def _is_plain_number(node: ast.AST) -> bool:
    return not any(isinstance(child, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) for child in ast.walk(node))


def _comment_says(module: Module, node: ast.stmt, word: str, above: int = 3) -> bool:
    lines = module.lines[max(0, node.lineno - 1 - above) : node.end_lineno]
    return any("#" in line and word in line.split("#", 1)[1].lower() for line in lines)


def _bare_timing_bounds(module: Module, function: Function) -> Iterator[str]:
    for node in function.asserts:
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, sides[:-1], sides[1:], strict=True):
                if isinstance(op, (ast.Gt, ast.GtE)):
                    left, right = right, left
                elif not isinstance(op, (ast.Lt, ast.LtE)):
                    continue
                if _mentions_a_duration(left) and _is_plain_number(right) and not _comment_says(module, node, "hang"):
                    yield f"{module.path.relative_to(TESTS.parent)}:{node.lineno}: {ast.unparse(node.test)}"


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


def _copies(container: ast.AST, value: ast.AST) -> bool:
    """``container`` is a dict display that copies ``value`` (``{**value, ...}``)."""
    return isinstance(container, ast.Dict) and any(
        key is None and _same(item, value) for key, item in zip(container.keys, container.values, strict=True)
    )


def _self_comparisons(module: Module, function: Function) -> Iterator[str]:
    for node in function.comparisons:
        if isinstance(node, ast.Compare):
            if not isinstance(node.ops[0], (ast.Eq, ast.Is, ast.LtE, ast.GtE)):
                continue
            sides = [node.left, *node.comparators]
        else:
            sides = list(node.args)
        for i, a in enumerate(sides):
            for b in sides[i + 1 :]:
                # a constant, or an expression that calls something (a fresh value each time), may be repeated
                fresh = isinstance(a, ast.Constant) or any(isinstance(n, ast.Call) for n in ast.walk(a))
                if (_same(a, b) and not fresh) or _copies(a, b) or _copies(b, a):
                    yield f"{module.path.relative_to(TESTS.parent)}:{node.lineno}: {ast.unparse(node)}"


MODULES = {str(path): _parse(path) for path in sorted(TESTS.rglob("*.py"))}
_propagate(MODULES)
TESTS_FOUND = list(_tests(MODULES))


def test_the_scan_finds_the_suite_and_each_way_of_starting_processes():
    assert len(TESTS_FOUND) > 500
    starters = {test.split("/")[-1] for test, _, function, _ in TESTS_FOUND if function.starts}
    for known in (
        "test_fsdp_distributed.py::test_norm_clipping_under_fsdp_equals_ddp",  # run_recorded_script, in a fixture
        "test_ddp.py::test_trainer_sync_batchnorm_flag_works_on_cpu",  # a ddp_spawn Trainer, in a helper
        "test_gradient_clipping.py::test_two_processes_clip_alike",  # a ddp_spawn Trainer in the test
        "test_uneven_data.py::test_fit_stopped_mid_epoch_waits_for_a_rank_slow_in_on_train_end",  # an imported helper
        "test_exact_resume.py::test_killed_rank_resumes_bit_identical_and_stock_lightning_does_not",  # a fixture
        "test_hang_watch.py::test_stock_lightning_in_the_same_case_names_no_rank_and_leaves_the_run_hanging",  # Popen
        "test_grad_allreduce.py::test_gradients_are_the_mean_over_ranks",  # run_processes, in a fixture
        "test_progress_bar.py::test_two_ranks_fields_add_no_collective_and_rank_zero_alone_shows_the_peak",  # ranks=2
    ):
        assert known in starters, known
    for one_process in (
        "test_multi_gpu.py::test_slurm_environment_means_ddp",  # a 2-device Trainer built, no stage run
        "test_step_flag_registration.py::test_the_strategy_carries_the_flag_where_it_can_and_says_where_it_cannot",
        "test_hang_watchdog.py::test_a_hung_process_exits_with_the_hang_code_and_leaves_a_report",  # its own script
        "test_exact_resume.py::test_an_iterable_dataset_resumed_mid_epoch_says_once_why_it_starts_over",  # local fit
    ):
        assert one_process not in starters, one_process


def test_every_test_that_starts_processes_is_marked_distributed():
    unmarked = [
        test
        for test, module, function, marks in TESTS_FOUND
        if function.starts and not marks & {"distributed", "cuda"} and not module.path.stem.endswith("_distributed")
    ]
    assert not unmarked, "start processes but lack @pytest.mark.distributed:\n" + "\n".join(unmarked)


def test_every_wall_clock_bound_is_relative_or_names_the_hang_it_catches():
    bare = [bound for _, module, function, _ in TESTS_FOUND for bound in _bare_timing_bounds(module, function)]
    assert not bare, "bound a time by a plain number, with no comment naming the hang:\n" + "\n".join(bare)


def test_no_test_compares_a_value_with_itself():
    found = [hit for _, module, function, _ in TESTS_FOUND for hit in _self_comparisons(module, function)]
    assert not found, "compare a value with itself or a copy of itself:\n" + "\n".join(found)
