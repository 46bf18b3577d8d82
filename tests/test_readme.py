"""The README and the pages of ``docs/``, run as a reader runs them, so that they cannot drift from what the pack does.

- Every ```` ```python ```` block runs in a fresh interpreter, from the repository root, as a file of its own (so
  that Lightning can launch it again for the other ranks). The comment lines right after a line starting with
  ``print(`` are what it must print; ``...`` stands for anything.
- Every command of a ```` ```bash ```` block runs with bash from the repository root, and the comment lines right
  after a command are what it must print. Three exceptions: ``pip install`` is never run, it is checked against
  what ``.ci/run`` installs; ``python -m pytest`` is collected, not run (``-n 0 --collect-only -q`` appended: the suite
  cannot run itself); a command that trains for long gets the overrides of ``SHORT_OVERRIDES`` appended (the test
  prints them).
- A plain block preceded by ``<!-- readme-test: output of `COMMAND` -->`` is the output of that bash command:
  its lines must appear in that order in what the command prints, any number standing for any number.
- Every ```` ```yaml ```` block parses. A whole config (one with ``trainer:``) is built through
  ``MGPULightningCLI(run=False)`` with the examples' model and data; a fragment agrees with the shipped ``base``
  config on every key it names.
- A block that cannot run here (one that needs CUDA GPUs) is preceded by ``<!-- readme-test: skip (REASON) -->``:
  it is reported as skipped with its reason, and there may be only a few.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lightning_mgpu.configs import config_path
from tests.helpers.processes import LAUNCHER_VARIABLES, REPO

ROOT = Path(REPO)
README = ROOT / "README.md"
# the README, then every page of the docs site
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
CI_SCRIPT = ROOT / ".ci" / "run"
BLOBS_CONFIG = ROOT / "examples" / "configs" / "blobs.yaml"
LANGUAGES = {"python", "bash", "yaml", ""}  # "": plain text (output, layout); any other language fails the suite
MAX_SKIPPED_BLOCKS = 3
# appended to a README command that starts with the key, unless it prints a config: commands that train for long
SHORT_OVERRIDES = {"python examples/cli.py fit": "--trainer.max_epochs=1"}
TIMEOUT_S = 240

SKIP_MARK = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<reason>.+)\)\s*-->$")
OUTPUT_MARK = re.compile(r"^<!--\s*readme-test:\s*output of `(?P<command>.+)`\s*-->$")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Block:
    """A fenced code block of the README or of a docs page."""

    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    section: str
    skip: str | None  # the reason given in a readme-test skip mark
    output_of: str | None  # the command given in a readme-test output mark
    mark_line: int | None  # the line of that mark
    page: str = "README.md"  # relative to the repository root

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:40]
        where = "" if self.page == "README.md" else re.sub(r"[^a-z0-9]+", "-", self.page[:-3].lower()) + "-"
        return f"{where}{self.lang or 'text'}-line{self.line}-{slug}"

    @property
    def where(self) -> str:
        """``PAGE line N``, for messages."""
        return f"{self.page} line {self.line}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of ``text``, with its section heading and the readme-test mark on the line before it."""
    blocks: list[Block] = []
    section, previous, previous_line, fence = "", "", 0, None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if fence is not None:
            if stripped == "```":
                blocks.append(Block(fence[0], "\n".join(fence[3]), fence[1], section, *fence[2], page=page))
                fence = None
            else:
                fence[3].append(line)
            continue
        if stripped.startswith("```"):
            skip, output = SKIP_MARK.match(previous), OUTPUT_MARK.match(previous)
            marks = (skip and skip.group("reason"), output and output.group("command"))
            fence = (stripped[3:].strip(), number, (*marks, previous_line if skip or output else None), [])
        elif line.startswith("#"):
            section = line.lstrip("#").strip()
        if stripped:
            previous, previous_line = stripped, number
    assert fence is None, f"{page}: the block opened at line {fence[1]} is never closed"
    return blocks


BLOCKS = [block for page in PAGES for block in readme_blocks(page.read_text(), str(page.relative_to(ROOT)))]


def blocks(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang]


def params(chosen: list[Block], slow: Callable[[Block], bool]) -> list:
    """``chosen`` as pytest parameters named after their line and section, marked slow where ``slow`` says so."""
    return [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if slow(b) else []) for b in chosen]


