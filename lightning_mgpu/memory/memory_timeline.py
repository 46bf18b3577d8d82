"""A per-rank CSV timeline of memory samples, written as they come, and a plot of it with the run's events."""

import csv
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mgpu.core.training_events import TrainingEvent, events_path, read_events
from lightning_mgpu.core.validation import check_int
from lightning_mgpu.memory.memory_sampler import MemorySample

_FIXED_COLUMNS = ("time_s", "step", "stage")


class MemoryTimeline:
    """Append every sample to a CSV file: ``time_s, step, stage`` and one column per metric (``gpu0_allocated_mb``).

    Rows are flushed every ``flush_every`` samples, so a crashed run keeps its timeline up to the crash and memory
    use does not grow with the length of the run.

    Args:
        path: the CSV file; its directory is created.
        keys: the sampler's metric keys, in column order.
        flush_every: samples between flushes.

    Raises:
        TypeError: a ``flush_every`` that is not an int.
        ValueError: a ``flush_every`` below 1.

    Example::

        timeline = MemoryTimeline("logs/memory_rank0.csv", sampler.keys)
        sampler = MemorySampler(gpus, nvml, hz=2.0, step=step, listeners=[timeline])
    """

    def __init__(self, path: str | Path, keys: Sequence[str], flush_every: int = 16) -> None:
        check_int(type(self).__name__, "flush_every", flush_every, minimum=1)
        self.path = Path(path)
        self.keys = list(keys)
        self.flush_every = flush_every
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", newline="")  # noqa: SIM115 - open for the whole run, closed in close()
        self._writer = csv.writer(self._file)
        self._writer.writerow([*_FIXED_COLUMNS, *(key.replace("/", "_") for key in self.keys)])
        self._pending = 0

    def __call__(self, sample: MemorySample) -> None:
        """Write one sample (called from the sampler thread)."""
        if self._file.closed:
            return
        cells = (sample.values.get(key) for key in self.keys)
        self._writer.writerow(
            [f"{sample.time_s:.3f}", sample.step, sample.stage, *("" if v is None else f"{v:.6g}" for v in cells)]
        )
        self._pending += 1
        if self._pending >= self.flush_every:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        """Flush and close the file."""
        if not self._file.closed:
            self._file.close()


def unused_path(path: str | Path) -> Path:
    """``path``, or ``<stem>-v1<suffix>``, ``-v2``... if taken: a second fit or a resumed run keeps the first's."""
    path = Path(path)
    version = 0
    candidate = path
    while candidate.exists():
        version += 1
        candidate = path.with_name(f"{path.stem}-v{version}{path.suffix}")
    return candidate


@dataclass
class PlotLine:
    """One line of a timeline plot.

    Args:
        label: the legend's text.
        role: ``"used"`` (memory this process holds: allocated by tensors, or resident on the host),
            ``"reserved"`` (held by torch's caching allocator), ``"limit"`` (what the process could hold: used +
            headroom) or ``"threshold"`` (the limit less ``warn_headroom_mb``, where the early warning fires).
        x: training steps, or seconds for a stage that does not step (see :attr:`TimelinePlot.x_label`).
        values: MiB.
    """

    label: str
    role: str
    x: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class TimelinePlot:
    """Everything a timeline plot shows, computed from the files without matplotlib (see :func:`timeline_plot`).

    Args:
        title: names the rank, the stage and the memory shown.
        subtitle: the samples and steps covered, and the scale.
        x_label: the x axis's label, with its unit: training steps, or seconds when the step never moved
            (``validate``, ``test``, ``predict``).
        y_label: the y axis's label, with its unit.
        lines: used memory, the limit and the warning threshold.
        peaks: ``(line label, stage, x, MiB)``: the highest point of each ``"used"`` line.
        events: the events to mark, thinned to a readable number per kind.
        event_x: where each of ``events`` is drawn on the x axis.
        event_counts: events of each kind before thinning.
        y_limits: the main axis's range; it starts at 0.
        zoom_limits: a second panel's range on the used memory, when it is too small to read on the main axis
            (that panel says that it does not start at 0); ``None`` without one.
        samples: rows in the timeline.
    """

    title: str
    subtitle: str
    x_label: str
    y_label: str
    lines: list[PlotLine]
    peaks: list[tuple[str, str, float, float]]
    events: list[TrainingEvent]
    event_x: list[float]
    event_counts: dict[str, int]
    y_limits: tuple[float, float]
    zoom_limits: tuple[float, float] | None
    samples: int


