"""PerformanceMonitor on CUDA: device figures from CUDA events read late, MFU from the data-sheet peak, NCCL timing.

Run on a machine with GPUs: ``pytest -m cuda tests/performance/test_performance_monitor_gpu.py`` (or
``python -m lightning_mgpu check --gpu-tests``).
"""

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu import PerformanceMonitor
from lightning_mgpu.core.step_timing import CudaClock, StepTimer
from tests.helpers.processes import REPO, run_script
from tests.helpers.runif import run_if

SCRIPT = Path(REPO) / "tests" / "helpers" / "perf_fit.py"

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class Wide(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2))


@run_if(min_cuda_gpus=1)
def test_cuda_events_give_the_device_figures_without_waiting():
    clock = CudaClock()
    timer = StepTimer(clock, skip_steps=0)
    timer.start(0.0)
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.device(0):
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation in the timer raises
        try:
            timer.batch_start(0.0, 1, None)
            for _ in range(50):
                a = a @ a / 8192
            timer.optimizer_start()
            timer.batch_end(0.1, stepped=True)
            pending = timer.take_window()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # ~55 TFLOP of queued products: the events have not completed when the window is taken, nothing waited for them
    assert pending.steps == 1 and pending.device_steps == 0
    torch.cuda.synchronize()
    totals = timer.take_window()
    assert totals.device_steps == 1 and totals.fwd_bwd_ms > 0


@run_if(min_cuda_gpus=1)
def test_one_gpu_fit_logs_device_times_and_mfu():
    monitor = PerformanceMonitor()
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=30, log_every_n_steps=5, callbacks=[monitor], **QUIET)
    trainer.fit(Wide())
    window = monitor.last_window
    # lagged: the last window holds the device figures of the steps whose events had completed
    assert window.get("fwd_bwd_ms", 0) > 0 and window.get("optimizer_ms", 0) > 0, window
    assert window["samples_per_sec"] > 0
    if monitor.peak_flops is not None:  # a GPU of the table
        assert 0 < window["mfu_pct"] < 100
        assert "data sheet" in monitor.peak_source


@pytest.mark.distributed
@run_if(min_cuda_gpus=2)
def test_two_gpu_ddp_times_the_nccl_reduction_and_names_a_slow_rank(tmp_path):
    command = ["--out", tmp_path, "--accelerator", "cuda", "--steps", 30, "--slow-rank", 1, "--slow-ms", 30]
    result = run_script(SCRIPT, *command, timeout=300)
    assert not result["hung"] and result["rc"] == 0, result["output"][-4000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["last_window"]["comm_ms"] > 0, record
    assert records[0]["last_window"]["comm_exposed_ms"] > 20  # waited on the GPU for rank 1
    assert records[0]["stragglers"] == [1]