def expected_lines(code: str, after: Callable[[str], bool]) -> list[tuple[str, str]]:
    """``(line, expected)`` for each comment line that follows, with only comments between, a line ``after`` accepts."""
    pairs, owner = [], None
    for line in code.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and owner is not None:
            pairs.append((owner, stripped[1:].strip()))
        else:
            owner = stripped if stripped and after(stripped) else None
    return pairs


def wildcard_pattern(expected: str) -> str:
    """A regex for one expected line: ``...`` is anything on the line."""
    return ".*?".join(re.escape(part) for part in expected.split("..."))


def assert_prints(output: str, expected: list[tuple[str, str]], where: str) -> None:
    for owner, line in expected:
        assert re.search(wildcard_pattern(line), output), (
            f"{where}: `{owner}` should print a line with {line!r}; it printed:\n{output[-4000:]}"
        )


def reader_env() -> dict[str, str]:
    """A reader's environment: no launcher variables left over from other tests, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(
        OMP_NUM_THREADS="1", COLUMNS="80", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    )
    env.pop("PYTHONPATH", None)
    return env


def run(command: list[str], timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """Run from the repository root; kill the whole process group (launched ranks included) after ``timeout``."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=reader_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{shlex.join(command)} still ran after {timeout} s:\n{output.decode(errors='replace')[-4000:]}")
    return proc.returncode, output.decode(errors="replace")


def skip_if_marked(block: Block) -> None:
    if block.skip:
        pytest.skip(f"{block.where}: {block.skip}")


# --- the blocks ---------------------------------------------------------------------------------------------------


