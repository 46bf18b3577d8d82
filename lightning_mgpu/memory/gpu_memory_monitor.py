"""Log GPU and host memory, utilisation, temperature and power per GPU, and warn before an out-of-memory error."""

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core._imports import MATPLOTLIB_AVAILABLE, PROMETHEUS_AVAILABLE
from lightning_mgpu.core._logging import has_progress_bar, show_in_progress_bar
from lightning_mgpu.core.nvml import NVMLSession, torch_device_uuid
from lightning_mgpu.core.prometheus_exporter import PrometheusExporter, ServesPrometheus
from lightning_mgpu.core.rank_gather import (
    RANK_STATISTICS,
    RankGather,
    summarize_across_ranks,
)
from lightning_mgpu.core.step_service import StepService, step_service
from lightning_mgpu.core.training_events import EventFile, EventKind, EventLog, RecordsEvents, events_path
from lightning_mgpu.core.validation import check_bool, check_int, check_number, check_sequence, check_str
from lightning_mgpu.ddp.data_parallel import DataParallelStrategy
from lightning_mgpu.memory.memory_headroom import HeadroomWatch
from lightning_mgpu.memory.memory_sampler import GPU_METRICS, HOST_METRICS, MemorySampler, MonitoredGPU
from lightning_mgpu.memory.memory_timeline import MemoryTimeline, plot_timeline, unused_path

METRICS: tuple[str, ...] = GPU_METRICS + HOST_METRICS
_FIRST_STAGE = {"fit": "train", "validate": "validate", "test": "test", "predict": "predict"}


class MemoryHeadroomWarning(UserWarning):
    """Emitted by :class:`GPUMemoryMonitor` when a device is about to run out of memory."""


