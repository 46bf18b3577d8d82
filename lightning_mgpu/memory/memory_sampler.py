"""A background thread that samples device and host memory, so the training loop only reads what was sampled.

Each sample is a flat mapping from ``"<slot>/<metric>"`` (``"gpu0/allocated_mb"``, ``"host/rss_mb"``) to a float,
``None`` where the value is unknown. Between two reads, samples are folded into a window: peaks take the maximum,
free memory and headroom the minimum, utilisation, temperature and power the mean, everything else the last value.
"""

import math
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_mgpu.core.host_memory import MIB, host_available_mb, process_rss_mb
from lightning_mgpu.core.nvml import NVMLDevice, NVMLSession
from lightning_mgpu.core.validation import check_bool, check_positive

GPU_METRICS: tuple[str, ...] = (
    "allocated_mb",
    "peak_allocated_mb",
    "reserved_mb",
    "free_mb",
    "headroom_mb",
    "utilization_pct",
    "temperature_c",
    "power_w",
    "alloc_retries",
    "ooms",
)
HOST_METRICS: tuple[str, ...] = ("rss_mb", "peak_rss_mb", "available_mb")
# the GPU metrics read from NVML, not from torch's allocator
_NVML_METRICS: tuple[str, ...] = ("free_mb", "utilization_pct", "temperature_c", "power_w")
_MAX = ("peak_allocated_mb", "peak_rss_mb")
_MIN = ("free_mb", "headroom_mb", "available_mb")
_MEAN = ("utilization_pct", "temperature_c", "power_w")


@dataclass(frozen=True)
class MonitoredGPU:
    """One CUDA device of this process and the NVML device it was matched to (``None`` when unmatched).

    Args:
        slot: the key prefix, ``"gpu0"`` for this process's first device.
        torch_index: the device's index in torch (after ``CUDA_VISIBLE_DEVICES``).
        nvml: the matched NVML device.
    """

    slot: str
    torch_index: int
    nvml: NVMLDevice | None = None

    @property
    def uuid(self) -> str:
        """The NVML UUID, or ``"unknown"``."""
        return self.nvml.uuid if self.nvml is not None else "unknown"


@dataclass
class MemorySample:
    """What one tick of the sampler read."""

    time_s: float
    step: int
    stage: str
    values: dict[str, float | None] = field(default_factory=dict)


def _name(listener: Any) -> str:
    return type(listener).__name__ if not hasattr(listener, "__name__") else listener.__name__


def metric_keys(gpus: Sequence[MonitoredGPU], host: bool = True) -> list[str]:
    """The fixed order of the keys a sampler over ``gpus`` produces."""
    keys = [f"{gpu.slot}/{metric}" for gpu in gpus for metric in GPU_METRICS]
    return keys + [f"host/{metric}" for metric in HOST_METRICS] if host else keys


