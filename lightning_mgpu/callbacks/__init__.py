"""Callbacks, one per module, re-exported here."""

from lightning_mgpu.callbacks.gpu_memory_monitor import GPUMemoryMonitor, MemoryHeadroomWarning
from lightning_mgpu.callbacks.gradient_clipping import GradientClipping
from lightning_mgpu.callbacks.nan_skip import NaNSkip, NonFiniteStepsError

__all__ = ["GPUMemoryMonitor", "GradientClipping", "MemoryHeadroomWarning", "NaNSkip", "NonFiniteStepsError"]