class GPUMemoryMonitor(RecordsEvents, ServesPrometheus, Callback):
    """Monitor memory, utilisation, temperature and power of every GPU, and the host, at no cost to the training loop.

    A daemon thread samples ``sample_hz`` times a second: NVML (through ``nvidia-ml-py``) for free memory,
    utilisation, temperature and power, torch's caching allocator for allocated, reserved and peak memory, and
    ``/proc`` for the process's resident memory. The Lightning hooks only read what was sampled: on the steps
    Lightning's loggers write (``log_every_n_steps``), the window since the last write is logged straight to the
    loggers. Each torch device is matched to its NVML device by UUID, so ``CUDA_VISIBLE_DEVICES`` reordering and
    MIG slices report the right GPU.

    Logged keys, per GPU of this process (``gpu0``, ``gpu1`` under DataParallel), reduced over the window:

    - ``<prefix>/gpu0/allocated_mb``: memory held by tensors (MiB, last sample).
    - ``<prefix>/gpu0/peak_allocated_mb``: peak of it in the window (MiB); peaks restart with each window and stage.
    - ``<prefix>/gpu0/reserved_mb``: memory the caching allocator holds (MiB, last sample).
    - ``<prefix>/gpu0/free_mb``: free device memory, all processes counted (MiB, window minimum).
    - ``<prefix>/gpu0/headroom_mb``: ``free + reserved - allocated``, what this process can still allocate
      (MiB, window minimum).
    - ``<prefix>/gpu0/utilization_pct``, ``temperature_c``, ``power_w``: window means (percent, Celsius, watts);
      MIG slices have no utilisation of their own, temperature and power are the whole board's.
    - ``<prefix>/gpu0/alloc_retries``, ``ooms``: the allocator's counts since the process started.
    - ``<prefix>/host/rss_mb``, ``peak_rss_mb``, ``available_mb``: this process's resident memory (last, window
      peak) and the memory the host or its container has left (window minimum), MiB.

    Under several processes one all-gather per logging step collects every rank's numbers and rank 0 logs, for each
    key above, ``<key>_min``, ``<key>_mean``, ``<key>_max`` and ``<key>_max_rank`` (the rank holding the max): the
    number of keys does not grow with the world size (``metrics=`` trims them). Validation, test and predict log
    their window once, at the end of the stage, under ``<prefix>/<stage>/...``. A value a device cannot report is
    left out, not logged as 0.

    Early warning: when a GPU's headroom falls under ``warn_headroom_mb``, or the allocator starts retrying
    failed allocations, a :class:`MemoryHeadroomWarning` names the rank, device, step and numbers, once per device
    and cause, from the sampling thread: before the out-of-memory error, not after it. With no GPU, the host's
    available memory is watched against the same threshold.

    Without a GPU, or without NVML (library missing, initialisation failing, a query unsupported), nothing raises:
    one warning (per node) says what is missing and the rest, host memory at least, is still logged. Nor does a
    timeline that cannot be written, a port that is taken or a plot that fails: each warns and is skipped.

    Each rank writes a CSV timeline of every sample as it goes (``memory_<fn>_rank<r>.csv`` under
    ``timeline_dir``, ``-v1``, ``-v2``... when the name is taken, so a resumed run keeps the first one's). Besides
    the thread's samples, the timeline gets one at each stage boundary (training start and end, each validation
    run's start and end), at each step Lightning's loggers write and at each event (at most one per 20 ms), so a
    short run has points too: host reads on the loop's thread (about 0.2 ms on CPU), no device synchronisation.

    Events go beside it in ``memory_<fn>_rank<r>.events.csv`` (``step, time_s, kind, detail``; ``events_path``):
    out-of-memory backoffs (from :class:`OOMBackoff`), skipped steps (from :class:`NaNSkip`), headroom warnings,
    validation runs, training start and end. The pack's callbacks record them on the host when they know of them
    (their ``events``), and this monitor reads those records at points where it runs anyway: no collective, no
    device read.

    At the end of the stage the timeline is plotted (``.png``) when matplotlib is installed
    (``pip install lightning-mgpu[plot]``): the memory used against what the process could hold (allocated +
    headroom on a GPU, resident + available on the host) and the ``warn_headroom_mb`` threshold below it, on an
    axis from 0, with a zoomed panel (labelled as such) when the memory used is small next to the limit; events are
    vertical lines, the peak is marked. Rank 0 prints the paths.

    With ``prometheus_port`` each rank serves the same numbers as Prometheus gauges labelled by rank and GPU UUID at
    ``http://<prometheus_host>:<prometheus_port + local rank>/metrics`` (``pip install lightning-mgpu[prometheus]``).

    Progress bar field, with ``progress_bar=True`` and a Trainer that draws a bar: ``peak_mem_mb``, whole MiB. With
    a GPU it is the peak memory held by tensors (``peak_allocated_mb``), the largest over this process's GPUs and,
    under several processes, over the ranks; without a GPU it is the process's peak resident host memory
    (``host/peak_rss_mb``, the largest over the ranks). Both are the peak of the last training logging window, as
    logged (see ``track_peak``), from the numbers already sampled and gathered: refreshed on the steps Lightning's
    loggers write (never with ``log_every_n_steps=0``), on rank 0 only, whose bar is the one drawn. Evaluation
    windows do not change it, and it is not sent to the loggers. After ``fit``, rank 0's ``training_peak_mb`` holds
    the largest of these figures over the fit's logged training windows, and ``training_peak_source`` says what it
    measures (``"GPU allocated"`` or ``"host RSS"``); both are ``None`` on other ranks.

    Args:
        sample_hz: samples per second, on the sampling thread.
        warn_headroom_mb: warn when headroom falls under this many MiB; ``None`` to warn on allocator retries only.
        log_prefix: the first part of every logged key.
        metrics: log only these metrics (names as above, without the slot: ``["peak_allocated_mb", "headroom_mb"]``);
            ``None`` logs all. The timeline, the exporter and the early warning always see every metric.
        timeline_dir: where the CSV timelines and plots go. ``None``: ``<trainer.log_dir>/memory_timeline`` with a
            logger; with ``logger=False``, ``<default_root_dir>/memory_timeline`` when ``Trainer(default_root_dir=...)``
            is a directory other than the working directory, else nowhere (one warning says how to get one): the
            working directory is not filled with files nobody asked for.
        plot: plot each timeline to a PNG at the end (needs matplotlib; skipped without it).
        track_peak: reset the allocator's peak after each sample so peaks are per window; this also resets what
            ``torch.cuda.max_memory_allocated`` reports. With ``False`` the peak is the one since process start.
        prometheus_port: serve Prometheus gauges on this port plus the local rank; 0 picks free ports; ``None``
            serves nothing.
        prometheus_host: the address the endpoint binds.
        progress_bar: show ``peak_mem_mb`` in the progress bar.

    Raises:
        TypeError: an option of the wrong type: a ``sample_hz`` or ``warn_headroom_mb`` that is not a number, a
            ``log_prefix`` that is not a string, a ``metrics`` that is not a list of strings, a ``prometheus_port``
            that is not an int, or a ``plot``, ``track_peak`` or ``progress_bar`` that is not a bool.
        ValueError: a ``sample_hz`` outside (0, 100], a negative or non-finite ``warn_headroom_mb``, an empty
            ``log_prefix``, an empty ``metrics`` or an unknown name in it, or a ``prometheus_port`` outside 0-65535.
        ModuleNotFoundError: ``prometheus_port`` is set but ``prometheus-client`` is not installed.

    Example::

        trainer = Trainer(accelerator="gpu", devices=4, strategy="mgpu",
                          callbacks=[GPUMemoryMonitor(warn_headroom_mb=2048)])
    """

    def __init__(
        self,
        sample_hz: float = 2.0,
        warn_headroom_mb: float | None = 1024.0,
        log_prefix: str = "gpu_monitor",
        metrics: list[str] | None = None,
        timeline_dir: str | None = None,
        plot: bool = True,
        track_peak: bool = True,
        prometheus_port: int | None = None,
        prometheus_host: str = "127.0.0.1",
        progress_bar: bool = True,
    ) -> None:
        owner = type(self).__name__
        check_number(owner, "sample_hz", sample_hz, 0, 100, min_inclusive=False, unit="samples per second")
        check_number(
            owner,
            "warn_headroom_mb",
            warn_headroom_mb,
            minimum=0,
            allow_none=True,
            unit="MiB",
            hint="use None to warn on allocator retries only",
        )
        check_str(owner, "log_prefix", log_prefix)
        metrics = check_sequence(
            owner, "metrics", metrics, "metric names", choices=METRICS, allow_empty=False, allow_none=True
        )
        for name, flag in (("plot", plot), ("track_peak", track_peak), ("progress_bar", progress_bar)):
            check_bool(owner, name, flag)
        check_int(owner, "prometheus_port", prometheus_port, 0, 65535, allow_none=True, hint="0 picks a free port")
        if prometheus_port is not None and not PROMETHEUS_AVAILABLE:
            raise ModuleNotFoundError(
                f"{owner}: prometheus_port={prometheus_port} needs prometheus-client: "
                f"pip install 'lightning-mgpu[prometheus]' ({PROMETHEUS_AVAILABLE.message})"
            )
        self.sample_hz = float(sample_hz)
        self.warn_headroom_mb = warn_headroom_mb
        self.log_prefix = log_prefix
        self.metrics = metrics
        self.timeline_dir = timeline_dir
        self.plot = plot
        self.track_peak = track_peak
        self.prometheus_port = prometheus_port
        self.prometheus_host = prometheus_host
        self.progress_bar = progress_bar
        self.timeline_path: Path | None = None
        self.events_path: Path | None = None
        self.plot_path: Path | None = None
        # this monitor's own events (validation runs, stage boundaries, headroom warnings)
        self.events = EventLog()
        self._warned_no_directory = False
        # the largest peak_mem_mb figure over the fit's logged training windows, on rank 0; what it measures
        self.training_peak_mb: float | None = None
        self.training_peak_source: str | None = None
        self.prometheus_url: str | None = None
        self.last_logged: dict[str, float] = {}
        self._local_rank = 0
        self._nvml = NVMLSession(warn=self._warn_on_each_node)
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._sampler: MemorySampler | None = None
        self._timeline: MemoryTimeline | None = None
        self._exporter: PrometheusExporter | None = None
        self._watch: HeadroomWatch | None = None
        self._event_file: EventFile | None = None
        self._event_sources: list[list[Any]] = []  # [log, events of it already read]
        self._gather: RankGather | None = None
        self._service: StepService | None = None  # the fit's, for the gather shared with the other monitors
        self._rank = 0
        self._world_size = 1

    @property
    def sampler(self) -> MemorySampler | None:
        """The running sampler, between ``setup`` and ``teardown``."""
        return self._sampler

    @property
    def exporter(self) -> PrometheusExporter | None:
        """The Prometheus endpoint this monitor serves, while it runs (``PerformanceMonitor`` adds its gauges)."""
        return self._exporter

    @property
    def warnings_issued(self) -> list[str]:
        """Causes warned about in the last stage (``"gpu0:headroom"``, ``"gpu0:retries"``, ``"host:headroom"``)."""
        return list(self._watch.warned) if self._watch is not None else []

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        self._shutdown(print_paths=False)
        self._rank, self._local_rank, self._world_size = trainer.global_rank, trainer.local_rank, trainer.world_size
        fn = str(getattr(stage, "value", stage))
        # the collectives first, on every rank, before anything that could fail on one rank only
        directory = self._timeline_directory(trainer)
        self._setup_gather(trainer)

        gpus = self._monitored_gpus(trainer)
        sampler = MemorySampler(
            gpus,
            self._nvml,
            self.sample_hz,
            step=lambda: compat.logger_step(trainer),
            track_peak=self.track_peak,
            warn=self._warn_on_this_rank,
        )
        sampler.set_stage(_FIRST_STAGE.get(fn, fn))
        self._watch = HeadroomWatch(
            self.warn_headroom_mb, warn=lambda message: self._warn_headroom(message, sampler), rank=self._rank
        )
        sampler.listeners = [self._watch]
        self.plot_path = None
        if fn == "fit":
            self.training_peak_mb, self.training_peak_source = None, None
        self._event_sources = [[log, log.recorded] for log in _event_logs(trainer)]
        self.timeline_path = self.events_path = None
        if directory is not None:
            try:
                self._timeline = MemoryTimeline(
                    unused_path(directory / f"memory_{fn}_rank{self._rank}.csv"), sampler.keys
                )
                self.timeline_path = self._timeline.path
                sampler.listeners.append(self._timeline)
                self._event_file = EventFile(events_path(self._timeline.path), sampler.started_at)
                self.events_path = self._event_file.path
            except OSError as err:
                self._warn_on_this_rank(f"cannot write the memory timeline under {directory}: {err}; it is skipped")
        self.prometheus_url = None
        if self.prometheus_port is not None:
            self._start_exporter(trainer.local_rank, gpus)
            if self._exporter is not None:
                sampler.listeners.append(self._exporter)
        self._sampler = sampler
        sampler.start()
        if self._event_file is not None:
            self._event_file.time_origin = sampler.started_at

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._sampler is not None:
            self._sampler.set_stage("train", fresh=False)
            self._mark(trainer, "stage", "train start")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._sampler is not None:
            self._mark(trainer, "stage", "train end")

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._sampler is None:
            return
        if self._collect_events():  # a Python comparison per source when nothing happened
            self._sampler.sample_now()
        # Lightning's own decision, so these rows land on the steps its loggers write anyway, once per optimizer step
        if not compat.is_logging_step(trainer):
            return
        if pl_module.automatic_optimization and compat.should_accumulate(trainer):
            return
        self._sampler.sample_now()
        window = self._log_window(trainer, stage=None, key=(trainer.current_epoch, batch_idx, trainer.global_step))
        if window is None:
            return
        peak = peak_memory_mb(window)
        if peak is not None and (self.training_peak_mb is None or peak > self.training_peak_mb):
            gpu = any(not key.startswith("host/") and "peak_allocated_mb" in key for key in window)
            self.training_peak_mb, self.training_peak_source = peak, "GPU allocated" if gpu else "host RSS"
        if peak is not None and self.progress_bar and has_progress_bar(trainer):
            # rank 0 alone holds the gathered window, and calls this alone: no sync_dist, nothing to wait for
            show_in_progress_bar(pl_module, "peak_mem_mb", round(peak), rank_zero_only=True)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._sampler is not None:
            self._sampler.set_stage("sanity_check" if trainer.sanity_checking else "validate")
            self._mark(trainer, "validation", "sanity check" if trainer.sanity_checking else "")

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end_stage(trainer, "validate")

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._sampler is not None:
            self._sampler.set_stage("test")

    @override
    def on_test_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end_stage(trainer, "test")

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._sampler is not None:
            self._sampler.set_stage("predict")

    @override
    def on_predict_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end_stage(trainer, "predict")

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # no plot here: a preempted job's grace period is for the checkpoint, not for matplotlib
        self._shutdown(print_paths=True, plot=False)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._shutdown(print_paths=True)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # threads, open files, HTTP servers and process groups cannot travel into spawned workers
        for name in ("_sampler", "_timeline", "_exporter", "_watch", "_gather", "_service", "_event_file"):
            state[name] = None
        return state

    def _end_stage(self, trainer: "pl.Trainer", stage: str) -> None:
        if self._sampler is None:
            return
        self._sampler.sample_now(min_gap_s=0.0)
        if not trainer.sanity_checking:
            self._log_window(trainer, stage=stage)
        if trainer.state.fn == TrainerFn.FITTING:
            # back to training, whose window still holds the samples from before this validation
            self._sampler.set_stage("train", fresh=False)

    def _timeline_directory(self, trainer: "pl.Trainer") -> Path | None:
        """Where the timeline goes (see ``timeline_dir``); ``None`` for nowhere. Calls ``log_dir`` on every rank."""
        if self.timeline_dir is not None:
            return Path(self.timeline_dir)
        log_dir = trainer.log_dir  # a broadcast from rank 0: every rank takes the same decision below
        if trainer.loggers and log_dir:
            return Path(log_dir) / "memory_timeline"
        root = Path(trainer.default_root_dir)
        if root.resolve() != Path.cwd().resolve():
            return root / "memory_timeline"
        if not self._warned_no_directory:
            self._warned_no_directory = True
            rank_zero_warn(
                f"{type(self).__name__}: no logger and no Trainer(default_root_dir=...), so no memory timeline is "
                "written (rather than into the working directory); pass timeline_dir=... or default_root_dir=... "
                "for one. Logging and the early warning work as usual."
            )
        return None

    def _mark(self, trainer: "pl.Trainer", kind: EventKind, detail: str) -> None:
        """Record one of this monitor's events, take a sample there and write what every source recorded."""
        self.events.record(trainer.global_step, kind, detail)
        self._collect_events()
        if self._sampler is not None:
            self._sampler.sample_now(min_gap_s=0.0)

    def _collect_events(self) -> int:
        """Write what the event logs recorded since the last look; returns how many events that was."""
        new = []
        for source in self._event_sources:
            log, seen = source
            if log.recorded != seen:
                new += log.since(seen)
                source[1] = log.recorded
        if new and self._event_file is not None:
            try:
                self._event_file.write(sorted(new, key=lambda event: event.time))
            except OSError as err:
                self._event_file = None
                self._warn_on_this_rank(f"cannot write the events beside the memory timeline: {err}; they are skipped")
        return len(new)

    def _monitored_gpus(self, trainer: "pl.Trainer") -> list[MonitoredGPU]:
        strategy = trainer.strategy
        if strategy.root_device.type != "cuda":
            rank_zero_warn(
                f"{type(self).__name__}: this run uses no CUDA device ({strategy.root_device}); "
                "only host memory is monitored."
            )
            return []
        # DataParallel drives every device from one process; every other strategy uses its root device
        devices = strategy.parallel_devices if isinstance(strategy, DataParallelStrategy) else None
        indices = [d.index for d in devices] if devices else [strategy.root_device.index or 0]
        nvml_devices = {}
        if self._nvml.start():
            nvml_devices = self._nvml.map_torch_devices(indices, [torch_device_uuid(i) for i in indices])
        return [MonitoredGPU(f"gpu{slot}", index, nvml_devices.get(index)) for slot, index in enumerate(indices)]

    def _setup_gather(self, trainer: "pl.Trainer") -> None:
        # shared with the other monitors of the run (PerformanceMonitor): one all-gather per logging step in all
        self._service = step_service(trainer)
        self._gather = self._service.join_rank_gather(
            trainer,
            self,
            self._window_for_gather,
            compat.process_group_timeout(trainer.strategy),
            self._warn_on_this_rank,
        )

    def _window_for_gather(self) -> torch.Tensor:
        assert self._sampler is not None
        self._sampler.sample_now()
        return self._sampler.window_vector()

    def _start_exporter(self, local_rank: int, gpus: list[MonitoredGPU]) -> None:
        assert self.prometheus_port is not None
        port = self.prometheus_port + local_rank if self.prometheus_port else 0
        exporter = PrometheusExporter(port, self.prometheus_host, self._rank, gpus, GPU_METRICS, HOST_METRICS)
        try:
            if port > 65535:
                raise OverflowError(f"port {self.prometheus_port} + local rank {local_rank} is above 65535")
            self.prometheus_url = exporter.start()
            self._exporter = exporter
        except (OSError, OverflowError) as err:
            self._warn_on_this_rank(
                f"cannot serve Prometheus gauges on {self.prometheus_host}:{port}: {err}; training goes on without"
            )

    def _log_window(self, trainer: "pl.Trainer", stage: str | None, key: Any = None) -> dict[str, float] | None:
        """Log the window to the loggers; return it, every key, unprefixed (``None`` on ranks other than 0).

        A training window (``stage=None``) travels in the run's shared logging-step gather, under ``key``.
        """
        assert self._sampler is not None
        if self._gather is not None:
            if stage is None:
                gathered = self._gather.gather(self, key)
            else:
                gathered = self._gather.gather_now(self._sampler.window_vector())
            if self._rank != 0:
                return None
            window = summarize_across_ranks(gathered, self._sampler.keys)
        else:
            window = self._sampler.take_window()
        metrics = window
        if self.metrics is not None:
            metrics = {key: value for key, value in metrics.items() if _metric_of(key) in self.metrics}
        prefix = self.log_prefix if stage is None else f"{self.log_prefix}/{stage}"
        metrics = {f"{prefix}/{key}": value for key, value in metrics.items()}
        self.last_logged = metrics
        step = compat.logger_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        return window

    def _warn_headroom(self, message: str, sampler: MemorySampler) -> None:
        # called from the sampler thread, inside the sample that crossed the line: its step is the latest one
        step = sampler.latest.step if sampler.latest is not None else 0
        cause = "allocator retries" if "retry" in message else f"headroom < {self.warn_headroom_mb:g} MiB"
        self.events.record(step, "headroom_warning", cause)
        warnings.warn(message, MemoryHeadroomWarning, stacklevel=2)

    def _warn_on_this_rank(self, message: str) -> None:
        prefix = "" if message.startswith(type(self).__name__) else f"{type(self).__name__}: "
        warnings.warn(f"{prefix}{message} (rank {self._rank})", UserWarning, stacklevel=2)

    def _warn_on_each_node(self, message: str) -> None:
        # NVML is per machine: one warning per node, so a node without NVML is not hidden behind rank 0's
        if self._local_rank == 0:
            warnings.warn(f"{type(self).__name__}: {message} (rank {self._rank})", UserWarning, stacklevel=2)

    def _shutdown(self, print_paths: bool, plot: bool = True) -> None:
        """Stop everything this stage started; each part on its own, so one failure cannot leak the others."""
        sampler, timeline, exporter = self._sampler, self._timeline, self._exporter
        service = self._service
        watch = self._watch
        self._collect_events()
        event_file = self._event_file
        self._reset_run_state()
        self._watch = watch
        if sampler is not None:
            sampler.stop()
        if exporter is not None:
            self.prometheus_url = None
            try:
                exporter.stop()
            except Exception as err:
                self._warn_on_this_rank(f"stopping the Prometheus endpoint failed: {err!r}")
        if service is not None:
            service.leave_rank_gather(self)
        if event_file is not None:
            event_file.close()
        if timeline is None:
            return
        timeline.close()
        if plot and self.plot and MATPLOTLIB_AVAILABLE:
            try:
                self.plot_path = plot_timeline(
                    timeline.path, timeline.path.with_suffix(".png"), warn_headroom_mb=self.warn_headroom_mb
                )
            except Exception as err:
                self._warn_on_this_rank(f"plotting {timeline.path} failed: {err!r}; the CSV is complete")
        if print_paths:
            written = ", ".join(str(p) for p in (timeline.path, self.plot_path, self.events_path) if p is not None)
            rank_zero_info(
                f"{type(self).__name__}: memory timeline of rank 0 written to {written}; other ranks wrote theirs "
                "beside it"
            )


def _event_logs(trainer: "pl.Trainer") -> list[EventLog]:
    """The event records of the trainer's callbacks that record events (this monitor's included)."""
    return [cb.events for cb in trainer.callbacks if isinstance(cb, RecordsEvents)]


def _metric_of(key: str) -> str:
    metric = key.rsplit("/", 1)[1]
    for statistic in RANK_STATISTICS:
        if metric.endswith(f"_{statistic}"):
            return metric[: -len(statistic) - 1]
    return metric


def peak_memory_mb(window: dict[str, float]) -> float | None:
    """The largest GPU peak allocated memory in a window, or the host's peak RSS when it holds no GPU's; MiB.

    ``window`` is one process's (``"gpu0/peak_allocated_mb"``) or the summary across ranks
    (``"gpu0/peak_allocated_mb_max"``); ``None`` when it holds neither.
    """
    gpu: list[float] = []
    host: list[float] = []
    for key, value in window.items():
        slot, metric = key.rsplit("/", 1)
        if metric.removesuffix("_max") == "peak_allocated_mb" and slot != "host":
            gpu.append(value)
        elif metric.removesuffix("_max") == "peak_rss_mb" and slot == "host":
            host.append(value)
    peaks = gpu or host
    return max(peaks) if peaks else None
