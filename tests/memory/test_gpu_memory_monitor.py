"""GPUMemoryMonitor on CPU: real fits logging host memory, the timeline and plot, the early warning, Prometheus, and
one all-gather per logging step across 2 gloo processes."""

import csv
import json
import math
import re
import socket
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lightning_mgpu import GPUMemoryMonitor, MemoryHeadroomWarning, NaNSkip, OOMBackoff
from lightning_mgpu.core.host_memory import host_available_mb, process_rss_mb
from lightning_mgpu.core.training_events import read_events
from lightning_mgpu.memory import memory_sampler
from lightning_mgpu.memory.gpu_memory_monitor import summarize_across_ranks
from lightning_mgpu.memory.memory_timeline import timeline_plot
from tests.helpers.oom_models import IndexedRegression
from tests.helpers.processes import run_script
from tests.helpers.runif import run_if

REPO = Path(__file__).resolve().parents[2]
QUIET = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
HOST_KEYS = ("host/rss_mb", "host/peak_rss_mb", "host/available_mb")


class SlowModel(BoringModel):
    """A step long enough for a 50 Hz sampler to see it."""

    def __init__(self, delay: float = 0.01):
        super().__init__()
        self.delay = delay

    def training_step(self, batch, batch_idx):
        time.sleep(self.delay)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        time.sleep(self.delay)
        return super().validation_step(batch, batch_idx)


def read_metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sample_hz": 0}, ValueError, r"sample_hz must be a number of samples per second in \(0, 100\], got 0$"),
        ({"sample_hz": 1000}, ValueError, r"sample_hz .* got 1000"),
        ({"sample_hz": True}, TypeError, r"sample_hz .* got True"),
        (
            {"warn_headroom_mb": -1},
            ValueError,
            r"warn_headroom_mb must be a non-negative number of MiB or None, got -1; use None",
        ),
        ({"warn_headroom_mb": float("nan")}, ValueError, r"warn_headroom_mb must be a non-negative number .*got nan"),
        ({"warn_headroom_mb": "2048"}, TypeError, r"warn_headroom_mb must be a non-negative number .*got '2048'"),
        ({"log_prefix": ""}, ValueError, r"log_prefix must be a non-empty string, got ''"),
        ({"log_prefix": None}, TypeError, r"log_prefix must be a non-empty string, got None"),
        (
            {"metrics": ["allocated"]},
            ValueError,
            r"metrics must be a non-empty list of metric names from 'allocated_mb', .* got \['allocated'\]; "
            r"'allocated' is not among them",
        ),
        ({"metrics": []}, ValueError, r"metrics must be a non-empty list"),
        ({"metrics": "headroom_mb"}, TypeError, r"metrics must be a non-empty list .*got 'headroom_mb'"),
        ({"prometheus_port": 70000}, ValueError, r"prometheus_port must be an int >= 0 and <= 65535 .*got 70000"),
        ({"prometheus_port": "9400"}, TypeError, r"prometheus_port must be an int >= 0 and <= 65535 .*got '9400'"),
        ({"track_peak": None}, TypeError, r"track_peak must be True or False, got None"),
    ],
)
def test_bad_arguments_are_named_at_construction(kwargs, error, match):
    with pytest.raises(error, match="^GPUMemoryMonitor: " + match):
        GPUMemoryMonitor(**kwargs)


def test_construction_touches_no_nvml_and_pickles(monkeypatch):
    import pickle
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # an import of NVML now would raise
    monitor = GPUMemoryMonitor(prometheus_port=0)
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.prometheus_port == 0 and clone.sampler is None


