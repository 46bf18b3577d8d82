"""``run_if``: one marker for the hardware a test needs, in the manner of Lightning's ``RunIf``.

``@run_if(min_cuda_gpus=2)`` skips the test where fewer CUDA GPUs are visible and, through ``tests/conftest.py``,
marks it ``cuda`` so that ``python -m pytest -m cuda`` selects every GPU test on a machine that has them. A module
puts it in ``pytestmark``; nothing else marks GPU tests.
"""

import pytest
import torch


def visible_cuda_gpus() -> int:
    """CUDA GPUs torch sees (0 on a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_if(min_cuda_gpus: int = 0) -> pytest.MarkDecorator:
    """Skip unless the machine has what the test needs; the skip names what is missing.

    Args:
        min_cuda_gpus: CUDA GPUs the test needs; 1 or more also marks the test ``cuda``.
    """
    found = visible_cuda_gpus()
    missing = found < min_cuda_gpus
    reason = f"needs {min_cuda_gpus} CUDA GPU(s), found {found}" if missing else "the machine has what it needs"
    return pytest.mark.skipif(missing, reason=reason, min_cuda_gpus=min_cuda_gpus)


def needs_cuda(item: pytest.Item) -> bool:
    """Whether a collected test carries ``run_if(min_cuda_gpus>=1)``."""
    return any(mark.kwargs.get("min_cuda_gpus", 0) >= 1 for mark in item.iter_markers("skipif"))