# kind: (legend label, colour, line style, text written beside the line before the event's detail; None: no text)
EVENT_STYLES: dict[str, tuple[str, str, str, str | None]] = {
    "oom_backoff": ("out-of-memory backoff", "tab:red", "-", "OOM backoff: "),
    "skipped_steps": ("skipped step (NaN/Inf)", "tab:orange", "-", "skipped: "),
    "headroom_warning": ("headroom warning", "tab:purple", "-", "warning: "),
    "straggler": ("straggler warning", "tab:brown", "--", "straggler: "),
    "validation": ("validation run", "0.55", ":", None),
    "stage": ("stage boundary", "0.25", "-.", ""),
}
_ZOOM_BELOW = 0.25  # a zoom panel when the used memory stays under this fraction of the main axis
_EVENTS_PER_KIND = 60


def timeline_plot(
    csv_path: str | Path,
    events: Sequence[TrainingEvent] = (),
    warn_headroom_mb: float | None = None,
    title: str | None = None,
    max_points: int = 4000,
) -> TimelinePlot:
    """What :func:`plot_timeline` draws, read from a timeline CSV: lines, events, axis ranges.

    GPUs show allocated and reserved memory, a run without GPU numbers the process's resident host memory. The
    limit is what the process could hold: allocated memory plus the GPU's headroom (free + reserved - allocated), or
    RSS plus the memory the host has available; the threshold is ``warn_headroom_mb`` below it, where
    :class:`~lightning_mgpu.GPUMemoryMonitor` warns. The file is read one row at a time and lines are thinned to
    about ``max_points`` points, so a days-long timeline fits in bounded memory; the peaks are found over every row.

    Args:
        csv_path: a file written by :class:`MemoryTimeline`.
        events: events to mark (:func:`~lightning_mgpu.core.training_events.read_events` reads the sidecar).
        warn_headroom_mb: the monitor's threshold; ``None`` draws none.
        title: the title; by default from the file name (``memory_fit_rank0.csv``: rank 0 during fit).
        max_points: points per line at most.

    Returns:
        The plot's content.
    """
    with open(csv_path, newline="") as file:
        columns = next(csv.reader(file), [])
    slots = sorted({c.split("_", 1)[0] for c in columns if c.startswith("gpu")})
    series = [line for slot in slots for line in _gpu_plan(slot, warn_headroom_mb)]
    read = _read_series(csv_path, series, max_points)
    memory = ", ".join(slots) + " (memory allocated by tensors)"
    if not any(read.lines[label] for label, role, _ in series if role == "used"):
        series = _host_plan(warn_headroom_mb)
        read = _read_series(csv_path, series, max_points)
        memory = "host memory (no GPU in this timeline)"
    by_time = read.steps[0] == read.steps[1]  # an evaluation stage: the step never moves, time does
    at = 1 if by_time else 0

    plot_lines = [
        PlotLine(label, role, [p[at] for p in read.lines[label]], [p[2] for p in read.lines[label]])
        for label, role, _ in series
        if read.lines[label]
    ]
    used = [v for line in plot_lines if line.role in ("used", "reserved") for v in line.values]
    highest = max((v for line in plot_lines for v in line.values), default=0.0)
    top = highest * 1.08 if highest > 0 else 1.0
    zoom = None
    if used and max(used) < _ZOOM_BELOW * top:
        pad = max(0.15 * (max(used) - min(used)), 1.0)
        zoom = (max(0.0, min(used) - pad), max(used) + pad)
    peaks = []
    for label, role, _ in series:
        stages = read.peaks[label]
        if role == "used" and stages:
            stage, point = max(stages.items(), key=lambda item: item[1][2])
            peaks.append((label, stage, point[at], point[2]))
    counts: dict[str, int] = {}
    for event in events:
        counts[event.kind] = counts.get(event.kind, 0) + 1
    shown = _thin_events(events, _EVENTS_PER_KIND)
    first, last = read.steps
    span = (
        f"{read.rows} samples over {read.times[1]:.0f} s at step {first}"
        if by_time
        else (f"{read.rows} samples over steps {first}-{last}")
    )
    return TimelinePlot(
        title=f"{title or _title_from_name(Path(csv_path).stem)}: {memory}",
        subtitle=f"{span}; the upper panel's axis starts at 0 MiB",
        x_label="seconds since the stage started" if by_time else "training step (optimizer steps)",
        y_label="memory (MiB)",
        lines=plot_lines,
        peaks=peaks,
        events=shown,
        event_x=[event.time if by_time else event.step for event in shown],
        event_counts=counts,
        y_limits=(0.0, top),
        zoom_limits=zoom,
        samples=read.rows,
    )


