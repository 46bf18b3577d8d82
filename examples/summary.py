"""What the pack did in a run, read from the strategy's and the callbacks' own records: the examples' summary.

Shared by ``train.py`` and ``cli.py``; a callback left out of the Trainer gets a row that says so.
"""

from collections.abc import Iterable

import lightning.pytorch as pl

from lightning_mgpu import GPUMemoryMonitor, NaNSkip, OOMBackoff


def _find(trainer: pl.Trainer, kind: type):
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


def _strategy(trainer: pl.Trainer) -> str:
    choice = getattr(trainer.strategy, "choice", None)
    if choice is None:  # a strategy that is not the pack's
        return type(trainer.strategy).__name__
    return f"{type(trainer.strategy).__name__} -> {choice.mode} ({choice.reason})"


def _oom_recoveries(trainer: pl.Trainer) -> str:
    oom = _find(trainer, OOMBackoff)
    if oom is None:
        return "OOMBackoff not in the callbacks"
    batch = getattr(trainer.datamodule, "batch_size", None) if trainer.datamodule is not None else None
    micro = oom.micro_batch_size if oom.micro_batch_size is not None else batch
    if micro is None:
        return f"{oom.recoveries} (OOMBackoff)"
    of_batch = f" of {batch}" if batch is not None else ""
    return f"{oom.recoveries}; micro-batch size {micro}{of_batch} (OOMBackoff)"


def _peak_memory(trainer: pl.Trainer) -> str:
    monitor = _find(trainer, GPUMemoryMonitor)
    if monitor is None:
        return "GPUMemoryMonitor not in the callbacks"
    if monitor.training_peak_mb is None:
        return "not measured (no training step was logged)"
    over = f" (max over {trainer.world_size} ranks)" if trainer.world_size > 1 else ""
    return f"{monitor.training_peak_source} {monitor.training_peak_mb:.0f} MiB{over}"


def _memory_timeline(trainer: pl.Trainer) -> str:
    monitor = _find(trainer, GPUMemoryMonitor)
    files = (monitor.timeline_path, monitor.plot_path) if monitor is not None else ()
    return ", ".join(str(path) for path in files if path) or "not written"


def fit_summary(trainer: pl.Trainer, seconds: float, title: str, extra_rows: Iterable[tuple[str, str]] = ()) -> str:
    """The summary block printed after ``fit``: a title line, then one ``name  value`` row per line.

    Args:
        trainer: the Trainer after ``fit``.
        seconds: wall time of the fit.
        title: the first line.
        extra_rows: ``(name, value)`` rows added after the pack's own (the main example's injected faults).
    """
    nan_skip = _find(trainer, NaNSkip)
    validation = {k: v for k, v in trainer.callback_metrics.items() if k.startswith(("val_", "val/"))}
    metrics = ", ".join(f"{k} {float(v):.3f}" for k, v in validation.items())
    rows = [
        ("strategy", _strategy(trainer)),
        ("processes", str(trainer.world_size)),
        ("skipped steps", f"{nan_skip.skipped_steps} (NaNSkip)" if nan_skip else "NaNSkip not in the callbacks"),
        ("OOM recoveries", _oom_recoveries(trainer)),
        ("peak memory", _peak_memory(trainer)),
        ("memory timeline", _memory_timeline(trainer)),
        ("validation", metrics or "not run"),
        *extra_rows,
        ("time", f"{seconds:.1f} s"),
    ]
    return "\n".join([title, *(f"  {name:<16} {value}" for name, value in rows)])
