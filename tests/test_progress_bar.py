"""The pack's headline figures in Lightning's progress bar, from real fits: each field's value after ``fit``, how
often it is logged (a ``self.log`` call costs ~0.6 ms: only on logging steps, or when the number changes), that it
goes to the bar alone and is never synchronised, and that nothing is logged without a bar or with
``progress_bar=False``."""

import json
import math
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu import GPUMemoryMonitor, GradientClipping, NaNSkip, OOMBackoff
from lightning_mgpu.memory.gpu_memory_monitor import peak_memory_mb, summarize_across_ranks
from tests.helpers.models import BatchNormClassifier
from tests.helpers.oom_models import IndexedRegression
from tests.helpers.processes import run_script
from tests.helpers.trainer import QUIET, RecordingLogger

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"skipped", "micro_bs", "peak_mem_mb", "grad_norm"}
BAR_ONLY = {"prog_bar": True, "logger": False, "on_step": True, "on_epoch": False, "sync_dist": False}


class BarCall(NamedTuple):
    step: int  # the trainer's global step when the field was logged
    name: str
    value: float
    options: dict[str, Any]


@pytest.fixture
def bar_calls(monkeypatch) -> list[BarCall]:
    """Every ``self.log(..., prog_bar=True)`` call of the fit, recorded before Lightning handles it."""
    calls: list[BarCall] = []
    original = LightningModule.log

    def log(self, name, value, *args, **kwargs):
        if kwargs.get("prog_bar"):
            options = {key: kwargs[key] for key in (*BAR_ONLY, "rank_zero_only") if key in kwargs}
            calls.append(BarCall(self.trainer.global_step, name, float(value), options))
        return original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LightningModule, "log", log)
    return calls


def assert_bar_only(calls: list[BarCall], rank_zero_only: bool = False) -> None:
    for call in calls:
        assert call.options == {**BAR_ONLY, "rank_zero_only": rank_zero_only}, call


def fit(tmp_path, model, callbacks, bar=True, logger=None, **kwargs) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **{**QUIET, "enable_progress_bar": bar, "logger": logger or False},
        **kwargs,
    )
    trainer.fit(model)
    return trainer


class LoudModel(BoringModel):
    """BoringModel with large gradients, so that clipping clips."""

    def training_step(self, batch, batch_idx):
        return {"loss": self.step(batch) * 100.0}


