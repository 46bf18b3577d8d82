"""lightning_mgpu: strategies and callbacks that let an unmodified LightningModule use every device it is given.

Importing the package registers the strategy names ``mgpu``, ``mgpu_ddp``, ``mgpu_ddp_spawn``, ``mgpu_ddp_fork``,
``mgpu_dp`` and the compression presets ``mgpu_ddp_fp16``, ``mgpu_ddp_bf16``, ``mgpu_ddp_powersgd`` with Lightning.
"""

from lightning_mgpu.callbacks import (
    GPUMemoryMonitor,
    GradientClipping,
    MemoryHeadroomWarning,
    NaNSkip,
    NonFiniteStepsError,
    OOMBackoff,
    OOMRecoveryError,
)
from lightning_mgpu.strategies import (
    DataParallelStrategy,
    DDPStrategy,
    DeviceAgnosticSyncBatchNorm,
    MultiGPUStrategy,
    SingleDeviceStrategy,
    StrategyChoice,
    register_strategies,
)
from lightning_mgpu.utilities.distributed_batchnorm import DistributedBatchNorm

register_strategies()

__version__ = "0.1.0"

__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "DeviceAgnosticSyncBatchNorm",
    "DistributedBatchNorm",
    "GPUMemoryMonitor",
    "GradientClipping",
    "MemoryHeadroomWarning",
    "MultiGPUStrategy",
    "NaNSkip",
    "NonFiniteStepsError",
    "OOMBackoff",
    "OOMRecoveryError",
    "SingleDeviceStrategy",
    "StrategyChoice",
    "__version__",
]
