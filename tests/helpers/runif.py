"""Markers that skip tests needing hardware this machine lacks."""

import pytest
import torch


def cuda_gpus(min_count: int = 1) -> pytest.MarkDecorator:
    """Skip unless at least ``min_count`` CUDA GPUs are visible."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(available < min_count, reason=f"needs {min_count} CUDA GPU(s), found {available}")
