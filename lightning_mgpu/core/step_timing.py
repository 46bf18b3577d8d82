"""Where an optimizer step's time goes, per process, without synchronising the host with the device.

The training thread marks points of each step (batch start, optimizer start, batch end) and a wrapped DDP
communication hook marks when each gradient bucket was handed over and when its reduction finished. On the host
(CPU training) a mark is ``time.perf_counter()``; on a GPU it is a CUDA event recorded on the current stream, read
only once it has completed (``Event.query()``), so figures of device work arrive up to one logging window late
rather than stalling the loop. Times between batches (waiting for data) and whole-step times are host times in
both cases: the loop's own pace.
"""

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# the figures of one logging window, in this order in the gathered vector (units in the names)
STEP_METRICS: tuple[str, ...] = (
    "step_ms",
    "data_wait_ms",
    "fwd_bwd_ms",
    "optimizer_ms",
    "comm_ms",
    "comm_exposed_ms",
    "comm_overlap_pct",
    "busy_ms",
    "samples_per_sec",
    "tokens_per_sec",
    "tflops",
    "mfu_pct",
)


# steps kept before the timer sums what it can without waiting for a window to be taken
PENDING_CAP = 256


class HostClock:
    """Marks are ``time.perf_counter()`` readings; every mark is ready at once."""

    def mark(self) -> float:
        """Now, on the host's counter."""
        return time.perf_counter()

    def ready(self, mark: Any) -> bool:
        """Always: a host reading is taken when made."""
        return True

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``."""
        return (end - start) * 1e3


class CudaClock:
    """Marks are CUDA events recorded on the current stream, read once complete: no host synchronisation."""

    def mark(self) -> "torch.cuda.Event":
        """An event recorded on the current stream of the current device."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: Any) -> bool:
        """Whether the device has reached the event (a query, no wait)."""
        return bool(mark.query())

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed events."""
        return float(start.elapsed_time(end))


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    """The clock for work on ``device``: CUDA events on a GPU, the host's counter elsewhere."""
    return CudaClock() if device.type == "cuda" else HostClock()


