"""lightning_mgpu: strategies and callbacks that let an unmodified LightningModule use every device it is given.

Importing the package registers the strategy names ``mgpu``, ``mgpu_ddp``, ``mgpu_ddp_spawn``, ``mgpu_ddp_fork``,
``mgpu_dp``, ``mgpu_fsdp`` and the compression presets ``mgpu_ddp_fp16``, ``mgpu_ddp_bf16``, ``mgpu_ddp_powersgd``
with Lightning.
The public classes are imported on first use (``lightning_mgpu.NaNSkip``, ``from lightning_mgpu import NaNSkip``).
Only ``python -m lightning_mgpu`` skips the registration: its ``config`` command prints a path without importing
torch, and its ``env`` command imports what it needs.
"""

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module it is imported from on first use
_EXPORTS: dict[str, str] = {
    "BatchSizeSearch": "lightning_mgpu.callbacks",
    "DDPStrategy": "lightning_mgpu.strategies",
    "DataParallelStrategy": "lightning_mgpu.strategies",
    "DeviceAgnosticSyncBatchNorm": "lightning_mgpu.strategies",
    "DistributedBatchNorm": "lightning_mgpu.core.distributed_batchnorm",
    "EMA": "lightning_mgpu.callbacks",
    "FSDPStrategy": "lightning_mgpu.strategies",
    "GPUMemoryMonitor": "lightning_mgpu.callbacks",
    "GPUSelectionError": "lightning_mgpu.memory.gpu_selection",
    "GradientClipping": "lightning_mgpu.callbacks",
    "MemoryHeadroomWarning": "lightning_mgpu.callbacks",
    "MultiGPUStrategy": "lightning_mgpu.strategies",
    "NaNSkip": "lightning_mgpu.callbacks",
    "NonFiniteStepsError": "lightning_mgpu.callbacks",
    "OOMBackoff": "lightning_mgpu.callbacks",
    "OOMRecoveryError": "lightning_mgpu.callbacks",
    "PerformanceMonitor": "lightning_mgpu.callbacks",
    "RollbackLimitError": "lightning_mgpu.callbacks",
    "SingleDeviceStrategy": "lightning_mgpu.strategies",
    "StrategyChoice": "lightning_mgpu.strategies",
    "StragglerWarning": "lightning_mgpu.callbacks",
    "register_strategies": "lightning_mgpu.strategies",
    "select_gpus": "lightning_mgpu.memory.gpu_selection",
}
_SUBPACKAGES = (
    "callbacks",
    "cli",
    "configs",
    "core",
    "ddp",
    "fsdp",
    "long_runs",
    "memory",
    "multi_gpu",
    "performance",
    "stability",
    "strategies",
)

if TYPE_CHECKING:
    from lightning_mgpu.callbacks import (
        EMA,
        BatchSizeSearch,
        GPUMemoryMonitor,
        GradientClipping,
        MemoryHeadroomWarning,
        NaNSkip,
        NonFiniteStepsError,
        OOMBackoff,
        OOMRecoveryError,
        PerformanceMonitor,
        RollbackLimitError,
        StragglerWarning,
    )
    from lightning_mgpu.core.distributed_batchnorm import DistributedBatchNorm
    from lightning_mgpu.memory.gpu_selection import GPUSelectionError, select_gpus
    from lightning_mgpu.strategies import (
        DataParallelStrategy,
        DDPStrategy,
        DeviceAgnosticSyncBatchNorm,
        FSDPStrategy,
        MultiGPUStrategy,
        SingleDeviceStrategy,
        StrategyChoice,
        register_strategies,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    if name in _SUBPACKAGES:
        return import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})


def _imported_by_python_m() -> bool:
    # While `python -m lightning_mgpu` imports this package to find its __main__, sys.argv[0] is "-m"; the command
    # line itself is in sys.orig_argv. A submodule run with -m (python -m lightning_mgpu.x) still registers.
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", [])
    for index, arg in enumerate(argv):
        if arg == "-m":
            return argv[index + 1 : index + 2] == [__name__]
        if arg.startswith("-m") and not arg.startswith("--"):
            return arg[2:] == __name__
    return False


if not _imported_by_python_m():
    from lightning_mgpu.strategies import register_strategies

    register_strategies()

__all__ = [
    "EMA",
    "BatchSizeSearch",
    "DDPStrategy",
    "DataParallelStrategy",
    "DeviceAgnosticSyncBatchNorm",
    "DistributedBatchNorm",
    "FSDPStrategy",
    "GPUMemoryMonitor",
    "GPUSelectionError",
    "GradientClipping",
    "MemoryHeadroomWarning",
    "MultiGPUStrategy",
    "NaNSkip",
    "NonFiniteStepsError",
    "OOMBackoff",
    "OOMRecoveryError",
    "PerformanceMonitor",
    "RollbackLimitError",
    "SingleDeviceStrategy",
    "StragglerWarning",
    "StrategyChoice",
    "__version__",
    "select_gpus",
]
