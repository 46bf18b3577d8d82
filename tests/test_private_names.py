"""No module but those of ``lightning_mgpu/core/compat/`` reaches a private name of Lightning, torch or torchmetrics.

A private name is one starting with a single underscore that those libraries define. The scan reads the package's
source: imports of private names, attribute reads and writes (on ``self`` too, when the class inherits the attribute
from one of those libraries), names passed as strings to ``getattr``/``hasattr``/``setattr``/``__dict__``, and
methods that override a private method of a base class from those libraries.
"""

import ast
import contextlib
import importlib
import inspect
import pathlib
import re

import lightning
import torch
import torchmetrics

import lightning_mgpu

PACKAGE = pathlib.Path(lightning_mgpu.__file__).parent
COMPAT = PACKAGE / "core" / "compat"  # the door: a package of one module per library part
# calls that take an attribute name as a string
LOOKUPS = ("getattr", "hasattr", "setattr", "delattr", "attrgetter", "get", "pop", "setdefault")
# namedtuple's documented API, underscored so as not to clash with field names
NAMEDTUPLE_API = ("_fields", "_asdict", "_replace", "_make", "_field_defaults")
FOREIGN_PACKAGES = ("lightning", "torch", "torchmetrics", "pytorch_lightning", "lightning_fabric")
_DEFINITION = re.compile(r"(?:self|cls)\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=[^=]|def (_[A-Za-z]\w*)|class (_[A-Za-z]\w*)")


def _foreign_private_names() -> set[str]:
    """Private names that Lightning, torchmetrics and torch define in Python (names defined in C are caught only when
    reached from the module, ``torch._foreach_norm``)."""
    roots = [pathlib.Path(module.__file__).parent for module in (lightning, torchmetrics, torch)]
    roots_files = [p for root in roots for p in root.rglob("*.py")]
    names: set[str] = set()
    for path in roots_files:
        for match in _DEFINITION.finditer(path.read_text(errors="ignore")):
            names.update(group for group in match.groups() if group)
    return names


def _package_modules() -> list[tuple[pathlib.Path, str]]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        modules.append((path, name))
    return modules


def _foreign(cls: type) -> bool:
    return cls.__module__.split(".")[0] in FOREIGN_PACKAGES


def _own_private_names(modules: list[tuple[pathlib.Path, str]]) -> set[str]:
    """Private names the package defines itself: its functions and classes, and attributes it sets."""
    own: set[str] = set()
    for path, _ in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                own.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")  # set on another object, a name may be a library's
            ):
                own.add(node.attr)
    return own


def _is_private(name: str) -> bool:
    # set by metaclasses (ABCMeta, autograd's Function), not by the package
    return name.startswith("_") and not name.startswith("__") and name not in ("_abc_impl", "_backward_cls")


def _defined_by(base: type) -> set[str]:
    """The private names a library class defines: class attributes and methods, and what its methods set on self."""
    names = {name for name in vars(base) if _is_private(name)}
    with contextlib.suppress(OSError, TypeError):  # classes defined in C have no source
        names.update(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=[^=]", inspect.getsource(base)))
    return names


def _strings_used_as_names(tree: ast.AST) -> set[int]:
    """The string constants a lookup uses as a name: getattr(x, "_a"), x.__dict__["_a"], attrgetter("b._a")..."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in LOOKUPS:
                found.update(
                    id(arg) for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                )
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            found.add(id(node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            found.update(id(n) for n in (node.left,) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return found


def _violations() -> list[str]:
    foreign = _foreign_private_names()
    modules = _package_modules()
    # a name both the package and a library define is taken as the package's on any object but self (below);
    # the scan cannot tell whose it is from the source alone
    own = _own_private_names(modules)
    found = []
    for path, module_name in modules:
        tree = ast.parse(path.read_text())
        module = importlib.import_module(module_name)
        foreign_modules = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.split(".")[0] in FOREIGN_PACKAGES
        }
        foreign_modules |= {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOREIGN_PACKAGES
            for alias in node.names
            if inspect.ismodule(getattr(module, alias.asname or alias.name, None))
        }
        where = f"{path.relative_to(PACKAGE.parent)}"
        names_in_lookups = _strings_used_as_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOREIGN_PACKAGES:
                for alias in node.names:
                    if _is_private(alias.name) or any(_is_private(part) for part in node.module.split(".")):
                        found.append(f"{where}:{node.lineno}: imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue  # judged per class, below
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                from_module = isinstance(root, ast.Name) and root.id in foreign_modules
                # on another object than self, a name both the package and a library define counts as the library's
                if from_module or node.attr in foreign:
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in FOREIGN_PACKAGES and any(_is_private(part) for part in parts):
                        found.append(f"{where}:{node.lineno}: imports {alias.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) in names_in_lookups:
                parts = [part for part in node.value.split(".") if _is_private(part) and part not in NAMEDTUPLE_API]
                if any(part in foreign and part not in own for part in parts):
                    found.append(f"{where}:{node.lineno}: {node.value!r}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module_name:
                continue
            bases = [base for base in cls.__mro__[1:] if _foreign(base)]
            inherited = set().union(*(_defined_by(base) for base in bases)) if bases else set()
            for name in vars(cls):
                if _is_private(name) and name in inherited:
                    found.append(f"{where}: {cls.__name__}.{name} overrides a private name of {bases[0].__name__}")
            for name in set(re.findall(r"(?:self|cls)\.(_[A-Za-z]\w*)", inspect.getsource(cls))):
                if name in inherited and name not in vars(cls):
                    found.append(f"{where}: {cls.__name__} uses the inherited private self.{name}")
    return sorted(set(found))


def test_no_private_library_name_outside_the_compatibility_module():
    assert _violations() == []


def test_the_scan_finds_a_private_name(tmp_path, monkeypatch):
    # the scan itself must fail on each kind of use it claims to catch
    module = PACKAGE / "core" / "_scan_probe.py"
    module.write_text(
        "import torch\n"
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "from torch.nn.modules.batchnorm import _BatchNorm\n\n\n"
        "def norms(xs):\n    return torch._foreach_norm(xs)\n\n\n"
        "def step(trainer):\n    return trainer.fit_loop.epoch_loop._batches_that_stepped\n\n\n"
        "def timeout(strategy):\n    return getattr(strategy, '_timeout', None)\n\n\n"
        "def fused(optimizer):\n    return getattr(optimizer, '_step_supports_amp_scaling', False)\n\n\n"
        "def buffers(ddp):\n    ddp._sync_buffers()\n\n\n"
        "def reset():\n    import torch._dynamo\n\n\n"
        "class Mine(DDPStrategy):\n"
        "    def _configure_launcher(self):\n        pass\n\n"
        "    def kwargs(self):\n        return self._ddp_kwargs\n"
    )
    try:
        found = "\n".join(_violations())
    finally:
        module.unlink()
    for expected in (
        "imports torch.nn.modules.batchnorm._BatchNorm",
        "._foreach_norm",
        "._batches_that_stepped",
        "'_timeout'",
        "'_step_supports_amp_scaling'",
        "._sync_buffers",  # torch DDP's, on another object than self
        "imports torch._dynamo",
        "Mine._configure_launcher overrides",
        "Mine uses the inherited private self._ddp_kwargs",
    ):
        assert expected in found, (expected, found)
