"""PerformanceMonitor in real fits: its keys, data wait against compute, validation left out, 2-process summaries,
the straggler named, and collectives unchanged but for one shared all-gather per logging step."""

import csv
import json
import time
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

from lightning_mgpu import PerformanceMonitor
from lightning_mgpu.core import compat
from lightning_mgpu.core.prometheus_exporter import PrometheusExporter
from lightning_mgpu.core.step_timing import STEP_METRICS
from tests.helpers.processes import REPO, run_script

SCRIPT = Path(REPO) / "tests" / "helpers" / "perf_fit.py"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_prefix": ""}, ValueError, "log_prefix"),
        ({"tokens_key": ""}, ValueError, "tokens_key must be a non-empty string"),
        ({"count_flops": "yes"}, TypeError, "count_flops must be True or False, got 'yes'"),
        ({"peak_tflops": 0}, ValueError, "peak_tflops must be a positive number of TFLOP/s or None, got 0"),
        ({"straggler_margin": 0}, ValueError, "straggler_margin"),
        ({"straggler_windows": 0}, ValueError, "straggler_windows must be an int >= 1, got 0"),
        ({"prometheus_port": 70000}, ValueError, "prometheus_port"),
    ],
)
def test_bad_options_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        PerformanceMonitor(**kwargs)


class SlowLoaderModel(BoringModel):
    def __init__(self, loader_ms: float = 0.0, validation_ms: float = 0.0) -> None:
        super().__init__()
        self.loader_ms = loader_ms
        self.validation_ms = validation_ms

    def train_dataloader(self):
        def collate(samples):
            time.sleep(self.loader_ms / 1e3)
            return default_collate(samples)

        return DataLoader(RandomDataset(32, 64), batch_size=4, collate_fn=collate)

    def validation_step(self, batch, batch_idx):
        time.sleep(self.validation_ms / 1e3)
        return super().validation_step(batch, batch_idx)


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as file:
        return list(csv.DictReader(file))


def fit(tmp_path, model, monitor, **kwargs):
    torch.manual_seed(0)
    options = {"max_steps": 12, "log_every_n_steps": 4, "limit_val_batches": 2, "num_sanity_val_steps": 0}
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="", version=""),
        enable_checkpointing=False,
        enable_model_summary=False,
        **{"callbacks": [monitor], **options, **kwargs},
    )
    trainer.fit(model)
    return trainer


def test_one_process_logs_its_figures_and_counts_the_flops(tmp_path):
    monitor = PerformanceMonitor()
    trainer = fit(tmp_path, SlowLoaderModel(), monitor)
    rows = read_rows(tmp_path / "metrics.csv")
    logged = [row for row in rows if row.get("perf/step_ms")]
    assert [int(row["step"]) for row in logged] == [3, 7, 11]
    for key in ("step_ms", "data_wait_ms", "fwd_bwd_ms", "optimizer_ms", "busy_ms", "samples_per_sec", "mfu_pct"):
        assert float(logged[-1][f"perf/{key}"]) > 0, key
    assert not any(key.endswith("_max_rank") for key in monitor.last_logged)  # one process: the figures themselves
    assert "perf/comm_ms" not in monitor.last_logged  # no reduction in one process: left out, not 0
    # BoringModel's Linear(32, 2): 2*32*2 FLOPs forward, as many for the weight gradient, no input gradient
    assert monitor.flops_per_sample == 256
    assert monitor.peak_source.startswith("measured float32 matmul on cpu")
    assert trainer.progress_bar_metrics["samples_per_sec"] == pytest.approx(
        round(monitor.last_logged["perf/samples_per_sec"], 1), rel=1e-4
    )


def test_a_slow_loader_shows_up_as_data_wait_not_compute(tmp_path):
    loader_ms = 25
    reference = PerformanceMonitor()
    fit(tmp_path / "reference", SlowLoaderModel(), reference)  # the same fit with a loader that does not sleep
    monitor = PerformanceMonitor()
    fit(tmp_path, SlowLoaderModel(loader_ms=loader_ms), monitor)
    window = monitor.last_window
    assert window["data_wait_ms"] >= 0.9 * loader_ms
    # the step's compute as without the sleep (about 2 ms); counting the loader's wait as compute would add 25 ms
    assert window["fwd_bwd_ms"] < reference.last_window["fwd_bwd_ms"] + loader_ms / 2
    assert window["step_ms"] >= window["data_wait_ms"] + window["fwd_bwd_ms"]