def test_cpu_fit_logs_host_memory_on_logging_steps_and_writes_the_timeline_and_plot(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=20,
        log_every_n_steps=5,
        limit_val_batches=4,
        val_check_interval=10,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[monitor],
        **QUIET,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SlowModel(delay=0.02))
    ours = [str(w.message) for w in caught if "GPUMemoryMonitor" in str(w.message)]
    assert len(ours) == 1 and "no CUDA device" in ours[0]  # one warning on a CPU-only run, no exception

    rows = read_metrics(Path(logger.log_dir))
    train_rows = [r for r in rows if r.get("gpu_monitor/host/rss_mb")]
    # Lightning writes on batches 4, 9, 14, 19 (log_every_n_steps=5): the monitor's rows land on the same steps
    assert [int(r["step"]) for r in train_rows] == [4, 9, 14, 19]
    for row in train_rows:
        rss, peak = float(row["gpu_monitor/host/rss_mb"]), float(row["gpu_monitor/host/peak_rss_mb"])
        assert 10 < rss <= peak < 1e6
        assert float(row["gpu_monitor/host/available_mb"]) > 0
    assert not any(key.startswith("gpu_monitor/gpu") for key in rows[0])  # no GPU keys without a GPU
    validate_rows = [r for r in rows if r.get("gpu_monitor/validate/host/rss_mb")]
    assert len(validate_rows) == 2  # once at the end of each of the two validation runs

    with open(monitor.timeline_path, newline="") as file:
        timeline = list(csv.DictReader(file))
    assert monitor.timeline_path == Path(logger.log_dir) / "memory_timeline" / "memory_fit_rank0.csv"
    assert len(timeline) >= 10
    stages = [row["stage"] for row in timeline]
    runs = [stage for i, stage in enumerate(stages) if i == 0 or stages[i - 1] != stage]
    assert runs[:3] == ["train", "validate", "train"]  # training is labelled training again after validation
    steps = [int(row["step"]) for row in timeline]
    assert steps == sorted(steps) and steps[-1] == 20
    assert all(float(row["host_rss_mb"]) > 10 for row in timeline)
    assert monitor.plot_path is not None and monitor.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert monitor.sampler is None  # the thread is stopped at teardown


