"""A per-rank CSV timeline of memory samples, written as they come, and a plot of it."""

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from lightning_mgpu.utilities.memory_sampler import MemorySample

_FIXED_COLUMNS = ("time_s", "step", "stage")


class MemoryTimeline:
    """Append every sample to a CSV file: ``time_s, step, stage`` and one column per metric (``gpu0_allocated_mb``).

    Rows are flushed every ``flush_every`` samples, so a crashed run keeps its timeline up to the crash and memory
    use does not grow with the length of the run.

    Args:
        path: the CSV file; its directory is created.
        keys: the sampler's metric keys, in column order.
        flush_every: samples between flushes.

    Example::

        timeline = MemoryTimeline("logs/memory_rank0.csv", sampler.keys)
        sampler = MemorySampler(gpus, nvml, hz=2.0, step=step, listeners=[timeline])
    """

    def __init__(self, path: str | Path, keys: Sequence[str], flush_every: int = 16) -> None:
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


def plot_timeline(csv_path: str | Path, png_path: str | Path, max_points: int = 4000) -> Path:
    """Plot memory over steps from a timeline CSV, one line per device, each stage's peak marked.

    GPUs show allocated and reserved memory; a run without GPUs shows the host process's resident memory. The file
    is read one row at a time and lines are thinned to about ``max_points`` points, so a days-long timeline plots in
    bounded memory; the peaks are found over every row. Drawn on a figure of its own (no pyplot), so the
    process's matplotlib backend, a notebook's inline plots for one, stays as it was. Needs matplotlib
    (``pip install lightning-mgpu[plot]``).

    Args:
        csv_path: a file written by :class:`MemoryTimeline`.
        png_path: where to write the PNG.
        max_points: points per line at most.

    Returns:
        ``png_path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with open(csv_path, newline="") as file:
        columns = next(csv.reader(file), [])
    slots = sorted({c.split("_", 1)[0] for c in columns if c.startswith("gpu")})
    series = [(f"{s} allocated", f"{s}_allocated_mb") for s in slots] + [
        (f"{s} reserved", f"{s}_reserved_mb") for s in slots
    ]
    lines, peaks, rows = _read_series(csv_path, [column for _, column in series], max_points)
    if not any(lines.get(column) for _, column in series):
        series = [("host process RSS", "host_rss_mb")]
        lines, peaks, rows = _read_series(csv_path, ["host_rss_mb"], max_points)

    figure = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for label, column in series:
        points = lines.get(column)
        if not points:
            continue
        (line,) = axes.plot([p[0] for p in points], [p[1] for p in points], label=label, linewidth=1.2)
        for stage, (peak_step, peak) in peaks.get(column, {}).items():
            axes.plot([peak_step], [peak], marker="v", color=line.get_color())
            axes.annotate(
                f"{stage} peak {peak:,.0f}", (peak_step, peak), textcoords="offset points", xytext=(4, 6), fontsize=7
            )
    axes.set_xlabel("training step")
    axes.set_ylabel("MiB")
    axes.set_title(f"memory over steps: {Path(csv_path).stem} ({rows} samples)")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    png_path = Path(png_path)
    figure.savefig(png_path, dpi=110)
    return png_path


def _read_series(
    csv_path: str | Path, columns: list[str], max_points: int
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, dict[str, tuple[int, float]]], int]:
    lines: dict[str, list[tuple[int, float]]] = {column: [] for column in columns}
    peaks: dict[str, dict[str, tuple[int, float]]] = {column: {} for column in columns}
    stride, rows = 1, 0
    with open(csv_path, newline="") as file:
        for row in csv.DictReader(file):
            rows += 1
            step = int(row["step"])
            for column in columns:
                value = _number(row.get(column))
                if value is None:
                    continue
                stage_peak = peaks[column].get(row["stage"])
                if stage_peak is None or value > stage_peak[1]:
                    peaks[column][row["stage"]] = (step, value)
                if rows % stride == 0:
                    lines[column].append((step, value))
            if any(len(points) > 2 * max_points for points in lines.values()):
                # thin what is kept and keep every other row from now on: memory stays bounded in any run length
                stride *= 2
                lines = {column: points[::2] for column, points in lines.items()}
    return lines, peaks, rows


def _number(text: str | None) -> float | None:
    if not text:
        return None
    value = float(text)
    return None if math.isnan(value) else value
