"""A small host-side record of what happened during training, for the memory timeline to mark.

The pack's callbacks append to their own :class:`EventLog` when they already know of an event on the host (an
out-of-memory backoff, a skipped step); :class:`~lightning_mgpu.GPUMemoryMonitor` reads the logs at points it runs
anyway and writes the events beside its timeline (:class:`EventFile`), so that the plot can be drawn again from files.
Recording costs a Python append: no device read, no collective.
"""

import csv
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

EventKind = Literal["oom_backoff", "skipped_steps", "rollback", "validation", "stage", "headroom_warning", "straggler"]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
_COLUMNS = ("step", "time_s", "kind", "detail")


@dataclass(frozen=True)
class TrainingEvent:
    """One event at one training step.

    Args:
        step: the optimizer step (``trainer.global_step``) at which it happened.
        kind: one of :data:`EVENT_KINDS`.
        detail: a short description for the plot (``"micro-batch 64 -> 32"``).
        time: ``time.monotonic()`` when it was recorded (in a file: seconds since the timeline's first sample).
    """

    step: int
    kind: str
    detail: str = ""
    time: float = 0.0


class EventLog:
    """Events in the order they were recorded; holds the last ``capacity``, counts them all. Thread-safe.

    Args:
        capacity: events held; older ones are dropped (a reader that reads often, as the monitor does, misses none).

    Example::

        log = EventLog()
        log.record(12, "oom_backoff", "micro-batch 64 -> 32")
        cursor = 0
        new, cursor = log.since(cursor), log.recorded
    """

    def __init__(self, capacity: int = 1000) -> None:
        self._events: deque[TrainingEvent] = deque(maxlen=capacity)
        self._recorded = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # callbacks holding a log are pickled into spawned workers; a lock cannot travel
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def record(self, step: int, kind: EventKind, detail: str = "") -> TrainingEvent:
        """Append an event; returns it."""
        event = TrainingEvent(int(step), kind, detail, time.monotonic())
        with self._lock:
            self._events.append(event)
            self._recorded += 1
        return event

    @property
    def recorded(self) -> int:
        """Events recorded since this log was made, the dropped ones included."""
        return self._recorded

    def since(self, count: int) -> list[TrainingEvent]:
        """The events recorded after the first ``count``, as far as they are still held."""
        with self._lock:
            new = self._recorded - count
            return list(self._events)[-new:] if new > 0 else []


class RecordsEvents:
    """A callback that records training events (skips, backoffs, warnings) in its :class:`EventLog` ``events``.

    A declared role, read with ``isinstance``: GPUMemoryMonitor writes the events of every such callback of its fit
    beside its memory timeline.
    """

    events: EventLog


class EventFile:
    """Write events to a CSV file (``step, time_s, kind, detail``) as they come, flushed at each write.

    Args:
        path: the CSV file; its directory must exist.
        time_origin: the ``time.monotonic()`` that ``time_s`` counts from (the timeline's first sample).

    Example::

        events = EventFile("memory_fit_rank0.events.csv")
        events.write(log.since(0))
        events.close()
    """

    def __init__(self, path: str | Path, time_origin: float = 0.0) -> None:
        self.path = Path(path)
        self.time_origin = time_origin
        self._file = open(self.path, "w", newline="")  # noqa: SIM115 - open for the whole run, closed in close()
        self._writer = csv.writer(self._file)
        self._writer.writerow(_COLUMNS)
        self._file.flush()

    def write(self, events: list[TrainingEvent]) -> None:
        """Append ``events`` and flush, so a run that crashes keeps them."""
        if not events or self._file.closed:
            return
        self._writer.writerows(
            (event.step, f"{event.time - self.time_origin:.3f}", event.kind, event.detail) for event in events
        )
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if not self._file.closed:
            self._file.close()


def read_events(path: str | Path) -> list[TrainingEvent]:
    """The events of a file :class:`EventFile` wrote; an empty list when it does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, newline="") as file:
        return [
            TrainingEvent(int(row["step"]), row["kind"], row["detail"], float(row["time_s"]))
            for row in csv.DictReader(file)
        ]


def events_path(timeline_path: str | Path) -> Path:
    """Where the events of a timeline go: ``memory_fit_rank0.csv`` -> ``memory_fit_rank0.events.csv``."""
    timeline_path = Path(timeline_path)
    return timeline_path.with_name(f"{timeline_path.stem}.events.csv")
