"""Callbacks, one per module, re-exported here."""

from lightning_mgpu.callbacks.batch_size_search import BatchSizeSearch
from lightning_mgpu.callbacks.ema import EMA
from lightning_mgpu.callbacks.gpu_memory_monitor import GPUMemoryMonitor, MemoryHeadroomWarning
from lightning_mgpu.callbacks.gradient_clipping import GradientClipping
from lightning_mgpu.callbacks.nan_skip import NaNSkip, NonFiniteStepsError, RollbackLimitError
from lightning_mgpu.callbacks.oom_backoff import OOMBackoff, OOMRecoveryError
from lightning_mgpu.callbacks.performance_monitor import PerformanceMonitor, StragglerWarning

__all__ = [
    "EMA",
    "BatchSizeSearch",
    "GPUMemoryMonitor",
    "GradientClipping",
    "MemoryHeadroomWarning",
    "NaNSkip",
    "NonFiniteStepsError",
    "OOMBackoff",
    "OOMRecoveryError",
    "PerformanceMonitor",
    "RollbackLimitError",
    "StragglerWarning",
]
