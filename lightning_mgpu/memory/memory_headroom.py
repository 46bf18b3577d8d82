"""Warn before an out-of-memory error: when headroom falls under a threshold, or the allocator starts retrying."""

import threading
from collections.abc import Callable

from lightning_mgpu.core.validation import check_int, check_number
from lightning_mgpu.memory.memory_sampler import MemorySample


class HeadroomWatch:
    """Watch every sample for memory about to run out and warn once per device and cause, with the numbers.

    A GPU's headroom is its free memory (NVML) plus what the caching allocator reserved and does not use: what
    this process can still allocate without an error. ``alloc_retries`` counts the times the allocator freed its
    cache and retried a failed allocation; when it grows, allocations are already failing at the first attempt.
    With no GPU, the host's available memory (``host/available_mb``, cgroup-aware) is watched instead.

    Args:
        threshold_mb: warn when headroom falls under this many MiB; ``None`` watches allocator retries only.
        warn: called with the message, once per device and cause.
        rank: the process's global rank, named in the message.

    Raises:
        TypeError: a ``threshold_mb`` that is not a number or None, or a ``rank`` that is not an int.
        ValueError: a negative or non-finite ``threshold_mb``, or a negative ``rank``.

    Example::

        watch = HeadroomWatch(threshold_mb=2048, warn=warnings.warn)
        sampler = MemorySampler(gpus, nvml, hz=2.0, step=step, listeners=[watch])
    """

    def __init__(self, threshold_mb: float | None, warn: Callable[[str], None], rank: int = 0) -> None:
        owner = type(self).__name__
        check_number(owner, "threshold_mb", threshold_mb, minimum=0, allow_none=True, unit="MiB")
        check_int(owner, "rank", rank, minimum=0)
        self.threshold_mb = threshold_mb
        self.warn = warn
        self.rank = rank
        self.warned: list[str] = []
        self._retries_seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, sample: MemorySample) -> None:
        """Check one sample (called from the sampler thread)."""
        slots = sorted({key.split("/", 1)[0] for key in sample.values if key.startswith("gpu")})
        for slot in slots:
            self._check_gpu(slot, sample)
        if not slots:
            self._check_host(sample)

    def _check_gpu(self, slot: str, sample: MemorySample) -> None:
        value = sample.values.get
        headroom = value(f"{slot}/headroom_mb")
        numbers = (
            f"free {_mb(value(f'{slot}/free_mb'))}, allocated {_mb(value(f'{slot}/allocated_mb'))}, "
            f"reserved {_mb(value(f'{slot}/reserved_mb'))}"
        )
        where = f"rank {self.rank}, {slot}, step {sample.step} ({sample.stage})"
        if self.threshold_mb is not None and headroom is not None and headroom < self.threshold_mb:
            self._once(
                f"{slot}:headroom",
                f"GPUMemoryMonitor: memory headroom {_mb(headroom)} is under warn_headroom_mb={self.threshold_mb:g} "
                f"on {where}: {numbers}. An out-of-memory error is near: lower the batch size.",
            )
        retries = value(f"{slot}/alloc_retries")
        if retries is None:
            return
        first = self._retries_seen.setdefault(slot, retries)
        if retries > first:
            self._once(
                f"{slot}:retries",
                f"GPUMemoryMonitor: the CUDA caching allocator had to free its cache and retry {retries - first:g} "
                f"allocation(s) on {where} ({numbers}): memory is fragmented or nearly full, and each retry "
                f"synchronises the device. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or lower the "
                f"batch size.",
            )

    def _check_host(self, sample: MemorySample) -> None:
        available = sample.values.get("host/available_mb")
        if self.threshold_mb is None or available is None or available >= self.threshold_mb:
            return
        self._once(
            "host:headroom",
            f"GPUMemoryMonitor: host memory available {_mb(available)} is under warn_headroom_mb="
            f"{self.threshold_mb:g} on rank {self.rank}, step {sample.step} ({sample.stage}); this process uses "
            f"{_mb(sample.values.get('host/rss_mb'))}. The kernel's OOM killer is near.",
        )

    def _once(self, cause: str, message: str) -> None:
        with self._lock:
            if cause in self.warned:
                return
            self.warned.append(cause)
        self.warn(message)


def _mb(value: float | None) -> str:
    return "unknown" if value is None else f"{value:,.0f} MiB"
