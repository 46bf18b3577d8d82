"""Synchronized BatchNorm as a Lightning ``LayerSync`` plugin that also works on CPU over gloo."""

from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from typing_extensions import override

from lightning_mgpu.core.distributed_batchnorm import convert_sync_batchnorm, revert_sync_batchnorm


class DeviceAgnosticSyncBatchNorm(LayerSync):
    """Convert every BatchNorm1d/2d/3d into a :class:`DistributedBatchNorm` and back.

    Unlike Lightning's ``TorchSyncBatchNorm`` (torch's ``nn.SyncBatchNorm``, CUDA only), the converted layers
    synchronise count-weighted fp32 statistics over any process group, gloo on CPU as well as NCCL on CUDA, with
    uneven per-rank batch sizes. ``revert`` restores the original classes with the same parameters and buffers.
    Our DDP strategies apply it for ``sync_batchnorm=True`` (or ``"auto"`` with BatchNorm layers and more than one
    process) and in place of ``TorchSyncBatchNorm`` when ``Trainer(sync_batchnorm=True)`` is set.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=MultiGPUStrategy(sync_batchnorm=True))
    """

    @override
    def apply(self, model: Module) -> Module:
        return convert_sync_batchnorm(model)

    @override
    def revert(self, model: Module) -> Module:
        return revert_sync_batchnorm(model)
