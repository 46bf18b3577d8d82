"""Per-step cost budgets: Python calls and bytecode instructions of a steady training step, counted, not timed.

``benchmarks/step_cost.py`` traces steps 20-40 of a fixed 2-process fit for stock DDP, ``mgpu``, ``mgpu`` with each of
the pack's callbacks alone and with all of them (one pair of processes for every configuration, 20-40 s). The counts
repeat from run to run (but for a few calls of the callbacks torch runs when a gloo collective completes, which the
budgets' margins cover), so the budgets in ``benchmarks/step_cost_budgets.json`` can be tight: ``mgpu`` adds nothing to
stock DDP, and each callback no more than its stated number. A change that goes over fails here, with the functions
that grew against ``benchmarks/step_cost_baseline.json``; after a change worth its cost, raise the budget and record
the new profile with ``python benchmarks/step_cost.py --write-baseline``. Where Python, torch or Lightning is not the
version the baseline was recorded with, the budgets get 2% of the compared figure on top and the test says to record
a new baseline.
"""

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers.processes import REPO

TOLERANCE_ON_OTHER_VERSIONS = 0.02


def _load_step_cost():
    # benchmarks/ is not a package, and its other scripts must not become importable for the rest of the session
    path = Path(REPO) / "benchmarks" / "step_cost.py"
    spec = importlib.util.spec_from_file_location("step_cost", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # for its own `from _common import ...`, while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


step_cost = _load_step_cost()


@pytest.fixture(scope="module")
def counts() -> dict:
    return step_cost.count(list(step_cost.CONFIGS))


def baseline() -> dict:
    return json.loads(step_cost.BASELINE.read_text())


def test_every_configuration_has_a_budget_and_a_baseline_profile():
    assert set(step_cost.budgets()) == set(step_cost.CONFIGS) - {"stock_ddp"}
    assert set(baseline()["configs"]) == set(step_cost.CONFIGS)
    assert set(baseline()["versions"]) == {"python", "torch", "lightning"}


@pytest.mark.distributed
def test_the_window_traced_every_step_of_every_configuration(counts):
    # a window of the wrong length, or a tracer that missed the training step, would pass every budget
    assert set(counts) == set(step_cost.CONFIGS)
    for config, entry in counts.items():
        assert entry["batches"] == step_cost.WINDOW[1] - step_cost.WINDOW[0], config
        steps = [calls for name, (calls, _) in entry["functions"].items() if name.endswith("Classifier.training_step")]
        assert steps == [1.0], config  # the model's training_step, once a step
    assert any("lightning_mgpu/stability/nan_skip.py" in name for name in counts["mgpu_nan_skip"]["functions"])


@pytest.mark.distributed
def test_no_configuration_goes_over_its_budget(counts):
    same_versions = step_cost.versions() == baseline()["versions"]
    tolerance = 0.0 if same_versions else TOLERANCE_ON_OTHER_VERSIONS
    over = step_cost.over_budget(counts, tolerance)
    if not same_versions:
        warnings.warn(
            f"step costs counted with {step_cost.versions()}, the baseline with {baseline()['versions']}: budgets get "
            f"{tolerance:.0%} on top; record a new baseline with `python benchmarks/step_cost.py --write-baseline`",
            stacklevel=1,
        )
    if over:
        details = []
        for line in over:
            config = line.split(":", 1)[0]
            details += [line, "  grew most against the baseline profile:"]
            details += [f"    {row}" for row in step_cost.grown_functions(counts, config, baseline()["configs"])]
        pytest.fail("\n".join(details), pytrace=False)


def test_the_docs_quote_the_recorded_baseline():
    # the costs the docs quote come from one place: the table in docs/performance.md shows the baseline's figures
    page = (Path(REPO) / "docs" / "performance.md").read_text()
    shown = page.split("<!-- step-cost-table: start -->", 1)[1].split("<!-- step-cost-table: end -->", 1)[0]
    quoted = {}
    for row in shown.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        quoted[cells[0].strip("`")] = (cells[1], cells[3])
    recorded = {
        config: (f"{entry['calls']:,.1f}", f"{entry['instructions']:,.1f}")
        for config, entry in baseline()["configs"].items()
    }
    assert quoted == recorded, (
        "docs/performance.md differs from benchmarks/step_cost_baseline.json: record both from one run with "
        "`python benchmarks/step_cost.py --write-baseline --wall-rounds 3 --markdown docs/performance.md`"
    )
