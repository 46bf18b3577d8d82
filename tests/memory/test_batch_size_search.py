"""``BatchSizeSearch``: every rank agrees on a micro-batch that fits, and the batch per optimizer step is kept."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mgpu import BatchSizeSearch, MultiGPUStrategy
from lightning_mgpu.memory.batch_search import BatchSizeSearchError, next_size, search_micro_batch
from tests.helpers.processes import run_recorded_script
from tests.helpers.trainer import QUIET

SCRIPT = Path(__file__).parents[1] / "helpers" / "batch_search_fit.py"


def fit(out: Path, *args: object) -> dict:
    return run_recorded_script(SCRIPT, out, *args, ranks=2)


def test_sizes_are_divisors_about_halving_and_every_rank_must_fit():
    assert [next_size(24, size) for size in (24, 12, 6, 3)] == [12, 6, 3, 1]
    assert next_size(7, 7) == 1 and next_size(8, 1) is None and next_size(32, 16, min_size=10) is None
    answers = []
    result = search_micro_batch(
        32, lambda size: size <= 20, lambda fits: answers.append(fits) or (fits and len(answers) > 2)
    )
    assert (result.size, result.accumulation) == (8, 4)  # 16 fits here but not on another rank
    assert result.trials == [(32, False), (16, False), (8, True)]
    tried = r"per-device batch 12 fits on every rank \(tried 12, 6, 3, min_size=3\)"
    with pytest.raises(BatchSizeSearchError, match=tried):
        search_micro_batch(12, lambda size: False, lambda fits: fits, min_size=3)


@pytest.mark.distributed
def test_an_oom_on_one_rank_gives_both_the_same_micro_batch_and_the_same_training(tmp_path):
    searched = fit(tmp_path / "searched", "--search", "--batch", 8, "--limit-rank1", 3)
    reference = fit(tmp_path / "reference", "--batch", 2, "--accumulate", 4)
    expected = {"batch_size": 2, "accumulate": 4, "steps": 5, "sizes_seen": [2]}
    assert searched["ranks"] == [expected, expected]
    assert "micro-batch 2 x 4 accumulated steps keeps it" in searched["output"]
    assert "8 does not fit, 4 does not fit, 2 fits" in searched["output"]
    for name, value in reference["state"].items():
        torch.testing.assert_close(searched["state"][name], value, rtol=0, atol=1e-6)


@pytest.mark.distributed
def test_when_the_batch_fits_the_run_is_the_same_as_without_the_callback(tmp_path):
    searched = fit(tmp_path / "searched", "--search", "--batch", 8)
    plain = fit(tmp_path / "plain", "--batch", 8)
    assert searched["ranks"] == plain["ranks"]
    assert "the per-device batch 8 fits (8 fits)" in searched["output"]
    # the trial's dropout draws, BatchNorm statistics and gradients were all put back
    assert all(torch.equal(searched["state"][name], value) for name, value in plain["state"].items())


class Batched(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4


@pytest.mark.parametrize(
    ("module", "callbacks", "strategy", "match"),
    [
        (BoringModel(), [], None, r"batch_arg_name='batch_size'.*neither the model"),
        (Batched(), [GradientAccumulationScheduler({0: 2})], None, "remove the GradientAccumulationScheduler"),
        (Batched(), [], MultiGPUStrategy(mode="fsdp"), r"does not run under FSDPStrategy.*memory_budget_mb"),
    ],
)
def test_what_cannot_work_is_refused_at_setup(module, callbacks, strategy, match):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy or "auto",
        max_steps=1,
        callbacks=[BatchSizeSearch(), *callbacks],
        **QUIET,
    )
    with pytest.raises(MisconfigurationException, match=match):
        trainer.fit(module)


def test_an_attribute_the_loader_does_not_read_is_refused():
    class Mismatch(BoringModel):  # BoringModel's loader has batches of 1 whatever the attribute says
        batch_size = 4

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[BatchSizeSearch()], **QUIET)
    with pytest.raises(MisconfigurationException, match=r"first batch has 1 samples, but batch_size=4"):
        trainer.fit(Mismatch())


def test_manual_optimization_is_refused():
    class Manual(Batched):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[BatchSizeSearch()], **QUIET)
    with pytest.raises(MisconfigurationException, match="needs automatic optimization"):
        trainer.fit(Manual())


@pytest.mark.parametrize(("kwargs", "error"), [({"min_size": 0}, ValueError), ({"batch_arg_name": 3}, TypeError)])
def test_bad_options_fail_at_construction(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        BatchSizeSearch(**kwargs)