def union_ms(spans: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` spans."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def exposed_ms(spans: Sequence[tuple[float, float]], compute_end: float) -> float:
    """Length of the union of ``spans`` after ``compute_end``: communication that nothing overlapped."""
    return union_ms([(max(start, compute_end), end) for start, end in spans if end > compute_end])


class CommTimer:
    """Times the gradient reductions of a DDP communication hook it wraps.

    Each bucket's span runs from the hook's call (the bucket's gradients are ready) to the completion of the future
    the hook returns. Spans are recorded from autograd's and the backend's threads and taken by the training thread.

    Args:
        clock: how marks are taken (host counter, or CUDA events on the stream current in each callback).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.spans: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def wrap(self, hook: Callable[[Any, Any], torch.futures.Future]) -> Callable[[Any, Any], torch.futures.Future]:
        """A hook doing what ``hook`` does, timed; register it with ``DistributedDataParallel.register_comm_hook``."""

        # DDP checks these annotations when the hook is registered
        def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            start = self.clock.mark()
            future = hook(state, bucket)

            def finished(done: torch.futures.Future) -> Any:
                end = self.clock.mark()
                with self._lock:
                    self.spans.append((start, end))
                return done.value()

            return future.then(finished)

        timed_hook.__name__ = timed_hook.__qualname__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed_hook

    def take(self) -> list[tuple[Any, Any]]:
        """The spans recorded since the last call."""
        with self._lock:
            spans, self.spans = self.spans, []
        return spans


@dataclass(slots=True)
class _Step:
    """One optimizer step's marks, some of them device events to be read later."""

    wall_ms: float | None
    data_wait_ms: float
    samples: int | None
    tokens: int | None
    compute: list[tuple[Any, Any]]  # (batch start, end of forward+backward) per micro-batch
    optimizer: tuple[Any, Any] | None
    comm: list[tuple[Any, Any]]


@dataclass(slots=True)
class WindowTotals:
    """Sums over the steps of one logging window, host figures and device figures counted apart."""

    steps: int = 0
    wall_ms: float = 0.0
    data_wait_ms: float = 0.0
    samples: int | None = 0
    tokens: int | None = 0
    device_steps: int = 0
    fwd_bwd_ms: float = 0.0
    optimizer_steps: int = 0
    optimizer_ms: float = 0.0
    comm_steps: int = 0
    comm_ms: float = 0.0
    comm_exposed_ms: float = 0.0


@dataclass(slots=True)
class StepTimer:
    """Collects the marks of each optimizer step and sums them per logging window.

    Call :meth:`batch_start`, :meth:`optimizer_start` (where an optimizer steps) and :meth:`batch_end` from the
    training loop, and :meth:`pause`/:meth:`resume` around time that belongs to no step (validation). A step is its
    micro-batches up to the batch end that stepped; its wall time runs from the previous step's end. Steps whose
    device marks are not complete yet are kept and counted in a later window.

    Args:
        clock: the device clock (host counter or CUDA events).
        comm: the timer of the DDP communication hook, if one is wrapped.
        skip_steps: steps to leave out at the start (warm-up, the step whose FLOPs are counted).
    """

    clock: Clock
    comm: CommTimer | None = None
    skip_steps: int = 1
    totals: WindowTotals = field(default_factory=WindowTotals)
    _pending: deque = field(default_factory=deque)
    _last_step_end: float | None = None
    _last_batch_end: float | None = None
    _paused_at: float | None = None
    _data_wait_ms: float = 0.0
    _samples: int | None = 0
    _tokens: int | None = 0
    _compute: list = field(default_factory=list)
    _batch_start: Any = None
    _optimizer_start: Any = None
    _optimizer: tuple[Any, Any] | None = None
    _steps_seen: int = 0
    _host_added: int = 0  # the pending steps (oldest first) whose host figures are in the window
    _host: bool = False  # the device clock is the host's: the loop's own readings serve as its marks

    def __post_init__(self) -> None:
        self._host = isinstance(self.clock, HostClock)

    @property
    def current_samples(self) -> int | None:
        """Samples of the step under way so far (its micro-batches up to now)."""
        return self._samples

    def start(self, now: float) -> None:
        """The loop starts: the first step's wall time and data wait run from ``now``."""
        self._last_batch_end = self._last_step_end = now
        self._paused_at = None

    def batch_start(self, now: float, samples: int | None, tokens: int | None) -> None:
        """A batch has arrived (``now``, host time): the wait since the last batch ended was for data.

        ``samples`` and ``tokens`` are ``None`` when unknown; a step with an unknown count leaves the window's out.
        """
        if self._last_batch_end is not None:
            self._data_wait_ms += (now - self._last_batch_end) * 1e3
        self._samples = None if samples is None or self._samples is None else self._samples + samples
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        self._batch_start = now if self._host else self.clock.mark()
        self._optimizer_start = None

    def optimizer_start(self) -> None:
        """Forward and backward are done; the optimizer steps."""
        if self._batch_start is not None and self._optimizer_start is None:
            self._optimizer_start = time.perf_counter() if self._host else self.clock.mark()

    def batch_end(self, now: float, stepped: bool) -> None:
        """The batch is done; ``stepped`` says whether it ended an optimizer step (else it accumulated)."""
        end = now if self._host else self.clock.mark()
        if self._batch_start is not None:
            compute_end = self._optimizer_start if self._optimizer_start is not None else end
            self._compute.append((self._batch_start, compute_end))
            if self._optimizer_start is not None:
                self._optimizer = (self._optimizer_start, end)
        self._batch_start = self._optimizer_start = None
        self._last_batch_end = now
        if not stepped:
            return
        self._steps_seen += 1
        wall = None if self._last_step_end is None else (now - self._last_step_end) * 1e3
        comm = self.comm.take() if self.comm is not None else []
        step = _Step(wall, self._data_wait_ms, self._samples, self._tokens, self._compute, self._optimizer, comm)
        self._last_step_end = now
        self._data_wait_ms, self._samples, self._tokens, self._compute, self._optimizer = 0.0, 0, 0, [], None
        if self._steps_seen > self.skip_steps and wall is not None:
            self._pending.append(step)  # summed when the window is taken: the loop's thread does the least here
            if len(self._pending) > PENDING_CAP:  # no window taken for long (log_every_n_steps=0 or large)
                self.resolve()

    def pause(self, now: float) -> None:
        """Time from the last batch's end to :meth:`resume` belongs to no step (validation inside the fit).

        Counted from the batch's end, not from ``now``: Lightning builds the validation loader, and starts its
        workers, before the validation hooks run.
        """
        if self._paused_at is None:
            self._paused_at = now if self._last_batch_end is None else min(now, self._last_batch_end)

    def resume(self, now: float) -> None:
        """End a :meth:`pause`: its length moves the step's and the data wait's starting points."""
        if self._paused_at is None:
            return
        gap = now - self._paused_at
        self._paused_at = None
        if self._last_step_end is not None:
            self._last_step_end += gap
        if self._last_batch_end is not None:
            self._last_batch_end += gap
        if self.comm is not None:
            self.comm.take()  # no reduction runs in validation; nothing of a step is lost

    def resolve(self) -> None:
        """Add new steps' host figures to the window, and the device figures of those whose marks have completed."""
        pending = self._pending
        for step in itertools.islice(pending, self._host_added, None):
            self._add_host(step)
        self._host_added = len(pending)
        while pending and self._ready(pending[0]):
            self._add_device(pending.popleft())
            self._host_added -= 1

    def take_window(self) -> WindowTotals:
        """The window's sums so far; a new window starts."""
        self.resolve()
        totals, self.totals = self.totals, WindowTotals()
        return totals

    def _ready(self, step: _Step) -> bool:
        marks = [mark for span in (*step.compute, *step.comm) for mark in span]
        if step.optimizer is not None:
            marks += step.optimizer
        return all(self.clock.ready(mark) for mark in marks)

    def _add_host(self, step: _Step) -> None:
        totals = self.totals
        totals.steps += 1
        totals.wall_ms += step.wall_ms or 0.0
        totals.data_wait_ms += step.data_wait_ms
        totals.samples = None if step.samples is None or totals.samples is None else totals.samples + step.samples
        totals.tokens = None if step.tokens is None or totals.tokens is None else totals.tokens + step.tokens

    def _add_device(self, step: _Step) -> None:
        totals, ms = self.totals, self.clock.ms
        if not step.compute:
            return
        totals.device_steps += 1
        totals.fwd_bwd_ms += sum(ms(start, end) for start, end in step.compute)
        if step.optimizer is not None:
            totals.optimizer_steps += 1
            totals.optimizer_ms += ms(*step.optimizer)
        if self.comm is None:
            return
        # on one time axis: milliseconds from the synchronised micro-batch's start (the last one)
        origin = step.compute[-1][0]
        spans = [(ms(origin, start), ms(origin, end)) for start, end in step.comm]
        if spans:  # a step reduced elsewhere (OOMBackoff's own averaging) says nothing about the reduction
            totals.comm_steps += 1
            totals.comm_ms += union_ms(spans)
            # backward's compute ends about when its last bucket is handed over
            totals.comm_exposed_ms += exposed_ms(spans, max(start for start, _ in spans))


def window_figures(
    totals: WindowTotals,
    *,
    comm_timed: bool,
    multi_process: bool,
    flops_per_sample: float | None,
    peak_flops: float | None,
) -> dict[str, float]:
    """The window's per-step means and rates (:data:`STEP_METRICS`); a figure that is unknown is NaN.

    Args:
        totals: the window's sums.
        comm_timed: whether the gradient reductions were timed.
        multi_process: whether other processes take part (without comm timing, busy time is then unknown).
        flops_per_sample: model FLOPs of forward+backward per sample, if counted.
        peak_flops: the device's peak FLOP/s, if known.
    """
    nan = math.nan
    figures = dict.fromkeys(STEP_METRICS, nan)
    if totals.steps:
        figures["step_ms"] = totals.wall_ms / totals.steps
        figures["data_wait_ms"] = totals.data_wait_ms / totals.steps
        seconds = totals.wall_ms / 1e3
        if seconds > 0 and totals.tokens:
            figures["tokens_per_sec"] = totals.tokens / seconds
        if seconds > 0 and totals.samples:
            figures["samples_per_sec"] = totals.samples / seconds
            if flops_per_sample is not None:
                achieved = flops_per_sample * figures["samples_per_sec"]
                figures["tflops"] = achieved / 1e12
                if peak_flops:
                    figures["mfu_pct"] = 100.0 * achieved / peak_flops
    if totals.device_steps:
        figures["fwd_bwd_ms"] = totals.fwd_bwd_ms / totals.device_steps
    if totals.optimizer_steps:
        figures["optimizer_ms"] = totals.optimizer_ms / totals.optimizer_steps
    if comm_timed and totals.comm_steps:
        figures["comm_ms"] = totals.comm_ms / totals.comm_steps
        figures["comm_exposed_ms"] = totals.comm_exposed_ms / totals.comm_steps
        if totals.comm_ms > 0:
            figures["comm_overlap_pct"] = 100.0 * (totals.comm_ms - totals.comm_exposed_ms) / totals.comm_ms
    if not math.isnan(figures["step_ms"]):
        if not math.isnan(figures["comm_exposed_ms"]):
            figures["busy_ms"] = max(figures["step_ms"] - figures["comm_exposed_ms"], 0.0)
        elif not multi_process:
            figures["busy_ms"] = figures["step_ms"]
    return figures
