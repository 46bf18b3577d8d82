"""Trainer keyword arguments and a logger shared by the tests."""

from typing import Any

from lightning.pytorch.loggers import Logger

# no logger, checkpoints, progress bar or model summary: tests read what they assert on from the objects
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call: a key logged twice for one step shows up twice."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, key: str) -> list[float]:
        return [metrics[key] for _, metrics in self.calls if key in metrics]