def test_validation_inside_the_fit_is_not_counted_in_the_steps(tmp_path):
    validation_ms, every = 300, 4
    reference = PerformanceMonitor()
    fit(tmp_path / "reference", SlowLoaderModel(), reference, val_check_interval=every)  # validation without sleep
    monitor = PerformanceMonitor()
    fit(tmp_path, SlowLoaderModel(validation_ms=validation_ms), monitor, val_check_interval=every)
    # 2 batches of 300 ms every 4 steps would add 150 ms to each step if they were counted (a step takes ~2 ms)
    per_step = 2 * validation_ms / every
    for key in ("step_ms", "data_wait_ms"):
        assert monitor.last_window[key] < reference.last_window[key] + per_step / 2, key


def test_manual_optimization_with_two_optimizers_counts_both_models_flops(tmp_path):
    class TwoModels(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.other = torch.nn.Linear(32, 2)

        def training_step(self, batch, batch_idx):
            for optimizer, layer in zip(self.optimizers(), (self.layer, self.other), strict=True):
                loss = layer(batch).sum()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)

    monitor = PerformanceMonitor()
    fit(tmp_path, TwoModels(), monitor)
    assert monitor.flops_per_sample == 2 * 256  # both Linear(32, 2), forward and weight gradient
    assert monitor.last_window["fwd_bwd_ms"] > 0  # the batch is one span...
    assert "optimizer_ms" not in monitor.last_window  # ...the optimizers stepped inside it


def test_the_cheap_logging_check_agrees_with_lightning_on_every_batch(tmp_path):
    class Compare(pl.Callback):
        def __init__(self) -> None:
            self.answers: list[tuple[bool, bool]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 9:
                trainer.should_stop = True  # Lightning logs the step that stops training too
            self.answers.append((compat.training_logging_check(trainer)(), compat.is_logging_step(trainer)))

    compare = Compare()
    fit(tmp_path, SlowLoaderModel(), compare, max_steps=20, log_every_n_steps=3, accumulate_grad_batches=2)
    assert [cheap for cheap, _ in compare.answers] == [lightning for _, lightning in compare.answers]
    assert sum(lightning for _, lightning in compare.answers) >= 4  # some of each
    assert not all(lightning for _, lightning in compare.answers)


def test_a_batch_without_a_size_leaves_throughput_out_not_zero(tmp_path):
    class Opaque:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    class OpaqueBatches(BoringModel):
        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 64), batch_size=4, collate_fn=lambda s: Opaque(default_collate(s)))

        def training_step(self, batch, batch_idx):
            return super().training_step(batch.x, batch_idx)

    monitor = PerformanceMonitor()
    with pytest.warns(UserWarning, match="cannot tell the batch size"):
        fit(tmp_path, OpaqueBatches(), monitor)
    assert "samples_per_sec" not in monitor.last_window and "mfu_pct" not in monitor.last_window
    assert monitor.last_window["step_ms"] > 0


def test_tokens_come_from_the_module_or_the_batch_key(tmp_path):
    class TokenModel(BoringModel):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch["input_ids"].float(), batch_idx)

        def train_dataloader(self):
            data = [{"input_ids": torch.randn(32)} for _ in range(64)]
            return DataLoader(data, batch_size=4)

    monitor = PerformanceMonitor()
    fit(tmp_path, TokenModel(), monitor)
    window = monitor.last_window
    assert window["tokens_per_sec"] == pytest.approx(32 * window["samples_per_sec"], rel=1e-6)

    class CountsItsTokens(TokenModel):
        def tokens_in_batch(self, batch):
            return 10 * batch["input_ids"].shape[0]

    monitor = PerformanceMonitor()
    fit(tmp_path / "counted", CountsItsTokens(), monitor)
    assert monitor.last_window["tokens_per_sec"] == pytest.approx(10 * monitor.last_window["samples_per_sec"])


def test_the_gauges_are_served_with_rank_and_uuid_labels():
    exporter = PrometheusExporter(0, "127.0.0.1", rank=3, gpus=[])
    url = exporter.start()
    try:
        exporter.set_performance({"step_ms": 12.5, "comm_ms": float("nan")}, uuid="GPU-1234")
        page = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        exporter.stop()
    assert 'lightning_mgpu_perf_step_ms{rank="3",uuid="GPU-1234"} 12.5' in page
    assert "perf_comm_ms" not in page  # unknown: left out


