"""The pack's strategies under the names users import (``from lightning_mgpu.strategies import DDPStrategy``).

Each lives in the room of its feature; ``import lightning_mgpu`` registers the strategy names
(:data:`REGISTERED_STRATEGIES`) with Lightning.
"""

from lightning_mgpu.core.strategy_choice import LaunchContext, StrategyChoice, choose_strategy
from lightning_mgpu.core.sync_batchnorm import DeviceAgnosticSyncBatchNorm
from lightning_mgpu.ddp.data_parallel import DataParallelStrategy
from lightning_mgpu.ddp.ddp import DDPStrategy
from lightning_mgpu.ddp.single_device import SingleDeviceStrategy
from lightning_mgpu.fsdp.fsdp import FSDPStrategy
from lightning_mgpu.multi_gpu.multi_gpu import MultiGPUStrategy
from lightning_mgpu.multi_gpu.registration import (
    REGISTERED_STRATEGIES,
    install_strategy_name_hint,
    register_strategies,
    unknown_strategy_message,
)

__all__ = [
    "REGISTERED_STRATEGIES",
    "DDPStrategy",
    "DataParallelStrategy",
    "DeviceAgnosticSyncBatchNorm",
    "FSDPStrategy",
    "LaunchContext",
    "MultiGPUStrategy",
    "SingleDeviceStrategy",
    "StrategyChoice",
    "choose_strategy",
    "install_strategy_name_hint",
    "register_strategies",
    "unknown_strategy_message",
]