def plot_timeline(
    csv_path: str | Path,
    png_path: str | Path,
    max_points: int = 4000,
    events: Sequence[TrainingEvent] | None = None,
    warn_headroom_mb: float | None = None,
    title: str | None = None,
) -> Path:
    """Plot memory over steps from a timeline CSV: used memory against the limit and the warning threshold, events.

    The upper panel's axis starts at 0, so a flat line looks flat and the distance to the limit is honest; when the
    used memory is too small to read there, a lower panel zooms on it and says so. Events (out-of-memory backoffs,
    skipped steps, headroom warnings, validation runs, stage boundaries) are vertical lines on both panels. Drawn on
    a figure of its own (no pyplot), so the process's matplotlib backend, a notebook's inline plots for one, stays
    as it was. Needs matplotlib (``pip install lightning-mgpu[plot]``).

    Args:
        csv_path: a file written by :class:`MemoryTimeline`.
        png_path: where to write the PNG.
        max_points: points per line at most.
        events: events to mark; ``None`` reads the sidecar beside ``csv_path`` (``<stem>.events.csv``) if any.
        warn_headroom_mb: the monitor's threshold; ``None`` draws none.
        title: the title; by default from the file name.

    Returns:
        ``png_path``.
    """
    if events is None:
        events = read_events(events_path(csv_path))
    plot = timeline_plot(csv_path, events, warn_headroom_mb, title, max_points)
    return draw_timeline(plot, png_path)