def run_fit(out: Path, *args: object) -> dict:
    result = run_script(SCRIPT, "--out", out, *args, timeout=120, ranks=2)
    assert not result["hung"] and result["rc"] == 0, result["output"][-4000:]
    records = {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    records["output"] = result["output"]
    return records


def test_without_a_port_of_its_own_it_serves_its_gauges_on_the_memory_monitors_endpoint(tmp_path):
    from lightning_mgpu import GPUMemoryMonitor

    memory = GPUMemoryMonitor(sample_hz=20, prometheus_port=0)
    pages = []

    class ReadTheEndpoint(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            with urllib.request.urlopen(memory.prometheus_url, timeout=10) as response:
                pages.append(response.read().decode())

    monitor = PerformanceMonitor()  # no prometheus_port: it joins the endpoint the memory monitor serves
    fit(tmp_path, SlowLoaderModel(), monitor, callbacks=[memory, monitor, ReadTheEndpoint()])
    assert 'lightning_mgpu_perf_step_ms{rank="0"' in pages[0]
    assert "lightning_mgpu_host_" in pages[0]  # the memory monitor's own gauges, on the same page


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_two_ranks_log_summaries_and_the_slowed_rank_is_named(tmp_path):
    slow_ms = 30
    records = run_fit(tmp_path, "--steps", 30, "--log-every", 5, "--slow-rank", 1, "--slow-ms", slow_ms)
    rows = read_rows(tmp_path / "logs" / "metrics.csv")
    for metric in ("step_ms", "data_wait_ms", "fwd_bwd_ms", "samples_per_sec", "busy_ms", "comm_exposed_ms"):
        for statistic in ("min", "mean", "max", "max_rank"):
            assert rows[-1][f"perf/{metric}_{statistic}"] != "", (metric, statistic)
    assert float(rows[-1]["perf/busy_ms_max_rank"]) == 1
    assert float(rows[-1]["perf/samples_per_sec"]) == pytest.approx(
        2 * float(rows[-1]["perf/samples_per_sec_mean"]), rel=1e-6
    )
    # the fast rank waited for the slow one after its own backward, the slow rank was busy: each by about the sleep
    fast, slow = records[0]["last_window"], records[1]["last_window"]
    assert fast["comm_exposed_ms"] > slow_ms * 2 / 3 and slow["comm_exposed_ms"] < fast["comm_exposed_ms"] / 2
    assert slow["busy_ms"] > fast["busy_ms"] + slow_ms * 2 / 3
    assert records[0]["stragglers"] == [1]
    assert "PerformanceMonitor: rank 1 (" in records["output"] and "is a straggler" in records["output"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_rank_with_a_slow_loader_waits_for_data_and_is_named(tmp_path):
    # with fp16 compression: a hook of the pack's, timed like DDP's own reduction
    loader_ms = 30
    command = ["--steps", 25, "--log-every", 5, "--slow-loader-rank", 1, "--loader-ms", loader_ms]
    records = run_fit(tmp_path, *command, "--comm-hook", "fp16")
    slow, fast = records[1]["last_window"], records[0]["last_window"]
    # against the sleep of rank 1's loader for each batch: waited for, not counted as its compute
    assert slow["data_wait_ms"] > loader_ms * 5 / 6 and slow["fwd_bwd_ms"] < slow["data_wait_ms"] / 2
    assert fast["data_wait_ms"] < slow["data_wait_ms"] / 2 and fast["comm_exposed_ms"] > loader_ms * 2 / 3
    assert records[0]["stragglers"] == [1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_collectives_per_step_are_unchanged_but_for_one_shared_all_gather_per_logging_step(tmp_path):
    steps, every = 20, 5
    plain = run_fit(tmp_path / "none", "--steps", steps, "--log-every", every, "--monitors", "none")
    monitored = run_fit(tmp_path / "both", "--steps", steps, "--log-every", every, "--monitors", "both")
    for rank in (0, 1):
        calls = dict(monitored[rank]["calls"])
        # GPUMemoryMonitor and PerformanceMonitor together: one all-gather per logging step
        assert calls.pop("all_gather") == steps // every
        # the timed hook issues DDP's own reduction from Python: one all-reduce per bucket (one bucket here)
        assert calls.pop("all_reduce") == steps
        assert calls == plain[rank]["calls"] == {}
    assert set(STEP_METRICS) - {"tokens_per_sec"} <= set(monitored[0]["last_window"])  # the batches hold no tokens
