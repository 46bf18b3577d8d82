"""The benchmarks' rows (``_common.Row``: a ratio against a baseline of the same run) as a markdown table and a plot.

``run_all.py`` uses both. The plot turns every ratio into "higher is better" (a step-time ratio r becomes the speed
1 / r), so a bar right of 1.0 is better than the baseline and a bar left of it worse.
"""

import operator
import re
import textwrap
from pathlib import Path

from _common import Row

_TARGET = re.compile(r"^(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)$")
_COMPARE = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def target_met(row: Row) -> bool | None:
    """Whether the median meets the row's target; None without a target of the form ``">= 0.98"``."""
    target = _target(row)
    return None if target is None else _COMPARE[target[0]](row.ratio, target[1])


def markdown_table(rows: list[Row], not_run: dict[str, str]) -> str:
    """One line per row, then one per benchmark in ``not_run`` (name -> ``"skipped: why"`` or ``"failed: ..."``)."""
    lines = [
        "| benchmark | configuration | ratio of | baseline (same run) | ratio, median | range over rounds | better "
        "| target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.low is None or row.high is None:
            spread = f"none (one figure over {_rounds(row.rounds)})"
        elif row.rounds == 1:
            spread = "none (1 round)"
        else:
            spread = f"{row.low:.3f}-{row.high:.3f} ({_rounds(row.rounds)})"
        met = target_met(row)
        target = row.target or ""
        if met is not None:
            target += ": met" if met else ": **not met**"
        cells = (row.benchmark, row.config, row.metric, row.baseline, f"{row.ratio:.3f}", spread, row.better, target)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    for name, why in not_run.items():
        status, _, reason = why.partition(": ")
        lines.append(f"| {_cell(name)} | **{_cell(status)}** | {_cell(reason)} | | | | | |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Horizontal bars from 1.0 (the baseline) to each ratio as "higher is better", range as error bars, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    shown = rows[::-1]  # barh puts the first bar at the bottom; the table's first row goes on top
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.42 * max(len(shown), 1)))
    if not shown:
        ax.text(0.5, 0.5, "no ratios: every benchmark was skipped or failed", ha="center", va="center")
        ax.set_axis_off()
    else:
        values, lows, highs = zip(*map(_as_speed, shown), strict=True)
        y = list(range(len(shown)))
        colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
        ax.barh(y, [v - 1 for v in values], left=1, color=colors, alpha=0.75)
        ranged = [i for i, row in enumerate(shown) if row.rounds > 1 and row.low is not None]
        if ranged:
            errors = [[values[i] - lows[i] for i in ranged], [highs[i] - values[i] for i in ranged]]
            ax.errorbar([values[i] for i in ranged], ranged, xerr=errors, fmt="none", ecolor="black", capsize=3)
        ax.axvline(1.0, color="black", linewidth=1)
        for i, (v, hi) in enumerate(zip(values, highs, strict=True)):
            ax.annotate(f"{v:.3f}", (max(hi, 1.0), i), xytext=(4, 0), textcoords="offset points", va="center", size=8)
        xlabel = (
            "relative to the baseline of the same run (1.0 = stock Lightning or no callback unless the table says "
            "otherwise)\nhigher is better: lower-is-better ratios (step time) are shown as speed = 1 / ratio\n"
            "error bars: range over rounds"
        )
        targets = [(_speed(target[1], row), i) for i, row in enumerate(shown) if (target := _target(row))]
        if targets:
            ax.scatter(*zip(*targets, strict=True), marker="|", s=300, color="tab:purple", zorder=3)
            xlabel += "; purple tick: the script's target"
        ax.set_yticks(y, [f"{row.benchmark}: {row.config}\n{row.metric}" for row in shown], fontsize=8)
        ax.set_ylim(-0.7, len(shown) - 0.3)
        ax.margins(x=0.08)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title("\n".join(textwrap.fill(line, 120) for line in title.splitlines()), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _as_speed(row: Row) -> tuple[float, float, float]:
    """Median, low and high as "higher is better"; no range gives low = high = median."""
    value = _speed(row.ratio, row)
    if row.low is None or row.high is None:
        return value, value, value
    low, high = sorted((_speed(row.low, row), _speed(row.high, row)))
    return value, low, high


def _target(row: Row) -> tuple[str, float] | None:
    match = _TARGET.match((row.target or "").strip())
    return None if match is None else (match[1], float(match[2]))


def _speed(value: float, row: Row) -> float:
    return value if row.better == "higher" else 1 / value


def _rounds(n: int) -> str:
    return f"{n} round" if n == 1 else f"{n} rounds"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
