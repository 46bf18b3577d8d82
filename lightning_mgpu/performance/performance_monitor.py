"""Where each rank's training time goes: step, data wait, compute, optimizer, communication, throughput and MFU."""

import math
import socket
import time
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core._imports import PROMETHEUS_AVAILABLE
from lightning_mgpu.core._logging import has_progress_bar, show_in_progress_bar
from lightning_mgpu.core.nvml import torch_device_uuid
from lightning_mgpu.core.prometheus_exporter import PrometheusExporter, ServesPrometheus
from lightning_mgpu.core.rank_gather import RankGather, summarize_across_ranks
from lightning_mgpu.core.step_service import StepService, step_service
from lightning_mgpu.core.step_timing import STEP_METRICS, CommTimer, StepTimer, clock_for, window_figures
from lightning_mgpu.core.training_events import EventLog, RecordsEvents
from lightning_mgpu.core.validation import check_bool, check_int, check_number, check_positive, check_str
from lightning_mgpu.ddp.data_parallel import DataParallelStrategy
from lightning_mgpu.performance.flops import FlopCount, matmul_dtype, measure_matmul_flops, table_peak_flops
from lightning_mgpu.performance.stragglers import StragglerWatch


class StragglerWarning(UserWarning):
    """Emitted by :class:`PerformanceMonitor` when one rank keeps the others waiting."""


