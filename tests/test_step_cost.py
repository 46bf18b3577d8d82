"""Per-step cost budgets: Python calls and bytecode instructions of a steady training step, counted, not timed.

``benchmarks/step_cost.py`` traces steps 20-40 of a fixed 2-process fit for stock DDP, ``mgpu``, ``mgpu`` with each of
the pack's callbacks alone and with all of them (one pair of processes for every configuration, about 40 s). The
counts are deterministic, so the budgets in ``benchmarks/step_cost_budgets.json`` can be tight: ``mgpu`` adds nothing
to stock DDP, and each callback no more than its stated number. A change that goes over fails here, with the
functions that grew against ``benchmarks/step_cost_baseline.json``; after a deliberate change, raise the budget and
record the new profile with ``python benchmarks/step_cost.py --write-baseline``.
"""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import REPO

BENCHMARKS = Path(REPO) / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import step_cost  # noqa: E402  (benchmarks/ is not a package: its scripts import each other by path)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def counts() -> dict:
    return step_cost.count(list(step_cost.CONFIGS))


def test_every_configuration_has_a_budget_and_a_baseline_profile():
    assert set(step_cost.budgets()) == set(step_cost.CONFIGS) - {"stock_ddp"}
    assert set(json.loads(step_cost.BASELINE.read_text())) == set(step_cost.CONFIGS)


def test_the_counts_are_what_ran(counts):
    # a tracer that traced nothing, or a window of the wrong length, would pass every budget
    assert set(counts) == set(step_cost.CONFIGS)
    assert all(counts[config]["calls"] > 500 and counts[config]["instructions"] > 5_000 for config in counts)
    nan_skip = counts["mgpu_nan_skip"]["functions"]
    assert any("lightning_mgpu/callbacks/nan_skip.py" in name for name in nan_skip)


def test_no_configuration_goes_over_its_budget(counts):
    over = step_cost.over_budget(counts)
    if over:
        baseline = json.loads(step_cost.BASELINE.read_text())
        details = []
        for line in over:
            config = line.split(":", 1)[0]
            details += [line, "  grew most against the baseline profile:"]
            details += [f"    {row}" for row in step_cost.grown_functions(counts, config, baseline)]
        pytest.fail("\n".join(details), pytrace=False)