class SlowModel(BoringModel):
    """A step long enough for the monitor's sampler to see it."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("progress_bar", [True, False])
def test_nan_skip_shows_the_steps_skipped_so_far(tmp_path, bar_calls, progress_bar):
    # the loss is NaN at step 2 of 5; log_every_n_steps=2 makes steps 1 and 3 the logging steps
    nan_skip = NaNSkip(progress_bar=progress_bar)
    model = BatchNormClassifier((8,), steps=5, inject=("loss_nan", 0, 2))
    trainer = fit(tmp_path, model, [nan_skip], max_steps=5, log_every_n_steps=2)
    assert nan_skip.skipped_steps == 1
    if not progress_bar:
        assert "skipped" not in trainer.progress_bar_metrics
        assert bar_calls == []
        return
    assert trainer.progress_bar_metrics["skipped"] == 1.0
    # refreshed at the end of the logging steps only, never in between
    assert [(call.step, call.name, call.value) for call in bar_calls] == [(2, "skipped", 0.0), (4, "skipped", 1.0)]
    assert_bar_only(bar_calls)


@pytest.mark.parametrize("progress_bar", [True, False])
def test_oom_backoff_shows_the_backed_off_micro_batch_size(tmp_path, bar_calls, progress_bar):
    # every batch of 8 runs out of memory above 4 samples: backed off at the first batch, kept for 2 epochs
    backoff = OOMBackoff(progress_bar=progress_bar)
    trainer = fit(tmp_path, IndexedRegression(oom_above=4), [backoff], max_epochs=2, log_every_n_steps=1)
    assert backoff.micro_batch_size == 4 and trainer.global_step == 8
    if not progress_bar:
        assert "micro_bs" not in trainer.progress_bar_metrics
        assert bar_calls == []
        return
    assert trainer.progress_bar_metrics["micro_bs"] == 4.0
    assert [(call.step, call.name, call.value) for call in bar_calls] == [(1, "micro_bs", 4.0)]  # one change, one call
    assert_bar_only(bar_calls)


def test_oom_backoff_shows_the_batch_size_until_a_backoff_and_again_after_a_probe_climbs_back(tmp_path, bar_calls):
    # 36 samples in batches of 8 (the last one 4): an OOM above 4 at the first step only, a probe after 2 good batches
    backoff = OOMBackoff(probe_up_after=2)
    model = IndexedRegression(num_samples=36, oom_above=4, oom_until_step=1)
    trainer = fit(tmp_path, model, [backoff], max_epochs=2, log_every_n_steps=1)
    assert backoff.recoveries == 1 and backoff.micro_batch_size is None  # the probe went back to the whole batch
    assert trainer.progress_bar_metrics["micro_bs"] == 8.0  # not the short last batch's 4
    assert [call.value for call in bar_calls] == [4.0, 8.0]


@pytest.mark.parametrize("progress_bar", [True, False])
def test_gpu_memory_monitor_shows_the_host_peak_rss_without_a_gpu(tmp_path, bar_calls, progress_bar):
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False, progress_bar=progress_bar)
    trainer = fit(tmp_path, SlowModel(), [monitor], max_steps=10, log_every_n_steps=5)
    logged_peak = monitor.last_logged["gpu_monitor/host/peak_rss_mb"]
    if not progress_bar:
        assert "peak_mem_mb" not in trainer.progress_bar_metrics
        assert bar_calls == []
        return
    shown = trainer.progress_bar_metrics["peak_mem_mb"]
    assert shown > 0 and shown == round(logged_peak)  # whole MiB of the last window's peak
    assert [(call.step, call.name) for call in bar_calls] == [(5, "peak_mem_mb"), (10, "peak_mem_mb")]
    assert_bar_only(bar_calls, rank_zero_only=True)


def test_gpu_memory_monitor_shows_the_peak_whatever_metrics_it_logs(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False, metrics=["rss_mb"])
    trainer = fit(tmp_path, SlowModel(), [monitor], max_steps=5, log_every_n_steps=5)
    assert set(monitor.last_logged) == {"gpu_monitor/host/rss_mb"}
    assert trainer.progress_bar_metrics["peak_mem_mb"] >= round(monitor.last_logged["gpu_monitor/host/rss_mb"]) > 0


def test_peak_memory_is_the_largest_gpu_peak_else_the_host_peak():
    one_process = {"gpu0/peak_allocated_mb": 100.0, "gpu1/peak_allocated_mb": 300.0, "gpu0/allocated_mb": 900.0}
    assert peak_memory_mb({**one_process, "host/peak_rss_mb": 5000.0}) == 300.0  # the GPUs', not the host's
    across = summarize_across_ranks(
        torch.tensor([[100.0, 7.0], [250.0, 9.0]]), ["gpu0/peak_allocated_mb", "host/peak_rss_mb"]
    )
    assert peak_memory_mb(across) == 250.0  # the max over ranks, not the mean or the rank
    assert peak_memory_mb({"host/rss_mb": 10.0, "host/peak_rss_mb_max": 12.0, "host/peak_rss_mb_max_rank": 1.0}) == 12
    assert peak_memory_mb({"host/rss_mb": 10.0}) is None


@pytest.mark.parametrize("progress_bar", [True, False])
def test_gradient_clipping_shows_the_norm_it_logged(tmp_path, bar_calls, progress_bar):
    logger = RecordingLogger()
    clipping = GradientClipping(mode="norm", max_norm=0.5, progress_bar=progress_bar)
    trainer = fit(tmp_path, LoudModel(), [clipping], max_steps=5, log_every_n_steps=2, logger=logger)
    logged = logger.values("grad_norm")
    assert len(logged) == 2  # steps 1 and 3; the bar's field does not reach the logger
    if not progress_bar:
        assert "grad_norm" not in trainer.progress_bar_metrics
        assert bar_calls == []
        return
    shown = trainer.progress_bar_metrics["grad_norm"]
    assert math.isfinite(shown) and shown > 0.5  # the norm before clipping
    assert shown == pytest.approx(logged[-1], rel=1e-6)
    assert [call.step for call in bar_calls] == [2, 4]
    assert [call.value for call in bar_calls] == pytest.approx(logged, rel=1e-6)
    assert_bar_only(bar_calls)


def test_gradient_clipping_shows_the_norm_without_logging_it(tmp_path):
    logger = RecordingLogger()
    clipping = GradientClipping(mode="norm", max_norm=0.5, log_norm=False)
    trainer = fit(tmp_path, LoudModel(), [clipping], max_steps=2, log_every_n_steps=1, logger=logger)
    assert logger.values("grad_norm") == []
    assert trainer.progress_bar_metrics["grad_norm"] > 0.5


def all_four(**kwargs) -> list:
    return [
        NaNSkip(**kwargs),
        GradientClipping(mode="norm", max_norm=1.0, **kwargs),
        GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False, **kwargs),
        OOMBackoff(**kwargs),
    ]


def test_the_four_fields_reach_the_drawn_bar(tmp_path):
    # tqdm's bar, named: with `rich` installed (transformers brings it) Lightning's default bar is RichProgressBar
    trainer = fit(tmp_path, SlowModel(), [*all_four(), TQDMProgressBar()], max_steps=4, log_every_n_steps=2)
    assert set(trainer.progress_bar_metrics) == FIELDS
    postfix = trainer.progress_bar_callback.train_progress_bar.postfix
    for field in FIELDS:
        assert re.search(rf"\b{field}=", postfix), postfix


def test_without_a_progress_bar_nothing_is_logged_for_it(tmp_path, bar_calls):
    trainer = fit(tmp_path, SlowModel(), all_four(), bar=False, max_steps=4, log_every_n_steps=2)
    assert trainer.global_step == 4
    assert bar_calls == []
    assert not FIELDS & set(trainer.progress_bar_metrics)


def test_progress_bar_false_adds_no_field(tmp_path, bar_calls):
    trainer = fit(tmp_path, SlowModel(), all_four(progress_bar=False), max_steps=4, log_every_n_steps=2)
    assert bar_calls == []
    assert not FIELDS & set(trainer.progress_bar_metrics)


BUILDERS = {
    "NaNSkip": (lambda value: NaNSkip(progress_bar=value), TypeError),
    "GPUMemoryMonitor": (lambda value: GPUMemoryMonitor(progress_bar=value), TypeError),
    "GradientClipping": (lambda value: GradientClipping(mode="norm", max_norm=1.0, progress_bar=value), TypeError),
    "OOMBackoff": (lambda value: OOMBackoff(progress_bar=value), TypeError),
}


@pytest.mark.parametrize("value", ["yes", 1, None])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_progress_bar_that_is_not_a_bool_is_refused_at_construction(name, value):
    build, error = BUILDERS[name]
    with pytest.raises(error, match=rf"^{name}: progress_bar must be True or False, got {re.escape(repr(value))}$"):
        build(value)


@pytest.mark.distributed
def test_two_ranks_fields_add_no_collective_and_rank_zero_alone_shows_the_peak(tmp_path):
    # GPUMemoryMonitor, NaNSkip and GradientClipping with the bar drawn: rank 0 alone logs peak_mem_mb
    script = REPO / "tests" / "helpers" / "monitor_fit.py"
    result = run_script(script, "--out", tmp_path, "--steps", 20, "--log-every", 5, "--progress-bar", ranks=2)
    assert result["rc"] == 0 and not result["hung"], result["output"][-3000:]
    records = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):
        # the monitor's own all-gather per logging step, as without the bar: the fields added no collective
        assert records[rank]["calls"] == {"all_gather": 4, "broadcast_object_list": 1}
    bars = {rank: records[rank]["progress_bar_metrics"] for rank in (0, 1)}
    assert bars[0]["peak_mem_mb"] == round(records[0]["last_logged"]["gpu_monitor/host/peak_rss_mb_max"]) > 0
    assert set(bars[0]) == {"peak_mem_mb", "skipped", "grad_norm"}
    assert set(bars[1]) == {"skipped", "grad_norm"}
    for rank in (0, 1):
        assert bars[rank]["skipped"] == 0.0 and math.isfinite(bars[rank]["grad_norm"])
    assert bars[0]["grad_norm"] == pytest.approx(bars[1]["grad_norm"], rel=1e-6)  # all-reduced gradients