def test_every_block_is_in_a_language_this_test_runs():
    unknown = [f"{b.where}: ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"blocks this test does not run: {unknown}; teach tests/test_readme.py their language"
    # the parser found the blocks: a README without them would pass every test below
    assert len(blocks("python")) >= 5 and len(blocks("bash")) >= 3 and len(blocks("yaml")) >= 2


def test_the_parser_reads_languages_sections_marks_and_expected_output():
    text = """# Title
## Use
<!-- readme-test: skip (needs CUDA GPUs) -->

```python
x = 1
print(x)  # a remark, not output
# 1
# ...done
y = 2
# a remark after a line that is not a print
```
```bash
python run.py --a \\
    --b  # trailing remark
# printed ... line
```
<!-- readme-test: output of `python run.py --a --b` -->
```
printed 3 lines
```
"""
    python, bash, text_block = readme_blocks(text)
    assert (python.lang, python.line, python.section, python.skip, python.mark_line) == (
        "python",
        5,
        "Use",
        "needs CUDA GPUs",
        3,
    )
    assert expected_lines(python.code, lambda line: line.startswith("print(")) == [
        ("print(x)  # a remark, not output", "1"),
        ("print(x)  # a remark, not output", "...done"),
    ]
    [(command, expected)] = commands(bash.code)
    assert strip_comment(command) == "python run.py --a --b"
    assert expected == [(command, "printed ... line")] and bash.skip is None
    assert text_block.output_of == "python run.py --a --b" and text_block.lang == ""
    assert re.fullmatch(wildcard_pattern("printed ... line"), "printed 3 lines, one line")
    assert strip_comment("echo 'a # b' # c") == "echo 'a # b'"


def test_blocks_that_cannot_run_here_are_few_and_say_why():
    skipped = [b for b in BLOCKS if b.skip]
    for block in skipped:
        print(f"{block.where} ({block.section}): skipped, {block.skip}")
    assert len(skipped) <= MAX_SKIPPED_BLOCKS, [f"{b.where}: {b.skip}" for b in skipped]
    # a mark this test does not understand, or one not right before a block, would be silently ignored
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        lines = page.read_text().splitlines()
        marks = {n for n, line in enumerate(lines, start=1) if line.strip().startswith("<!-- readme-test:")}
        found = {b.mark_line for b in BLOCKS if b.mark_line and b.page == name}
        assert marks == found, (name, [lines[n - 1] for n in marks - found])


@pytest.mark.parametrize("block", params(blocks("python"), lambda b: True))  # a fresh interpreter: slow
def test_python_block_runs_and_prints_what_its_comments_say(block, tmp_path):
    skip_if_marked(block)
    script = tmp_path / f"{Path(block.page).stem}_line{block.line}.py"
    script.write_text(block.code + "\n")
    rc, output = run([sys.executable, str(script)])
    assert rc == 0, f"{block.where} ({block.section}) failed:\n{block.code}\n---\n{output[-4000:]}"
    assert_prints(output, expected_lines(block.code, lambda line: line.startswith("print(")), block.where)


# --- bash: pip is checked against CI, the rest is run -------------------------------------------------------------


def commands(code: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The commands of a bash block (continuation lines joined), each with the output lines expected from it."""
    joined = re.sub(r"\\\n\s*", "", code)
    result = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            result.append((stripped, []))
        elif stripped.startswith("#") and result:
            result[-1][1].append((result[-1][0], stripped[1:].strip()))
    return result


def strip_comment(command: str) -> str:
    """``command`` without a trailing ``# comment`` (a ``#`` outside quotes, after whitespace)."""
    quote = None
    for i, char in enumerate(command):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command


def ci_test_command() -> list[str]:
    """The README's test command as ``.ci/run`` runs it (its first stage): the ``pip install`` parts, then pytest."""
    stage = CI_SCRIPT.read_text().split("\ndeactivate")[0].splitlines()
    pip = next(line for line in stage if line.startswith("pip install torch"))
    pytest_line = next(line for line in stage if line.startswith("python -m pytest"))
    return [part.strip() for part in pip.split("&&")] + [pytest_line.split("||")[0].strip()]


def extras_closure(names: set[str]) -> set[str]:
    """The extras ``names`` of lightning-mgpu install, following ``lightning-mgpu[...]`` inside them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        assert name in optional, f"pyproject.toml has no extra {name!r}"
        if name not in seen:
            seen.add(name)
            for requirement in optional[name]:
                inner = re.fullmatch(r"lightning-mgpu\[(.+)\]", requirement)
                todo += inner.group(1).split(",") if inner else []
    return seen


def pip_parts() -> list[tuple[Block, str]]:
    found = []
    for block in blocks("bash"):
        for command, _ in commands(block.code):
            found += [(block, p.strip()) for p in strip_comment(command).split("&&") if "pip install" in p]
    return found


def test_the_readme_test_command_is_what_ci_runs():
    readme = [
        [part.strip() for part in strip_comment(c).split("&&")]
        for b in blocks("bash")
        for c, _ in commands(b.code)
        if "pytest" in c and "pip install" in c and b.page == "README.md"
    ]
    assert readme == [ci_test_command()], f"README's test command {readme} differs from .ci/run's {ci_test_command()}"


def test_every_pip_install_in_the_readme_installs_what_ci_installs():
    torch_ci = next(part for part in ci_test_command() if part.startswith("pip install torch"))
    # every extra some stage of .ci/run installs: the test extra for the suite, the docs extra for the site
    named = {name for found in re.findall(r'-e "\.\[(.+?)\]"', CI_SCRIPT.read_text()) for name in found.split(",")}
    ci_extras = extras_closure(named)
    parts = pip_parts()
    assert len(parts) >= 4, parts  # two set-up commands, two installs each
    for block, part in parts:
        where = f"{block.where}: {part!r}"
        if re.match(r"pip install torch\b", part):
            assert part == torch_ci, f"{where}: .ci/run installs {torch_ci!r}"
        else:
            extras = re.fullmatch(r'pip install -e "\.\[(.+)\]"', part)
            assert extras, f"{where}: only torch and this package's extras are installed by the set-up commands"
            assert extras_closure(set(extras.group(1).split(","))) <= ci_extras, f"{where}: CI does not install it"
    # the CPU wheel note (inline, not run: it reaches outside the project's registries) pins the same torch
    inline = [c for page in PAGES for c in re.findall(r"`(pip install torch[^`]*)`", page.read_text())]
    assert inline and all(c.split(" --")[0].strip() == torch_ci for c in inline), inline


def outputs_of(command: str) -> list[Block]:
    return [b for b in BLOCKS if b.output_of == command]


def assert_output_block(output: str, block: Block) -> None:
    """Every line of ``block`` appears, in order, as a whole line of ``output``; any number stands for any number."""
    position = 0
    for line in block.code.splitlines():
        if not line.strip():
            continue
        pieces = NUMBER.split(line)
        pattern = r"\d+(?:\.\d+)?".join(re.escape(piece) for piece in pieces)
        found = re.compile(rf"^{pattern}\s*$", re.MULTILINE).search(output, position)
        assert found, (
            f"{block.where}: {line!r} is not in the output (after offset {position}):\n" + (output[position:][-4000:])
        )
        position = found.end()


def runnable(command: str) -> list[str]:
    """The parts of a command line that the test runs: all but ``pip install``."""
    return [p.strip() for p in strip_comment(command).split("&&") if "pip install" not in p]


# a block that the README and a docs page both hold (a set-up command) runs once
RUN_BLOCKS: list[Block] = []
for _block in blocks("bash"):
    if any(runnable(c) for c, _ in commands(_block.code)) and all(b.code != _block.code for b in RUN_BLOCKS):
        RUN_BLOCKS.append(_block)


@pytest.mark.parametrize("block", params(RUN_BLOCKS, lambda b: True))
def test_bash_block_commands_run_and_print_what_the_readme_says(block):
    skip_if_marked(block)
    ran = 0
    for command, expected in commands(block.code):
        for part in runnable(command):
            shown = part
            if re.match(r"python -m pytest\b", part):
                part += " -n 0 --collect-only -q"  # the suite cannot run itself: check that the selection is valid
            for prefix, override in SHORT_OVERRIDES.items():
                if part.startswith(prefix) and "--print_config" not in part:
                    part = f"{part} {override}"
            if part != shown:
                print(f"{block.where}: running `{shown}` with `{part[len(shown) :].strip()}` appended")
            rc, output = run(["bash", "-c", part])
            assert rc == 0, f"{block.where}: `{part}` exited with {rc}:\n{output[-4000:]}"
            if "--collect-only" in part:
                collected = re.search(r"(\d+)(?:/\d+)? tests collected", output)
                assert collected and int(collected.group(1)) > 0, output[-2000:]
            assert_prints(output, expected, block.where)
            for output_block in outputs_of(shown):
                assert_output_block(output, output_block)
            ran += 1
    assert ran, f"{block.where}: no command ran"


def test_every_output_block_belongs_to_a_command_the_readme_runs():
    run_by_the_test = {part for b in RUN_BLOCKS for c, _ in commands(b.code) for part in runnable(c)}
    for block in BLOCKS:
        if block.output_of:
            assert block.output_of in run_by_the_test, f"{block.where}: no block runs {block.output_of!r}"


# --- YAML ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", params(blocks("yaml"), lambda b: False))
def test_yaml_block_parses_and_fragments_agree_with_the_shipped_configs(block):
    parsed = yaml.safe_load(block.code)
    assert isinstance(parsed, dict), f"{block.where}: not a mapping"
    if "trainer" in parsed:
        return  # a whole config: built below
    base = yaml.safe_load(config_path("base").read_text())
    for key, value in parsed.items():
        assert base.get(key) == value, f"{block.where}: {key}: {value!r}; base has {base.get(key)!r}"


CONFIG_BLOCKS = [b for b in blocks("yaml") if re.search(r"^trainer:", b.code, re.MULTILINE)]


@pytest.mark.parametrize("block", params(CONFIG_BLOCKS, lambda b: False))
def test_yaml_config_block_builds_through_the_cli_with_the_examples_model_and_data(block, tmp_path, monkeypatch):
    from lightning_mgpu import MultiGPUStrategy
    from lightning_mgpu.cli import MGPULightningCLI

    skip_if_marked(block)
    config = tmp_path / "my_trainer.yaml"
    config.write_text(block.code)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # blobs.yaml names blobs.BlobClassifier
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # pytest's own flags are not the CLI's
    args = ["--config", str(config), "--config", str(BLOBS_CONFIG), "--global_batch_size=128"]
    cli = MGPULightningCLI(args=args, run=False)

    parsed = yaml.safe_load(block.code)["trainer"]
    assert isinstance(cli.trainer.strategy, MultiGPUStrategy)
    for name, value in parsed["strategy"].get("init_args", {}).items():
        strategy = cli.trainer.strategy
        assert getattr(strategy, name, strategy.ddp_kwargs.get(name)) == value, name
    for name, value in parsed["strategy"].get("dict_kwargs", {}).items():
        assert cli.trainer.strategy.ddp_kwargs[name] == value, name
    named = {c["class_path"].rsplit(".", 1)[1] for c in parsed.get("callbacks", [])}
    assert named <= {type(c).__name__ for c in cli.trainer.callbacks}
    # the examples' data reads ${per_device_batch_size}: 128 samples over the config's 2 processes
    assert cli.datamodule.batch_size == 128 // parsed["devices"], cli.datamodule.batch_size