def draw_timeline(plot: TimelinePlot, png_path: str | Path) -> Path:
    """Render a :class:`TimelinePlot` to a PNG file; returns ``png_path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 7.5 if plot.zoom_limits else 5.2), layout="constrained")
    FigureCanvasAgg(figure)
    if plot.zoom_limits is not None:
        main, zoom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    else:
        main, zoom = figure.subplots(1, 1), None
    panels = [axes for axes in (main, zoom) if axes is not None]
    xs = [x for line in plot.lines for x in line.x] + plot.event_x
    low, high = (min(xs), max(xs)) if xs else (0.0, 1.0)
    right_half = low + 0.6 * (high - low)  # text right of it is drawn leftwards, to stay inside the axes
    handles = _draw_lines(plot, main, panels)
    _draw_peaks(plot, zoom if zoom is not None else main, right_half)
    handles += _draw_events(plot, main, panels, right_half)
    _label_axes(plot, main, zoom, panels, (low, high))
    figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    png_path = Path(png_path)
    figure.savefig(png_path, dpi=110)
    return png_path


def _draw_lines(plot: TimelinePlot, main: Any, panels: list[Any]) -> list[Any]:
    """The memory lines (the zoom panel shows used and reserved only); returns their legend handles."""
    from matplotlib.lines import Line2D

    styles = {"limit": ("black", "-", 1.4), "threshold": ("tab:red", "--", 1.2)}
    colors = iter(["tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:brown", "tab:pink"])
    handles = []
    for line in plot.lines:
        color, style, width = styles.get(line.role) or (next(colors, "tab:gray"), "-", 1.8)
        for axes in panels:
            if axes is main or line.role in ("used", "reserved"):
                axes.plot(line.x, line.values, color=color, linestyle=style, linewidth=width)
        handles.append(Line2D([], [], color=color, linestyle=style, linewidth=width, label=line.label))
    return handles


def _draw_peaks(plot: TimelinePlot, axes: Any, right_half: float) -> None:
    for _, stage, x, value in plot.peaks:
        axes.plot([x], [value], marker="v", color="black", markersize=6, linestyle="none")
        left = x > right_half
        axes.annotate(
            f"peak {value:,.0f} MiB ({stage})",
            (x, value),
            textcoords="offset points",
            xytext=(-4 if left else 4, 6),
            ha="right" if left else "left",
            fontsize=8,
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )


def _draw_events(plot: TimelinePlot, main: Any, panels: list[Any], right_half: float) -> list[Any]:
    """A vertical line per event, labelled on the main panel; returns the legend handles of the kinds drawn."""
    from matplotlib.lines import Line2D

    handles = []
    for kind, (label, color, style, _) in EVENT_STYLES.items():
        if plot.event_counts.get(kind):
            shown = sum(1 for event in plot.events if event.kind == kind)
            more = f" ({shown} of {plot.event_counts[kind]} drawn)" if shown < plot.event_counts[kind] else ""
            handles.append(Line2D([], [], color=color, linestyle=style, label=f"{label}{more}"))
    for event, x in zip(plot.events, plot.event_x, strict=True):
        _, color, style, prefix = EVENT_STYLES.get(event.kind, (event.kind, "tab:gray", "-", ""))
        for axes in panels:
            axes.axvline(x, color=color, linestyle=style, linewidth=1.1, alpha=0.85)
        if prefix is not None and (prefix or event.detail):
            left = x > right_half
            main.text(
                x,
                0.97,
                f"{prefix}{event.detail}",
                transform=main.get_xaxis_transform(),
                rotation=90,
                va="top",
                ha="right" if left else "left",
                fontsize=7.5,
                color=color,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
            )
    return handles


def _label_axes(plot: TimelinePlot, main: Any, zoom: Any, panels: list[Any], x_range: tuple[float, float]) -> None:
    from matplotlib.ticker import StrMethodFormatter

    main.set_ylim(*plot.y_limits)
    main.set_title(f"{plot.title}\n{plot.subtitle}", fontsize=10)
    if zoom is not None and plot.zoom_limits is not None:
        zoom.set_ylim(*plot.zoom_limits)
        bottom, top = plot.zoom_limits
        zoom.set_title(
            f"zoom on the memory used: this axis spans {bottom:,.0f}-{top:,.0f} MiB, it does not start at 0",
            fontsize=9,
        )
    main.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    if zoom is not None:
        zoom.ticklabel_format(axis="y", useOffset=False, style="plain")  # the real values, not offsets from them
    for axes in panels:
        axes.set_ylabel(plot.y_label)
        axes.grid(alpha=0.3)
    low, high = x_range
    panels[-1].set_xlabel(plot.x_label)
    panels[-1].set_xlim(low, high + 0.01 * (high - low or 1))


def _gpu_plan(slot: str, warn_headroom_mb: float | None) -> list[tuple[str, str, Callable[[dict], float | None]]]:
    allocated, reserved, headroom = f"{slot}_allocated_mb", f"{slot}_reserved_mb", f"{slot}_headroom_mb"
    plan = [
        (f"{slot} allocated", "used", _column(allocated)),
        (f"{slot} reserved", "reserved", _column(reserved)),
        (f"{slot} limit: allocated + headroom", "limit", _sum(allocated, headroom)),
    ]
    if warn_headroom_mb is not None:
        plan.append(
            (
                f"{slot} warning threshold: limit - {warn_headroom_mb:,g} MiB (warn_headroom_mb)",
                "threshold",
                _sum(allocated, headroom, -warn_headroom_mb),
            )
        )
    return plan


def _host_plan(warn_headroom_mb: float | None) -> list[tuple[str, str, Callable[[dict], float | None]]]:
    plan = [
        ("process RSS (resident host memory)", "used", _column("host_rss_mb")),
        ("limit: RSS + host available", "limit", _sum("host_rss_mb", "host_available_mb")),
    ]
    if warn_headroom_mb is not None:
        plan.append(
            (
                f"warning threshold: limit - {warn_headroom_mb:,g} MiB (warn_headroom_mb)",
                "threshold",
                _sum("host_rss_mb", "host_available_mb", -warn_headroom_mb),
            )
        )
    return plan


def _column(name: str) -> Callable[[dict], float | None]:
    return lambda row: _number(row.get(name))


def _sum(first: str, second: str, offset: float = 0.0) -> Callable[[dict], float | None]:
    def total(row: dict) -> float | None:
        a, b = _number(row.get(first)), _number(row.get(second))
        return None if a is None or b is None else a + b + offset

    return total


def _title_from_name(stem: str) -> str:
    match = re.match(r"memory_(\w+?)_rank(\d+)", stem)
    return f"Memory of rank {match.group(2)} during {match.group(1)}" if match else f"Memory: {stem}"


def _thin_events(events: Sequence[TrainingEvent], per_kind: int) -> list[TrainingEvent]:
    """At most ``per_kind`` events of each kind, evenly spread: a storm of skips must not paint the plot over."""
    kept: list[TrainingEvent] = []
    for kind in dict.fromkeys(event.kind for event in events):
        same = [event for event in events if event.kind == kind]
        stride = math.ceil(len(same) / per_kind)
        kept += same[::stride]
    return sorted(kept, key=lambda event: event.step)


@dataclass
class _Series:
    lines: dict[str, list[tuple[int, float, float]]]  # label: (step, time_s, MiB) points
    peaks: dict[str, dict[str, tuple[int, float, float]]]  # label: stage: the highest point
    rows: int
    steps: tuple[int, int]
    times: tuple[float, float]


def _read_series(
    csv_path: str | Path, series: list[tuple[str, str, Callable[[dict], float | None]]], max_points: int
) -> _Series:
    lines: dict[str, list[tuple[int, float, float]]] = {label: [] for label, _, _ in series}
    peaks: dict[str, dict[str, tuple[int, float, float]]] = {label: {} for label, _, _ in series}
    stride, rows = 1, 0
    steps, times = (0, 0), (0.0, 0.0)
    with open(csv_path, newline="") as file:
        for row in csv.DictReader(file):
            rows += 1
            step, time_s = int(row["step"]), float(row["time_s"])
            if rows == 1:
                steps, times = (step, step), (time_s, time_s)
            steps = (min(steps[0], step), max(steps[1], step))
            times = (min(times[0], time_s), max(times[1], time_s))
            for label, _, read in series:
                value = read(row)
                if value is None:
                    continue
                stage_peak = peaks[label].get(row["stage"])
                if stage_peak is None or value > stage_peak[2]:
                    peaks[label][row["stage"]] = (step, time_s, value)
                if rows % stride == 0:
                    lines[label].append((step, time_s, value))
            if any(len(points) > 2 * max_points for points in lines.values()):
                # thin what is kept and keep every other row from now on: memory stays bounded in any run length
                stride *= 2
                lines = {label: points[::2] for label, points in lines.items()}
    return _Series(lines, peaks, rows, steps, times)


def _number(text: str | None) -> float | None:
    if not text:
        return None
    value = float(text)
    return None if math.isnan(value) else value