def test_the_sampler_thread_takes_samples_while_the_loop_runs(tmp_path):
    counts = []

    class Probe(SlowModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            counts.append(self.trainer.callbacks[0].sampler.samples_taken)

    trainer = Trainer(
        accelerator="cpu",
        max_steps=30,
        logger=False,
        callbacks=[GPUMemoryMonitor(sample_hz=50)],
        default_root_dir=tmp_path,
        **QUIET,
    )
    trainer.fit(Probe(delay=0.01))
    # hooks never sample: only the thread does, so the count grows without any logging step (logger=False)
    assert counts[-1] - counts[0] >= 5


def test_early_warning_fires_before_host_memory_runs_out(tmp_path, monkeypatch):
    grow_mb, steps = 64, 24
    # the host's free memory as if this process were alone on it: other jobs on a shared machine cannot move it
    start_available, start_rss = host_available_mb(), process_rss_mb()
    monkeypatch.setattr(memory_sampler, "host_available_mb", lambda: start_available - (process_rss_mb() - start_rss))
    threshold = start_available - 6 * grow_mb  # crossed after about 6 of the 24 growth steps

    class Growing(SlowModel):
        def __init__(self):
            super().__init__(delay=0.05)
            self.held = []
            self.warned_at_step = None

        def training_step(self, batch, batch_idx):
            self.held.append(torch.ones(grow_mb * 2**20 // 4))  # touched pages: resident memory grows
            return super().training_step(batch, batch_idx)

    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=threshold, plot=False)
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, logger=False, callbacks=[monitor], default_root_dir=tmp_path, **QUIET
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Growing())
    headroom = [w for w in caught if issubclass(w.category, MemoryHeadroomWarning)]
    assert len(headroom) == 1, [str(w.message) for w in caught]  # once, though the condition persists
    message = str(headroom[0].message)
    assert f"warn_headroom_mb={threshold:g}" in message and "rank 0" in message
    step = int(re.search(r"step (\d+)", message).group(1))
    # it fired while memory was still growing, long before the run's last allocation
    assert 3 <= step <= 14, message
    assert monitor.warnings_issued == ["host:headroom"]


def test_no_warning_while_headroom_stays_above_the_threshold(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=64, plot=False)
    trainer = Trainer(
        accelerator="cpu", max_steps=10, logger=False, callbacks=[monitor], default_root_dir=tmp_path, **QUIET
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SlowModel())
    assert not [w for w in caught if issubclass(w.category, MemoryHeadroomWarning)]


def test_prometheus_endpoint_serves_the_gauges_on_localhost_during_fit(tmp_path):
    scraped = {}

    class Scraper(SlowModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 8:
                url = self.trainer.callbacks[0].prometheus_url
                with urllib.request.urlopen(url, timeout=10) as response:
                    scraped["url"], scraped["body"] = url, response.read().decode()

    monitor = GPUMemoryMonitor(sample_hz=50, prometheus_port=0, plot=False)
    trainer = Trainer(
        accelerator="cpu", max_steps=12, logger=False, callbacks=[monitor], default_root_dir=tmp_path, **QUIET
    )
    trainer.fit(Scraper())
    assert scraped["url"].startswith("http://127.0.0.1:")
    gauges = dict(re.findall(r'^(lightning_mgpu_host_rss_mb\{rank="0"\}) ([0-9.e+]+)$', scraped["body"], re.M))
    assert float(gauges['lightning_mgpu_host_rss_mb{rank="0"}']) > 10
    step = re.search(r'^lightning_mgpu_step\{rank="0"\} ([0-9.e+]+)$', scraped["body"], re.M)
    assert step is not None and 1 <= float(step.group(1)) <= 9
    with pytest.raises(urllib.error.URLError) as refused:  # the port is closed after fit
        urllib.request.urlopen(scraped["url"], timeout=5)
    assert isinstance(refused.value.reason, ConnectionRefusedError)
    assert monitor.prometheus_url is None


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=10,
        log_every_n_steps=5,
        accumulate_grad_batches=4,
        limit_val_batches=0,
        logger=logger,
        callbacks=[monitor],
        **QUIET,
    )
    trainer.fit(SlowModel(delay=0.005))
    rows = [r for r in read_metrics(Path(logger.log_dir)) if r.get("gpu_monitor/host/rss_mb")]
    assert [int(r["step"]) for r in rows] == [4, 9]  # not four rows per step, one per micro-batch


def test_metrics_trims_the_logged_keys(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=50, metrics=["rss_mb"], warn_headroom_mb=None, plot=False)
    trainer = Trainer(
        accelerator="cpu", max_steps=5, log_every_n_steps=5, logger=CSVLogger(tmp_path), callbacks=[monitor], **QUIET
    )
    trainer.fit(SlowModel())
    assert set(monitor.last_logged) == {"gpu_monitor/host/rss_mb"}


def test_a_second_fit_keeps_the_first_timeline(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False, timeline_dir=str(tmp_path / "t"))
    paths = []
    for _ in range(2):
        trainer = Trainer(accelerator="cpu", max_steps=3, logger=False, callbacks=[monitor], **QUIET)
        trainer.fit(SlowModel())
        paths.append(monitor.timeline_path)
    assert [p.name for p in paths] == ["memory_fit_rank0.csv", "memory_fit_rank0-v1.csv"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_a_taken_port_warns_and_training_goes_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False, prometheus_port=port)
        trainer = Trainer(
            accelerator="cpu", max_steps=3, logger=False, callbacks=[monitor], default_root_dir=tmp_path, **QUIET
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(SlowModel())
    assert trainer.global_step == 3 and monitor.prometheus_url is None
    assert any(f"cannot serve Prometheus gauges on 127.0.0.1:{port}" in str(w.message) for w in caught)


def test_summary_across_ranks_leaves_unknown_values_out():
    gathered = torch.tensor([[100.0, math.nan, 5.0], [300.0, math.nan, math.nan], [200.0, math.nan, 7.0]])
    metrics = summarize_across_ranks(gathered, ["gpu0/allocated_mb", "gpu0/power_w", "host/rss_mb"])
    assert metrics == {
        "gpu0/allocated_mb_min": 100.0,
        "gpu0/allocated_mb_mean": 200.0,
        "gpu0/allocated_mb_max": 300.0,
        "gpu0/allocated_mb_max_rank": 1.0,
        "host/rss_mb_min": 5.0,
        "host/rss_mb_mean": 6.0,
        "host/rss_mb_max": 7.0,
        "host/rss_mb_max_rank": 2.0,
    }


@pytest.mark.distributed
def test_two_ranks_one_all_gather_per_logging_step_and_rank_zero_logs_min_mean_max(tmp_path):
    script = REPO / "tests" / "helpers" / "monitor_fit.py"
    ours = run_script(
        script, "--out", tmp_path / "ours", "--steps", 20, "--log-every", 5, "--extra-mb", 1, 256, ranks=2
    )
    none = run_script(script, "--out", tmp_path / "none", "--steps", 20, "--log-every", 5, "--no-monitor", ranks=2)
    for result in (ours, none):
        assert result["rc"] == 0 and not result["hung"], result["output"][-3000:]
    records = {r: json.loads((tmp_path / "ours" / f"rank{r}.json").read_text()) for r in (0, 1)}
    baseline = {r: json.loads((tmp_path / "none" / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):
        # no per-step Python collective: only rank 0's word on bucket tuning, once per fit (bucket_cap_mb="auto")
        assert baseline[rank]["calls"] == {"broadcast_object_list": 1}
        # 20 steps, a logging step every 5
        assert records[rank]["calls"] == {"all_gather": 4, "broadcast_object_list": 1}
    assert records[1]["last_logged"] == {}  # only rank 0 logs

    rows = [r for r in read_metrics(tmp_path / "ours" / "logs") if r.get("gpu_monitor/host/rss_mb_max")]
    assert [int(r["step"]) for r in rows] == [4, 9, 14, 19]
    expected = {f"gpu_monitor/{key}_{stat}" for key in HOST_KEYS for stat in ("min", "mean", "max", "max_rank")}
    assert {k for k in rows[0] if k.startswith("gpu_monitor/")} == expected  # 4 per metric, whatever the world size
    for row in rows:
        low, mean, high = (float(row[f"gpu_monitor/host/rss_mb_{s}"]) for s in ("min", "mean", "max"))
        assert low <= mean <= high and mean == pytest.approx((low + high) / 2)
        assert float(row["gpu_monitor/host/rss_mb_max_rank"]) == 1.0  # rank 1 holds 256 MiB more
        assert high - low > 200
    for rank in (0, 1):
        assert Path(records[rank]["timeline"]).is_file()
        assert Path(records[rank]["timeline"]).with_suffix(".png").is_file()


@run_if(min_cuda_gpus=1)
def test_gpu_fit_logs_nvml_and_allocator_keys_and_warns_on_low_headroom(tmp_path):
    monitor = GPUMemoryMonitor(sample_hz=20, warn_headroom_mb=10**9)  # any real GPU is under a petabyte
    logger = CSVLogger(tmp_path, name="", version="")

    class OnGPU(SlowModel):
        def training_step(self, batch, batch_idx):
            self.held = torch.empty(64 * 2**20, dtype=torch.uint8, device=self.device)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        accelerator="cuda", devices=1, max_steps=20, log_every_n_steps=5, logger=logger, callbacks=[monitor], **QUIET
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(OnGPU())
    row = [r for r in read_metrics(Path(logger.log_dir)) if r.get("gpu_monitor/gpu0/allocated_mb")][-1]
    assert float(row["gpu_monitor/gpu0/allocated_mb"]) >= 64
    assert float(row["gpu_monitor/gpu0/peak_allocated_mb"]) >= 64
    assert float(row["gpu_monitor/gpu0/free_mb"]) > 0
    assert 0 <= float(row["gpu_monitor/gpu0/temperature_c"]) < 120
    assert float(row["gpu_monitor/gpu0/power_w"]) > 0
    assert any(issubclass(w.category, MemoryHeadroomWarning) and "gpu0" in str(w.message) for w in caught)


def test_without_a_logger_or_root_dir_nothing_is_written_into_the_working_directory(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            Trainer(accelerator="cpu", max_steps=3, logger=False, callbacks=[monitor], **QUIET).fit(SlowModel())
    assert list(cwd.iterdir()) == []
    assert monitor.timeline_path is None and monitor.events_path is None and monitor.plot_path is None
    ours = [str(w.message) for w in caught if "no memory timeline is written" in str(w.message)]
    assert len(ours) == 1, ours  # once, not once per fit
    assert "pass timeline_dir=... or default_root_dir=..." in ours[0]


def test_without_a_logger_the_timeline_goes_under_default_root_dir(tmp_path, monkeypatch):
    cwd, root = tmp_path / "cwd", tmp_path / "root"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monitor = GPUMemoryMonitor(sample_hz=50, warn_headroom_mb=None, plot=False)
    trainer = Trainer(accelerator="cpu", max_steps=3, logger=False, default_root_dir=root, callbacks=[monitor], **QUIET)
    trainer.fit(SlowModel())
    assert list(cwd.iterdir()) == []
    assert monitor.timeline_path == root / "memory_timeline" / "memory_fit_rank0.csv"
    assert monitor.events_path == root / "memory_timeline" / "memory_fit_rank0.events.csv"
    assert monitor.timeline_path.is_file() and monitor.events_path.is_file()


class FaultyRegression(IndexedRegression):
    """Runs out of memory on batches over 4 samples from batch 3 on (OOMBackoff halves 8 to 4); NaN loss at step 5.

    Each step takes 25 ms or more, more than the 20 ms the monitor leaves between two samples of its own.
    """

    def training_step(self, batch, batch_idx):
        time.sleep(0.025)
        loss = super().training_step(batch, batch_idx)
        return loss + float("nan") if self.trainer.global_step == 5 else loss


def test_the_timeline_marks_the_runs_events_and_samples_at_them(tmp_path):
    torch.manual_seed(0)
    monitor = GPUMemoryMonitor(sample_hz=0.2, warn_headroom_mb=1024)  # the thread samples only at the start
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=2,
        log_every_n_steps=5,
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[NaNSkip(), OOMBackoff(), monitor],
        **QUIET,
    )
    trainer.fit(FaultyRegression(num_samples=64, batch_size=8, oom_above=4, oom_from_batch=3))
    assert trainer.global_step == 16

    events = [(event.step, event.kind, event.detail) for event in read_events(monitor.events_path)]
    assert events == [
        (0, "validation", "sanity check"),
        (0, "stage", "train start"),
        (3, "oom_backoff", "rank 0, micro-batch 8 -> 4"),
        (5, "skipped_steps", "NaN/Inf loss"),
        (8, "validation", ""),
        (16, "validation", ""),
        (16, "stage", "train end"),
    ]
    with open(monitor.timeline_path, newline="") as file:
        rows = list(csv.DictReader(file))
    steps = [int(row["step"]) for row in rows]
    # besides the thread's first and last samples: stage boundaries, logging steps and events have theirs
    assert len(rows) >= 12, steps
    for event_step in (3, 5):
        assert {event_step, event_step + 1} & set(steps), (event_step, steps)
    assert {4, 9, 14} <= set(steps)  # the logging steps (log_every_n_steps=5)

    plot = timeline_plot(monitor.timeline_path, read_events(monitor.events_path), warn_headroom_mb=1024)
    assert plot.y_limits[0] == 0
    assert {event.kind for event in plot.events} == {"validation", "stage", "oom_backoff", "skipped_steps"}
    limit = next(line for line in plot.lines if line.role == "limit")
    threshold = next(line for line in plot.lines if line.role == "threshold")
    assert threshold.values == pytest.approx([value - 1024 for value in limit.values])
    assert monitor.plot_path == monitor.timeline_path.with_suffix(".png") and monitor.plot_path.is_file()
