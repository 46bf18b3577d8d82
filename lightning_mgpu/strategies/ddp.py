"""Lightning's DDP with its options as plain values, synchronized BatchNorm on any backend and named comm hooks."""

import math
from datetime import timedelta
from typing import Any, Literal, TypeAlias

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu.strategies.choice import StrategyChoice
from lightning_mgpu.strategies.preemption import SigtermAgreement
from lightning_mgpu.strategies.sync_batchnorm import DeviceAgnosticSyncBatchNorm
from lightning_mgpu.utilities.comm_hooks import COMM_HOOK_NAMES, CommHookName, register_comm_hook
from lightning_mgpu.utilities.distributed_batchnorm import has_batchnorm

SyncBatchNormSetting: TypeAlias = bool | Literal["auto"]
StartMethod: TypeAlias = Literal["popen", "spawn", "fork", "forkserver"]


class DDPStrategy(LightningDDPStrategy):
    """Lightning's DDPStrategy whose options are plain values, so a strategy name or a YAML config can set them.

    Additions over Lightning's DDP:

    - ``sync_batchnorm`` converts BatchNorm layers into :class:`DistributedBatchNorm`, which synchronises
      statistics over gloo on CPU as well as NCCL on CUDA (torch's ``SyncBatchNorm`` refuses CPU). ``"auto"``
      enables it when the model has BatchNorm layers and more than one process trains, and logs that it did.
      ``Trainer(sync_batchnorm=True)`` is honoured with the same layers.
    - ``comm_hook`` names a gradient compression: ``"fp16"``, ``"bf16"`` or ``"powersgd"`` (with error feedback).
      All three work over gloo and NCCL; Lightning registers hooks on CUDA only, and torch's own PowerSGD hook
      aborts or hangs on gloo.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        sync_batchnorm: ``True``, ``False`` or ``"auto"``.
        bucket_cap_mb: DDP gradient bucket size in MB; ``None`` keeps torch's default (25).
        gradient_as_bucket_view: let gradients be views into the DDP buckets (saves one copy and memory).
        static_graph: promise DDP the set of used parameters never changes between steps.
        find_unused_parameters: let DDP detect parameters that got no gradient in a step (costs a graph walk).
        comm_hook: ``None``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        powersgd_rank: rank of the PowerSGD low-rank approximation.
        powersgd_warmup_steps: optimizer steps of exact all-reduce before PowerSGD starts compressing.
        start_method: how processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``
            or ``"forkserver"``.
        timeout: process group timeout.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device.
        **kwargs: any further keyword argument of ``torch.nn.parallel.DistributedDataParallel``.

    Raises:
        ValueError: an option outside its allowed values.
        TypeError: an option of the wrong type.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(sync_batchnorm=True, comm_hook="bf16"))
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        sync_batchnorm: SyncBatchNormSetting = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        comm_hook: CommHookName | None = None,
        powersgd_rank: int = 1,
        powersgd_warmup_steps: int = 100,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        _check_sync_batchnorm(owner, sync_batchnorm)
        _check_bucket_cap_mb(owner, bucket_cap_mb)
        for name, value in (
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
            ("find_unused_parameters", find_unused_parameters),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
        if comm_hook is not None and comm_hook not in COMM_HOOK_NAMES:
            raise ValueError(
                f"{owner}: comm_hook must be None or one of {', '.join(map(repr, COMM_HOOK_NAMES))}, got {comm_hook!r}"
            )
        _check_int(owner, "powersgd_rank", powersgd_rank, minimum=1)
        _check_int(owner, "powersgd_warmup_steps", powersgd_warmup_steps, minimum=0)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"{owner}: start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}"
            )
        ddp_kwargs = dict(
            kwargs,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self.sync_batchnorm = sync_batchnorm
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_warmup_steps = powersgd_warmup_steps
        self.choice: StrategyChoice | None = None
        self._sigterm_agreement: SigtermAgreement | None = None

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self._layer_sync = self._choose_layer_sync()
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._sigterm_agreement = SigtermAgreement.for_trainer(trainer)
            if self._sigterm_agreement is not None:
                self._sigterm_agreement.install(trainer)

    @override
    def on_train_end(self) -> None:
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.at_train_end()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.uninstall()
            self._sigterm_agreement = None
        super().teardown()

    def _choose_layer_sync(self) -> LayerSync | None:
        trainer_plugin = self._layer_sync  # the Trainer's: TorchSyncBatchNorm for Trainer(sync_batchnorm=True)
        if trainer_plugin is not None and not isinstance(trainer_plugin, TorchSyncBatchNorm):
            return trainer_plugin  # a LayerSync of the user's own choosing
        wanted = True if trainer_plugin is not None else self.sync_batchnorm
        if wanted == "auto":
            module = self.lightning_module
            if module is None or not has_batchnorm(module) or self.world_size <= 1:
                return None
            rank_zero_info(
                f"{type(self).__name__}: sync_batchnorm='auto' synchronises BatchNorm statistics across "
                f"{self.world_size} processes (the model has BatchNorm layers)."
            )
        return DeviceAgnosticSyncBatchNorm() if wanted else None

    @override
    def _register_ddp_hooks(self) -> None:
        if self.comm_hook is None:
            super()._register_ddp_hooks()
            return
        assert isinstance(self.model, DistributedDataParallel)
        register_comm_hook(
            self.model,
            self.comm_hook,
            powersgd_rank=self.powersgd_rank,
            powersgd_warmup_steps=self.powersgd_warmup_steps,
        )


def _check_sync_batchnorm(owner: str, value: Any) -> None:
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"{owner}: sync_batchnorm must be True, False or 'auto', got {value!r}")


def _check_bucket_cap_mb(owner: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: bucket_cap_mb must be a positive number of MB or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{owner}: bucket_cap_mb must be a positive number of MB, got {value!r}; use None for torch's default (25)"
        )


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
