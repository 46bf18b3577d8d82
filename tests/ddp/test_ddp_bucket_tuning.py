"""The fit-time side of ``bucket_cap_mb="auto"``/``comm_hook="auto"`` (``DDPBucketTuning``), on 2 gloo processes."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu import DDPStrategy, MultiGPUStrategy, OOMBackoff
from tests.helpers.models import finished_fits_survive_exit_aborts, load_rank_dumps
from tests.helpers.trainer import QUIET, fit_apart, in_process_start

pytestmark = pytest.mark.distributed


class SeededBoringModel(BoringModel):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()

    def on_fit_start(self) -> None:
        torch.manual_seed(self.global_rank)


class DumpTuning(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)

    def on_fit_end(self, trainer, pl_module):
        tuning = trainer.strategy.bucket_tuning
        state = {"ddp_kwargs": trainer.strategy.ddp_kwargs, "reason": tuning.reason, "trials": sorted(tuning.step_ms)}
        torch.save(state, Path(self.directory) / f"rank{trainer.global_rank}.pt")


def test_a_retuned_wrap_keeps_the_users_init_sync(tmp_path):
    # the trial wraps are built with init_sync=False; the user's own value must be what later wraps get again
    strategy = DDPStrategy(comm_hook="auto", bucket_tuning_steps=10, init_sync=False, start_method=in_process_start())
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=-1,
        max_steps=100,
        limit_val_batches=0,
        callbacks=[DumpTuning(tmp_path)],
        **QUIET,
    )
    with finished_fits_survive_exit_aborts(tmp_path):
        fit_apart(trainer_kwargs, SeededBoringModel())
    for dump in load_rank_dumps(tmp_path):
        assert dump["reason"] == "tuned"
        assert dump["trials"] == ["default", "default+fp16"]  # DDP was re-wrapped for the hook's trial
        assert dump["ddp_kwargs"]["init_sync"] is False


# one-process fits through the strategy: what DDPBucketTuning decides not to tune
def fit_one_process(strategy: DDPStrategy, tmp_path, callbacks=()) -> DDPStrategy:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=400,
        limit_val_batches=0,
        callbacks=list(callbacks),
        default_root_dir=tmp_path,
        **QUIET,
    )
    trainer.fit(BoringModel())
    return trainer.strategy


def test_one_process_has_nothing_to_tune(tmp_path):
    strategy = fit_one_process(DDPStrategy(bucket_cap_mb="auto", comm_hook="auto", bucket_tuning_steps=10), tmp_path)
    assert strategy.bucket_tuning.reason == "one process: no gradients are communicated"
    assert strategy.bucket_tuning.bucket_cap_mb is None


def test_oom_backoff_keeps_tuning_when_its_flag_rides_in_ddps_reduction(tmp_path):
    strategy = fit_one_process(DDPStrategy(bucket_cap_mb="auto", bucket_tuning_steps=10), tmp_path, [OOMBackoff()])
    assert strategy.bucket_tuning.reason == "one process: no gradients are communicated"  # not OOMBackoff's


def test_oom_backoff_turns_tuning_off_when_its_flag_cannot_ride(tmp_path):
    # DDP's unused-parameter search keeps state a failed step could not be finished in: no flag, micro-batch path
    strategy = DDPStrategy(bucket_cap_mb="auto", bucket_tuning_steps=10, find_unused_parameters=True)
    strategy = fit_one_process(strategy, tmp_path, [OOMBackoff()])
    assert strategy.bucket_tuning.reason == "OOMBackoff averages gradients outside DDP's buckets"


def test_a_stateful_hook_is_not_re_wrapped(tmp_path):
    strategy = fit_one_process(
        DDPStrategy(bucket_cap_mb="auto", comm_hook="powersgd", bucket_tuning_steps=10), tmp_path
    )
    assert strategy.bucket_tuning.reason.startswith("comm_hook='powersgd' keeps error feedback per bucket")


def test_fixed_settings_are_never_tuned(tmp_path):
    strategy = fit_one_process(DDPStrategy(bucket_cap_mb=5, comm_hook="bf16"), tmp_path)
    assert strategy.bucket_tuning is None
    assert strategy.ddp_kwargs["bucket_cap_mb"] == 5


def test_multi_gpu_strategy_tunes_by_default():
    strategy = MultiGPUStrategy()
    assert strategy.bucket_cap_mb == "auto" and strategy.tunes_buckets
    assert strategy.bucket_tuning_steps == 30
    assert not MultiGPUStrategy(bucket_cap_mb=None).tunes_buckets
