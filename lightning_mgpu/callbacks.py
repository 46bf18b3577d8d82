"""The pack's callbacks under the names users import (``from lightning_mgpu.callbacks import NaNSkip``).

Each lives in the room of its feature, beside its algorithms: ``stability``, ``memory``, ``performance``.
"""

from lightning_mgpu.memory.batch_size_search import BatchSizeSearch
from lightning_mgpu.memory.gpu_memory_monitor import GPUMemoryMonitor, MemoryHeadroomWarning
from lightning_mgpu.memory.oom_backoff import OOMBackoff, OOMRecoveryError
from lightning_mgpu.performance.performance_monitor import PerformanceMonitor, StragglerWarning
from lightning_mgpu.stability.ema import EMA
from lightning_mgpu.stability.gradient_clipping import GradientClipping
from lightning_mgpu.stability.nan_skip import NaNSkip, NonFiniteStepsError, RollbackLimitError

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