class PerformanceMonitor(RecordsEvents, Callback):
    """Log, per optimizer step and per rank, where training time goes, with no host synchronisation.

    The training thread reads the host's clock at the loop's hooks: a batch arriving, the optimizer starting, the
    batch ending. On a GPU the device-side figures (forward+backward, optimizer, communication) come from CUDA events
    read once they have completed, up to one logging window late, never by waiting for the device. Under the pack's
    DDP (``strategy="mgpu"`` or :class:`DDPStrategy`) the gradient reduction runs through a timed communication hook
    (DDP's own all-reduce, or the ``comm_hook`` chosen), which marks when each bucket was handed over and when its
    reduction finished. The first optimizer step of each fit is left out: it warms up, and its FLOPs are counted.

    Logged keys, means per optimizer step over the logging window (Lightning's ``log_every_n_steps``):

    - ``<prefix>/step_ms``: wall time of an optimizer step, from the previous step's end (validation excluded).
    - ``<prefix>/data_wait_ms``: time between batches: waiting for the loader (and whatever else runs between two
      batches, such as a checkpoint written by a callback after this one).
    - ``<prefix>/fwd_bwd_ms``: forward and backward, over the step's micro-batches, gradient reduction included.
    - ``<prefix>/optimizer_ms``: the optimizer step, from ``on_before_optimizer_step`` to the batch's end.
    - ``<prefix>/comm_ms``: time the gradient buckets were being reduced (the union of their spans).
    - ``<prefix>/comm_exposed_ms``: the part of it after the backward's last bucket was handed over: communication
      nothing overlapped, including the wait for slower ranks; ``comm_overlap_pct`` is the rest, in percent.
    - ``<prefix>/busy_ms``: ``step_ms - comm_exposed_ms``, the time this rank was not waiting for others.
    - ``<prefix>/samples_per_sec``, ``tokens_per_sec``: this rank's throughput. Samples are Lightning's batch size of
      each batch; tokens are counted by the module's ``tokens_in_batch(batch)`` method if it has one (it must return
      a Python int: a device tensor would be read on the host every batch), else as the
      number of elements of ``batch[tokens_key]`` when the batch is a mapping holding that key.
    - ``<prefix>/tflops``, ``mfu_pct``: model FLOP/s achieved (forward and backward FLOPs of one sample, counted
      once by ``torch.utils.flop_counter`` on the fit's first batch, times samples per second) and their share of
      the device's peak: ``peak_tflops`` if given; else NVIDIA's data-sheet dense peak for the GPU and the run's
      precision (bf16/fp16, tf32 when ``torch.set_float32_matmul_precision`` allows it, fp32); on a CPU a matrix
      product measured at set-up. An unknown GPU logs no MFU (one warning says to pass ``peak_tflops``).

    Under several processes one all-gather per logging step, shared with :class:`GPUMemoryMonitor` when both run,
    brings every rank's figures to rank 0, which logs ``<key>_min``, ``_mean``, ``_max`` and ``_max_rank`` for each key
    above, and ``<prefix>/samples_per_sec`` and ``tokens_per_sec`` summed over the ranks. One process logs the keys
    themselves. An unknown figure is left out, not logged as 0. No other collective runs during training.

    Straggler warning: when a rank's ``busy_ms`` stays more than ``straggler_margin`` above the other ranks'
    median for ``straggler_windows`` logging windows in a row, rank 0 warns (:class:`StragglerWarning`) naming the
    rank, its host and GPU UUID, and records a ``straggler`` event (the memory timeline marks it). Under DDP every
    rank's step lasts as long as the slowest one's, so step times cannot tell; busy time can, and it needs the timed
    communication hook: under other strategies stragglers are not detected (one message says so).

    Progress bar field, with ``progress_bar=True`` and a bar drawn: ``samples_per_sec`` summed over the ranks,
    refreshed at logging steps on rank 0. With ``prometheus_port`` each rank serves its figures as
    ``lightning_mgpu_perf_<metric>`` gauges labelled by rank and GPU UUID at ``http://<host>:<port + local rank>``;
    without it they join a running :class:`GPUMemoryMonitor`'s endpoint. DCGM has no per-step timing fields, so no
    name here overlaps one of DCGM's; GPU utilisation and memory are :class:`GPUMemoryMonitor`'s.

    Cost on the training thread: about 20 us of Python per batch (clock reads, the batch size from its first tensor,
    the step record; measured in ``benchmarks/``), and the shared all-gather on logging steps. With the timed hook,
    DDP's reduction is issued from Python, one call per bucket. Samples and tokens are counted from each batch's
    shape; tokens are looked for in the first batch and, if it is not a mapping, no further.

    Args:
        log_prefix: the first part of every logged key.
        tokens_key: the key of a mapping batch whose number of elements counts its tokens; ``None`` counts none.
        count_flops: count the model's FLOPs on the first batch, for ``tflops`` and ``mfu_pct``.
        peak_tflops: the device's peak TFLOP/s for the run's precision, overriding the table or the CPU measurement.
        comm_timing: time the gradient reduction through a DDP communication hook (under the pack's DDP only).
        straggler_margin: how far above the other ranks' median busy time a straggler is (0.2: 20%).
        straggler_windows: logging windows in a row a rank must be that slow before it is named.
        prometheus_port: serve gauges on this port plus the local rank; 0 picks free ports; ``None`` serves none.
        prometheus_host: the address the endpoint binds.
        progress_bar: show ``samples_per_sec`` in the progress bar.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an empty ``log_prefix`` or ``tokens_key``, a ``peak_tflops`` or ``straggler_margin`` that is not
            positive, a ``straggler_windows`` under 1, or a ``prometheus_port`` outside 0-65535.
        ModuleNotFoundError: ``prometheus_port`` is set but ``prometheus-client`` is not installed.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, strategy="mgpu", callbacks=[PerformanceMonitor()])
    """

    def __init__(
        self,
        log_prefix: str = "perf",
        tokens_key: str | None = "input_ids",
        count_flops: bool = True,
        peak_tflops: float | None = None,
        comm_timing: bool = True,
        straggler_margin: float = 0.2,
        straggler_windows: int = 3,
        prometheus_port: int | None = None,
        prometheus_host: str = "127.0.0.1",
        progress_bar: bool = True,
    ) -> None:
        owner = type(self).__name__
        check_str(owner, "log_prefix", log_prefix)
        if tokens_key is not None:
            check_str(owner, "tokens_key", tokens_key, hint="use None to count no tokens")
        for name, flag in (("count_flops", count_flops), ("comm_timing", comm_timing), ("progress_bar", progress_bar)):
            check_bool(owner, name, flag)
        check_positive(owner, "peak_tflops", peak_tflops, allow_none=True, unit="TFLOP/s", hint="None looks it up")
        check_number(owner, "straggler_margin", straggler_margin, 0, min_inclusive=False, hint="0.2 means 20% slower")
        check_int(owner, "straggler_windows", straggler_windows, minimum=1)
        check_int(owner, "prometheus_port", prometheus_port, 0, 65535, allow_none=True, hint="0 picks a free port")
        check_str(owner, "prometheus_host", prometheus_host)
        if prometheus_port is not None and not PROMETHEUS_AVAILABLE:
            raise ModuleNotFoundError(
                f"{owner}: prometheus_port={prometheus_port} needs prometheus-client: "
                f"pip install 'lightning-mgpu[prometheus]' ({PROMETHEUS_AVAILABLE.message})"
            )
        self.log_prefix = log_prefix
        self.tokens_key = tokens_key
        self.count_flops = count_flops
        self.peak_tflops = peak_tflops
        self.comm_timing = comm_timing
        self.straggler_margin = float(straggler_margin)
        self.straggler_windows = straggler_windows
        self.prometheus_port = prometheus_port
        self.prometheus_host = prometheus_host
        self.progress_bar = progress_bar
        # this monitor's events (straggler warnings), for GPUMemoryMonitor's timeline
        self.events = EventLog()
        self.last_logged: dict[str, float] = {}
        # this rank's own figures of the last window, unprefixed, the unknown ones left out (on every rank)
        self.last_window: dict[str, float] = {}
        # per fit: the ranks named as stragglers, FLOPs per sample, the peak FLOP/s used, where they came from
        self.stragglers: list[int] = []
        self.flops_per_sample: float | None = None
        self.peak_flops: float | None = None
        self.peak_source: str | None = None
        self.prometheus_url: str | None = None
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._timer: StepTimer | None = None
        self._flops: FlopCount | None = None
        self._gather: RankGather | None = None
        self._service: StepService | None = None  # the fit's, for the reductions' timing and the shared gather
        self._exporter: PrometheusExporter | None = None
        self._own_exporter = False
        self._watch: StragglerWatch | None = None
        self._identities: list[str] = []
        self._rank = 0
        self._world_size = 1
        self._comm_timed = False
        self._uuid = ""
        self._warned_batch_size = False
        self._count_tokens: Any = None
        self._automatic = True
        self._stepping = False
        self._hook_marks_steps = True
        self._logging_step: Any = None
        self._counts_tokens = False
        self._flops_pending = False

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if str(getattr(stage, "value", stage)) != "fit":
            return
        compat.check_lightning_internals(trainer, type(self).__name__)
        self._shutdown()
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        device = trainer.strategy.root_device
        service = self._service = step_service(trainer)
        comm = CommTimer(clock_for(device)) if self.comm_timing and service.reads_requests else None
        service.time_reductions(comm)  # read when the strategy wraps the model, after this hook
        self._timer = StepTimer(clock_for(device), comm)
        self._flops = FlopCount() if self.count_flops else None
        if self._flops is not None and isinstance(trainer.strategy, DataParallelStrategy):
            # the replicas run in threads of their own, which a dispatch mode does not reach
            self._flops = None
            rank_zero_info(f"{type(self).__name__}: FLOPs are not counted under DataParallel; no MFU is logged")
        self.stragglers, self.flops_per_sample = [], None
        self._watch = StragglerWatch(self.straggler_margin, self.straggler_windows)
        self._uuid = (torch_device_uuid(device.index or 0) if device.type == "cuda" else None) or ""
        identity = f"{socket.gethostname()}, {self._uuid or device}"
        # the collectives first, on every rank, before anything that could fail on one rank only
        self._gather = service.join_rank_gather(
            trainer, self, self._window_vector, compat.process_group_timeout(trainer.strategy), self._warn
        )
        self._identities = self._gather.gather_objects(identity) if self._gather is not None else [identity]
        self.peak_flops, self.peak_source = self._peak_flops(trainer, device) if self._flops else (None, None)
        self._start_exporter(trainer)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._timer is None:
            return
        self._comm_timed = self._service is not None and self._service.reductions_timed
        if self._world_size > 1 and not self._comm_timed:
            rank_zero_info(
                f"{type(self).__name__}: the gradient reduction is not timed under {type(trainer.strategy).__name__}"
                + ("" if self.comm_timing else " (comm_timing=False)")
                + "; comm and busy times are not logged and stragglers are not detected (they need lightning_mgpu's "
                "DDP without a ddp_comm_hook of Lightning's)."
            )
        if self._exporter is None and self.prometheus_port is None:
            # join the endpoint a callback of this fit serves (GPUMemoryMonitor's: its setup has run by now, wherever
            # it is in the list)
            serving = (cb.exporter for cb in trainer.callbacks if isinstance(cb, ServesPrometheus))
            self._exporter = next((exporter for exporter in serving if exporter is not None), None)
        count = getattr(pl_module, "tokens_in_batch", None)
        self._count_tokens = count if callable(count) else None
        self._counts_tokens = self._count_tokens is not None or self.tokens_key is not None
        self._flops_pending = self._flops is not None and self._flops.total is None
        self._automatic = pl_module.automatic_optimization
        # on_before_optimizer_step fires where, and only where, the optimizer steps; not under a strategy that
        # accumulates by itself (DeepSpeed), where it fires every micro-batch
        self._hook_marks_steps = self._automatic and not trainer.strategy.handles_gradient_accumulation
        self._logging_step = compat.training_logging_check(trainer)
        self._timer.start(time.perf_counter())

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        timer = self._timer
        if timer is None:
            return
        # the common layouts inline: Lightning's extract_batch_size walks the batch (about 10 us in the loop)
        first = batch[0] if type(batch) in (tuple, list) and batch else batch
        samples = first.shape[0] if type(first) is torch.Tensor and first.ndim else self._samples(batch)
        timer.batch_start(now, samples, self._tokens(batch) if self._counts_tokens else None)
        if self._flops_pending:
            self._flops_pending = False
            assert self._flops is not None
            self._flops.start()

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        # under manual optimization the step's optimizers may step between forward and backward passes: the batch is
        # one span (fwd_bwd_ms), and FLOPs are counted to its end
        if self._timer is None or not self._automatic:
            return
        self._stepping = True
        if self._flops is not None and self._flops.running:
            self._stop_counting_flops()
        self._timer.optimizer_start()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        timer = self._timer
        if timer is None:
            return
        if self._flops is not None and self._flops.running:
            self._stop_counting_flops()
        if self._hook_marks_steps:
            stepped = self._stepping
        else:
            stepped = not (self._automatic and compat.should_accumulate(trainer))
        self._stepping = False
        timer.batch_end(now, stepped)
        if stepped and self._logging_step():
            self._log(trainer, pl_module, key=(trainer.current_epoch, batch_idx, trainer.global_step))

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._timer is not None and not trainer.sanity_checking:
            self._stop_counting_flops()
            self._timer.pause(time.perf_counter())

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._timer is not None:
            self._timer.resume(time.perf_counter())

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._stop_counting_flops()
        self._shutdown()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if str(getattr(stage, "value", stage)) == "fit":
            self._shutdown()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # timers holding CUDA events, process groups and HTTP servers cannot travel into spawned workers
        for name in (
            "_timer",
            "_flops",
            "_gather",
            "_service",
            "_exporter",
            "_watch",
            "_count_tokens",
            "_logging_step",
        ):
            state[name] = None
        return state

    def _samples(self, batch: Any) -> int | None:
        try:
            return int(extract_batch_size(batch))
        except Exception as err:
            if not self._warned_batch_size:
                self._warned_batch_size = True
                self._warn(f"cannot tell the batch size ({err}); samples_per_sec and MFU are not logged")
            return None

    def _tokens(self, batch: Any) -> int | None:
        if self._count_tokens is not None:
            return int(self._count_tokens(batch))
        if type(batch) is dict or isinstance(batch, Mapping):
            value = batch.get(self.tokens_key)
            if isinstance(value, torch.Tensor):
                return value.numel()  # the shape, not the values: no device read
            return None
        self._counts_tokens = False  # batches of this fit are not mappings: stop looking
        return None

    # ------------------------------------------------------------------------------------------ attempts
    def save_attempt(self) -> int | None:
        """The FLOPs counted so far, while the first batch is counted: an attempt OOMBackoff drops must not count."""
        flops = self._flops
        return flops.counted() if flops is not None and flops.running else None

    def restore_attempt(self, saved: int | None) -> None:
        """Leave the dropped attempt's FLOPs out of the count (its redo is counted instead)."""
        flops = self._flops
        if saved is not None and flops is not None and flops.running:
            flops.drop_since(saved)

    def _stop_counting_flops(self) -> None:
        if self._flops is None or not self._flops.running or self._timer is None:
            return
        total = self._flops.stop()
        samples = self._timer.current_samples
        if total and samples:
            self.flops_per_sample = total / samples

    def _peak_flops(self, trainer: "pl.Trainer", device: torch.device) -> tuple[float | None, str | None]:
        if not self.count_flops:
            return None, None
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12, "peak_tflops"
        dtype = matmul_dtype(str(trainer.precision))
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            peak = table_peak_flops(name, dtype)
            if peak is None:
                rank_zero_warn(
                    f"{type(self).__name__}: no peak FLOP/s known for {name} in {dtype}; mfu_pct is not logged. "
                    "Pass peak_tflops=<the data sheet's dense figure> for it."
                )
                return None, None
            return peak, f"{name} {dtype} data sheet"
        measured_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        peak = measure_matmul_flops(device, measured_dtype)
        return peak, f"measured {str(measured_dtype).removeprefix('torch.')} matmul on {device}"

    def _start_exporter(self, trainer: "pl.Trainer") -> None:
        self.prometheus_url = None
        if self.prometheus_port is None:
            return
        port = self.prometheus_port + trainer.local_rank if self.prometheus_port else 0
        exporter = PrometheusExporter(port, self.prometheus_host, self._rank, [])
        try:
            if port > 65535:
                raise OverflowError(f"port {self.prometheus_port} + local rank {trainer.local_rank} is above 65535")
            self.prometheus_url = exporter.start()
            self._exporter, self._own_exporter = exporter, True
        except (OSError, OverflowError) as err:
            self._warn(f"cannot serve Prometheus gauges on {self.prometheus_host}:{port}: {err}; training goes on")

    def _local_figures(self) -> dict[str, float]:
        assert self._timer is not None
        figures = window_figures(
            self._timer.take_window(),
            comm_timed=self._comm_timed,
            multi_process=self._world_size > 1,
            flops_per_sample=self.flops_per_sample,
            peak_flops=self.peak_flops,
        )
        self.last_window = {name: value for name, value in figures.items() if not math.isnan(value)}
        return figures

    def _window_vector(self) -> torch.Tensor:
        figures = self._local_figures()
        return torch.tensor([figures[key] for key in STEP_METRICS], dtype=torch.float64)

    def _export(self, figures: dict[str, float]) -> None:
        if self._exporter is None:
            return
        try:
            self._exporter.set_performance(figures, self._uuid)
        except Exception as err:
            self._exporter = None
            self._warn(f"updating the Prometheus gauges failed: {err!r}; they are no longer updated")

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", key: Any) -> None:
        prefix = self.log_prefix
        if self._gather is None:
            figures = self._local_figures()
            self._export(figures)
            metrics = {f"{prefix}/{name}": value for name, value in figures.items() if not math.isnan(value)}
            total = figures["samples_per_sec"]
        else:
            gathered = self._gather.gather(self, key)
            # after the collective: nothing that could fail on one rank runs before it
            self._export(self.last_window)
            if self._rank != 0:
                return
            summary = summarize_across_ranks(gathered, list(STEP_METRICS))
            metrics = {f"{prefix}/{name}": value for name, value in summary.items()}
            for rate in ("samples_per_sec", "tokens_per_sec"):
                column = gathered[:, STEP_METRICS.index(rate)]
                if not bool(torch.isnan(column).any()):
                    metrics[f"{prefix}/{rate}"] = float(column.sum())
            total = metrics.get(f"{prefix}/samples_per_sec", math.nan)
            self._check_stragglers(trainer, gathered[:, STEP_METRICS.index("busy_ms")].tolist())
        self.last_logged = metrics
        step = compat.logger_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if self.progress_bar and not math.isnan(total) and has_progress_bar(trainer):
            show_in_progress_bar(pl_module, "samples_per_sec", round(total, 1), rank_zero_only=True)

    def _check_stragglers(self, trainer: "pl.Trainer", busy: list[float]) -> None:
        assert self._watch is not None
        for straggler in self._watch.update(busy):
            self.stragglers.append(straggler.rank)
            identity = self._identities[straggler.rank] if straggler.rank < len(self._identities) else "?"
            excess = 100.0 * (straggler.value / straggler.others_median - 1.0)
            self.events.record(trainer.global_step, "straggler", f"rank {straggler.rank}")
            warnings.warn(
                f"{type(self).__name__}: rank {straggler.rank} ({identity}) is a straggler: busy "
                f"{straggler.value:.1f} ms per step, {excess:.0f}% above the other ranks' median of "
                f"{straggler.others_median:.1f} ms, for {straggler.windows} logging windows in a row (up to step "
                f"{trainer.global_step}); the other ranks wait for it in the gradient all-reduce.",
                StragglerWarning,
                stacklevel=2,
            )

    def _warn(self, message: str) -> None:
        warnings.warn(f"{type(self).__name__}: {message} (rank {self._rank})", UserWarning, stacklevel=2)

    def _shutdown(self) -> None:
        if self._flops is not None and self._flops.running:
            self._flops.stop()
        service, exporter, own = self._service, self._exporter, self._own_exporter
        self._reset_run_state()
        if service is not None:
            service.time_reductions(None)
            service.leave_rank_gather(self)
        if exporter is not None and own:
            self.prometheus_url = None
            try:
                exporter.stop()
            except Exception as err:
                self._warn(f"stopping the Prometheus endpoint failed: {err!r}")
