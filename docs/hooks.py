"""MkDocs hook: the site's plots, drawn at build time from the benchmarks' own output kept in ``docs/data/``.

Each plot is a PNG the site serves under ``plots/``; nothing drawn is committed, so a plot cannot disagree with its
data. The data files are what the benchmarks wrote (``--json-out``, ``--trials-out``) and the main example's memory
timeline; ``docs/explanation/benchmarks.md`` gives the command and machine of each. ``python docs/hooks.py OUT_DIR``
draws them into a folder, without MkDocs.
"""

import io
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _ratio_bars(axes: Any, rows: list[dict], title: str) -> None:
    """One horizontal bar per row: the median ratio, its range over rounds as a whisker, 1.0 marked."""
    labels = [row["config"] for row in rows]
    ratios = [row["ratio"] for row in rows]
    low = [row["ratio"] - (row["low"] if row["low"] is not None else row["ratio"]) for row in rows]
    high = [(row["high"] if row["high"] is not None else row["ratio"]) - row["ratio"] for row in rows]
    positions = range(len(rows))
    axes.barh(positions, ratios, xerr=[low, high], color="#5b8fd4", capsize=3)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_yticks(list(positions), labels)
    axes.invert_yaxis()
    for position, ratio in zip(positions, ratios, strict=True):  # the median, written inside its bar
        axes.annotate(
            f"{ratio:.2f}", (0, position), xytext=(4, -3), textcoords="offset points", fontsize=8, color="white"
        )
    axes.set_title(title, fontsize=10)


def throughput() -> bytes:
    """Samples per second of each configuration against stock Lightning's DDP, measured in the same rounds."""
    rows = [
        r for r in json.loads((DATA / "ddp_throughput.json").read_text()) if r["metric"] == "samples/s vs stock DDP"
    ]
    figure = _figure(7.0, 0.45 * len(rows) + 1.2)
    axes = figure.add_subplot()
    _ratio_bars(axes, rows, "samples/s against stock Lightning DDP (1.0 = the same; higher is faster)")
    axes.set_xlabel("ratio, median over rounds (whisker: range)")
    return _png(figure)


def fsdp_memory() -> bytes:
    """FSDP's memory added per rank and step time, each against DDP on the same model and run."""
    rows = json.loads((DATA / "fsdp_vs_ddp.json").read_text())
    figure = _figure(7.0, 2.6)
    for index, (word, title) in enumerate(
        (
            ("memory", "memory added per rank vs DDP (lower is smaller)"),
            ("step time", "step time vs DDP (lower is faster)"),
        )
    ):
        axes = figure.add_subplot(1, 2, index + 1)
        _ratio_bars(axes, [r for r in rows if r["metric"].startswith(word)], title)
    return _png(figure)


def memory_timeline() -> bytes:
    """The main example's memory timeline on rank 1, where it injects the out-of-memory error, with its events."""
    from lightning_mgpu.memory.memory_timeline import plot_timeline

    with tempfile.TemporaryDirectory() as folder:
        path = plot_timeline(DATA / "memory_fit_rank1.csv", Path(folder) / "timeline.png", title="main example, rank 1")
        return path.read_bytes()


def bucket_tuning() -> bytes:
    """The step time of each setting ``bucket_cap_mb="auto"`` tried in one fit, the chosen one marked."""
    tuning = json.loads((DATA / "bucket_tuning_trials.json").read_text())[0]["rounds"][0]
    labels, ms = list(tuning["step_ms"]), list(tuning["step_ms"].values())
    chosen = "default" if tuning["bucket_cap_mb"] is None else f"{tuning['bucket_cap_mb']:g}MB"
    if tuning.get("comm_hook"):
        chosen += f"+{tuning['comm_hook']}"
    figure = _figure(7.0, 0.4 * len(labels) + 1.3)
    axes = figure.add_subplot()
    colors = ["#e0793a" if label == chosen else "#5b8fd4" for label in labels]
    axes.barh(range(len(labels)), ms, color=colors)
    axes.set_yticks(range(len(labels)), labels)
    axes.invert_yaxis()
    axes.set_xlabel("median ms per optimizer step over the timed steps")
    axes.set_title(
        f"bucket_cap_mb='auto', one fit: kept {chosen} (orange); a change from {tuning['baseline']} had to gain "
        f"{tuning['margin']:.0%}",
        fontsize=10,
    )
    return _png(figure)


PLOTS: dict[str, Callable[[], bytes]] = {
    "throughput": throughput,
    "fsdp_memory": fsdp_memory,
    "memory_timeline": memory_timeline,
    "bucket_tuning": bucket_tuning,
}


# Sphinx roles in the docstrings (``:class:`~pkg.Name```), as mkdocstrings renders them: ``:class:<code>...</code>``
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):<code>(~?)([\w.]+)</code>")
_EXAMPLE = re.compile(r"<p>(Examples?)::</p>")


def on_page_content(html: str, **_: Any) -> str:
    """Show the docstrings' Sphinx roles as code (``~`` keeps the last name only) and ``Example::`` as a heading."""
    html = _ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)
    return _EXAMPLE.sub(r"<p><strong>\1</strong></p>", html)


def on_files(files: Any, config: Any) -> Any:
    """Add each plot to the site as ``plots/<name>.png``."""
    from mkdocs.structure.files import File

    for name, draw in PLOTS.items():
        files.append(File.generated(config, f"plots/{name}.png", content=draw()))
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        (out / f"{name}.png").write_bytes(draw())
        print(out / f"{name}.png")