class _Window:
    """Running reductions of the samples since the last ``take``."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: dict[str, float | None]) -> None:
        for key, value in values.items():
            if value is None or math.isnan(value):
                continue
            metric = key.rsplit("/", 1)[1]
            old = self.values.get(key)
            if old is None or metric not in (*_MAX, *_MIN, *_MEAN):
                self.values[key] = value
            elif metric in _MAX:
                self.values[key] = max(old, value)
            elif metric in _MIN:
                self.values[key] = min(old, value)
            else:
                self.values[key] = old + value
            self.counts[key] = self.counts.get(key, 0) + 1

    def result(self) -> dict[str, float]:
        out = dict(self.values)
        for key, total in out.items():
            if key.rsplit("/", 1)[1] in _MEAN:
                out[key] = total / self.counts[key]
        return out


class MemorySampler:
    """Sample device and host memory ``hz`` times a second on a daemon thread.

    Args:
        gpus: the CUDA devices of this process; empty on CPU.
        nvml: the session to read NVML through (started by the caller).
        hz: samples per second.
        step: returns the current training step; called from the sampler thread.
        listeners: called with every sample, from the sampler thread (timeline, exporter, early warning). A
            listener that raises is dropped, with one warning; sampling goes on.
        track_peak: read the allocator's peak and reset it after each sample, so ``peak_allocated_mb`` is the peak
            of the window; this also resets what ``torch.cuda.max_memory_allocated`` reports.
        warn: receives a message when a read or a listener fails (once per cause); default ``warnings.warn``.

    Raises:
        TypeError: an ``hz`` that is not a number, or a ``track_peak`` that is not a bool.
        ValueError: an ``hz`` that is not positive and finite.

    Example::

        sampler = MemorySampler([], NVMLSession(), hz=2.0, step=lambda: 0)
        sampler.start()
        ...
        window = sampler.take_window()  # {"host/rss_mb": 812.3, ...}
        sampler.stop()
    """

    def __init__(
        self,
        gpus: Sequence[MonitoredGPU],
        nvml: NVMLSession,
        hz: float,
        step: Callable[[], int],
        listeners: Sequence[Callable[[MemorySample], Any]] = (),
        track_peak: bool = True,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        owner = type(self).__name__
        check_positive(owner, "hz", hz, unit="samples per second")
        check_bool(owner, "track_peak", track_peak)
        self.gpus = list(gpus)
        self.keys = metric_keys(self.gpus)
        self.nvml = nvml
        self.interval = 1.0 / hz
        self.step = step
        self.listeners = list(listeners)
        self.track_peak = track_peak
        self.warn = warn or (lambda message: warnings.warn(message, RuntimeWarning, stacklevel=2))
        self.stage = "train"
        self.latest: MemorySample | None = None
        self.samples_taken = 0
        self.failures: list[str] = []
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()
        # the loop's thread samples too (stage boundaries, events): listeners such as the CSV writer see one at a time
        self._listener_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_time = time.monotonic()

    def start(self) -> None:
        """Take a first sample on the calling thread, then keep sampling on a daemon thread."""
        self._stop.clear()
        self._start_time = time.monotonic()
        self._sample_safely()
        self._thread = threading.Thread(target=self._loop, name="lightning_mgpu-memory-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and take a last sample, so the end of the run is in the timeline.

        A thread stuck in a driver call for longer than ``timeout`` seconds is left behind (it is a daemon) and the
        last sample is skipped: stopping never hangs.
        """
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        stuck = self._thread.is_alive()
        self._thread = None
        if not stuck:
            self._sample_safely()

    @property
    def started_at(self) -> float:
        """The ``time.monotonic()`` that samples' ``time_s`` counts from."""
        return self._start_time

    @property
    def running(self) -> bool:
        """Whether the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def set_stage(self, stage: str, fresh: bool = True) -> None:
        """Sample under ``stage`` from now on; each stage has its own window, so peaks are per stage.

        Args:
            stage: ``"train"``, ``"validate"``, ...
            fresh: discard what ``stage``'s window holds (a new validation run); ``False`` carries on with it (training
                resumes after validation with the samples from before it still in its window).
        """
        with self._lock:
            self.stage = stage
            if fresh:
                self._windows.pop(stage, None)

    def take_window(self) -> dict[str, float]:
        """The current stage's reductions since its last read, and a new window; the latest sample if it is empty."""
        with self._lock:
            window = self._windows.pop(self.stage, _Window())
            latest = self.latest
        result = window.result()
        if not result and latest is not None:
            result = {k: v for k, v in latest.values.items() if v is not None and not math.isnan(v)}
        return result

    def window_vector(self) -> torch.Tensor:
        """:meth:`take_window` as a float64 tensor in :attr:`keys` order, NaN where unknown."""
        window = self.take_window()
        return torch.tensor([window.get(key, math.nan) for key in self.keys], dtype=torch.float64)

    def sample(self, query_nvml: bool = True) -> MemorySample:
        """Read every metric once and hand the sample to the window and the listeners.

        Args:
            query_nvml: ``False`` takes the NVML figures (free memory, utilisation, temperature, power) from the
                latest sample instead of asking the driver: for the training thread, which must never wait on a
                wedged driver call (the sampling thread may; :meth:`stop` leaves it behind).
        """
        values: dict[str, float | None] = {}
        previous = None if query_nvml else self.latest
        for gpu in self.gpus:
            values.update(self._read_gpu(gpu, query_nvml, previous))
        rss = process_rss_mb()
        values.update({"host/rss_mb": rss, "host/peak_rss_mb": rss, "host/available_mb": host_available_mb()})
        with self._lock:
            try:
                step = int(self.step())
            except Exception:  # the trainer may be between stages; the step is for the timeline only
                step = self.latest.step if self.latest is not None else 0
            sample = MemorySample(time.monotonic() - self._start_time, step, self.stage, values)
            self._windows.setdefault(self.stage, _Window()).add(values)
            self.latest = sample
            self.samples_taken += 1
        with self._listener_lock:
            for listener in list(self.listeners):
                try:
                    listener(sample)
                except Exception as err:
                    # a full disk under the timeline must not stop the sampling the early warning depends on
                    self.listeners.remove(listener)
                    self._failed(f"{_name(listener)} failed and is switched off: {err!r}")
        return sample

    def sample_now(self, min_gap_s: float = 0.02) -> bool:
        """Sample on the calling thread, unless a sample was taken in the last ``min_gap_s`` seconds.

        For the points a short run would otherwise miss (stage boundaries, events, logging steps): a read of ``/proc``
        and of the allocator's counters on the host, no device synchronisation; the NVML figures are the thread's
        latest (no driver query on the calling thread).

        Returns:
            Whether a sample was taken.
        """
        latest = self.latest
        if latest is not None and time.monotonic() - self._start_time - latest.time_s < min_gap_s:
            return False
        self._sample_safely(query_nvml=False)
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample_safely()

    def _sample_safely(self, query_nvml: bool = True) -> None:
        try:
            self.sample(query_nvml)
        except Exception as err:
            self._failed(f"a memory reading failed: {err!r}")

    def _failed(self, message: str) -> None:
        if message not in self.failures:
            self.failures.append(message)
            self.warn(f"GPUMemoryMonitor: {message}")

    def _read_gpu(
        self, gpu: MonitoredGPU, query_nvml: bool = True, previous: MemorySample | None = None
    ) -> dict[str, float | None]:
        values: dict[str, float | None] = dict.fromkeys((f"{gpu.slot}/{m}" for m in GPU_METRICS), None)
        prefix = f"{gpu.slot}/"
        reading = None
        if query_nvml and gpu.nvml is not None and self.nvml.available:
            reading = self.nvml.read(gpu.nvml)
        elif previous is not None:
            for metric in _NVML_METRICS:
                values[prefix + metric] = previous.values.get(prefix + metric)
        if reading is not None:
            values[prefix + "free_mb"] = reading.memory_free_mb
            values[prefix + "utilization_pct"] = reading.utilization_pct
            values[prefix + "temperature_c"] = reading.temperature_c
            values[prefix + "power_w"] = reading.power_w
        # the allocator's numbers exist only once this process has initialised CUDA; reading them must not do it
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats = torch.cuda.memory_stats(gpu.torch_index)
            allocated = stats.get("allocated_bytes.all.current", 0) / MIB
            reserved = stats.get("reserved_bytes.all.current", 0) / MIB
            values[prefix + "allocated_mb"] = allocated
            values[prefix + "peak_allocated_mb"] = stats.get("allocated_bytes.all.peak", 0) / MIB
            values[prefix + "reserved_mb"] = reserved
            values[prefix + "alloc_retries"] = float(stats.get("num_alloc_retries", 0))
            values[prefix + "ooms"] = float(stats.get("num_ooms", 0))
            if self.track_peak:
                torch.cuda.reset_peak_memory_stats(gpu.torch_index)
            if values[prefix + "free_mb"] is None:
                values[prefix + "free_mb"] = torch.cuda.mem_get_info(gpu.torch_index)[0] / MIB
            free = values[prefix + "free_mb"]
            if free is not None:
                values[prefix + "headroom_mb"] = free + reserved - allocated
        return values
