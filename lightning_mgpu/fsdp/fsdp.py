"""``FSDPStrategy``: FSDP2 sharding of an unmodified LightningModule, with its sharding units found for it."""

import uuid
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.blocks import apply_activation_checkpointing, sharding_units
from lightning_mgpu.core.distributed_batchnorm import has_batchnorm
from lightning_mgpu.core.options import ENGINE_OPTIONS, Option, SyncBatchNormSetting, validate, with_options
from lightning_mgpu.core.step_service import OwnStepService
from lightning_mgpu.core.strategy_choice import StrategyChoice
from lightning_mgpu.core.sync_batchnorm import DeviceAgnosticSyncBatchNorm
from lightning_mgpu.fsdp.memory_plan import MemoryPlan
from lightning_mgpu.fsdp.options import FSDP_OPTIONS, Sharding
from lightning_mgpu.fsdp.sharded_state import SHARDED_CALLBACK_STATES, ShardedCallbackState
from lightning_mgpu.long_runs.atomic_save import replace_folder, save_atomically, staging_folder
from lightning_mgpu.long_runs.exact_resume import ExactResume, ExactResumeHooks
from lightning_mgpu.long_runs.hang_watch import DEFAULT_HANG_TIMEOUT, HANG_TIMEOUT, FitHangWatch, HangWatchHooks
from lightning_mgpu.long_runs.preemption import SigtermAgreementHooks, release_mesh_at_exit

# the dimensions of hybrid sharding's device mesh: replicas across groups, shards within one
HYBRID_MESH_DIMS = ("replicate", "shard")
# Trainer precision -> FSDP2 parameter dtype for the forward and backward (gradients are reduced in float32)
_PARAM_DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16}
_SUPPORTED_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-true")
# the LightningModule methods the Trainer calls in place of forward: FSDP gathers the root's parameters around them
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


# the Args: section is generated from the declarations (core/options.py, fsdp/options.py, long_runs/hang_watch.py)
@with_options(ENGINE_OPTIONS, FSDP_OPTIONS, (HANG_TIMEOUT,))
class FSDPStrategy(OwnStepService, HangWatchHooks, SigtermAgreementHooks, ExactResumeHooks, ModelParallelStrategy):
    """Shard an unmodified LightningModule's parameters, gradients and optimizer state across processes with FSDP2.

    No ``configure_model`` is needed: at ``setup`` the strategy finds the model's repeated blocks (the layers of a
    transformer, see :func:`~lightning_mgpu.core.blocks.sharding_units`) and calls torch's ``fully_shard``
    on each, then on the LightningModule itself for the parameters outside the blocks (embeddings, heads, norms).
    Tied parameters (an output head that reuses the input embedding, as in GPT-2, BERT and T5) are never split
    between two units: the modules that share one stay together, with the root.
    Those are gathered around each ``training_step``/``validation_step``/... call, so the module may call ``self(x)``,
    its submodules, or its parameters directly. A module that already calls ``fully_shard`` in its own
    ``configure_model`` is left as it is.

    Precision: ``"bf16-mixed"`` computes with bfloat16 copies of the parameters (FSDP2's ``MixedPrecisionPolicy``)
    under autocast, keeps float32 shards and reduces gradients in float32; ``"32-true"``, ``"64-true"``,
    ``"bf16-true"`` and ``"16-true"`` shard parameters of that dtype. ``"16-mixed"`` is refused (it needs a gradient
    scaler that agrees across shards): use ``"bf16-mixed"``.

    Checkpoints are torch distributed checkpoints (a folder, each rank writing its own shards, nothing gathered);
    ``python -m lightning_mgpu export CHECKPOINT OUT.pt`` turns one into a single-file state dict. A mid-epoch
    checkpoint resumes exactly (:mod:`lightning_mgpu.long_runs.exact_resume`: its state goes into the folder's
    metadata file), and the hang watchdog of the DDP strategies runs here too (``hang_timeout``), as does their
    SIGTERM agreement (every rank stops at one batch, and SLURM's requeue checkpoint is saved there).

    Raises:
        ValueError: an unknown ``sharding``, an empty ``shard_units`` list, ``shard_group_size`` that is not a positive
            int or is given without ``sharding="hybrid"`` (at construction); at ``setup``: ``precision="16-mixed"``,
            ``cpu_offload=True`` on CPU devices, a class name that matches no module or whose modules split a tied
            parameter, a world size that ``shard_group_size`` does not divide.

    Example::

        trainer = Trainer(strategy="mgpu_fsdp", devices=8, precision="bf16-mixed")
        trainer = Trainer(strategy=MultiGPUStrategy(mode="fsdp", activation_checkpointing="auto"), devices=8)
        trainer = Trainer(strategy=MultiGPUStrategy(mode="fsdp", sharding="hybrid"), num_nodes=4, devices=8)
    """

    OPTIONS: ClassVar[tuple[Option, ...]]  # the declared options this class takes, in its signature's order

    def __init__(
        self,
        sharding: Sharding = "full",
        shard_group_size: int | None = None,
        shard_units: Literal["auto"] | list[str] = "auto",
        cpu_offload: bool = False,
        activation_checkpointing: Literal["auto"] | list[str] | None = None,
        sync_batchnorm: SyncBatchNormSetting = "auto",
        save_distributed_checkpoint: bool = True,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        owner = type(self).__name__
        validate(owner, FSDPStrategy.OPTIONS, locals())
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.accelerator = accelerator
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        if checkpoint_io is not None:
            self.checkpoint_io = checkpoint_io
        if precision_plugin is not None:
            self.precision_plugin = precision_plugin
        self.sharding = sharding
        self.shard_group_size = shard_group_size
        self.shard_mesh: DeviceMesh | None = None  # the mesh the units are sharded over, built at setup_environment
        self.shard_units = shard_units
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = activation_checkpointing
        self.sync_batchnorm = sync_batchnorm
        self.units: list[str] = []  # the sharding units of the last setup, by module name ("" is the LightningModule)
        self.checkpointed: list[str] = []
        self.precision_name = "32-true"
        self._exact_resume = ExactResume(owner)
        self.distributed_saves = save_distributed_checkpoint
        self.hang_timeout = hang_timeout
        self._hang_watch = FitHangWatch(hang_timeout)
        self._sigterm_agreement = None
        # set by MultiGPUStrategy when it chose FSDP: why, and the memory plan that chose it
        self.choice: StrategyChoice | None = None
        self.plan: MemoryPlan | None = None

    @override
    def setup_environment(self) -> None:
        # one data-parallel mesh dimension over every process: FSDP shards over all of them
        compat.set_mesh_sizes(self, self.num_nodes * self.num_processes, 1)
        super().setup_environment()
        # every fit, test or validation builds a new mesh, with new process groups: a module that shards itself in
        # configure_model, or one sharded by an earlier fit, is not sharded over it again
        release_mesh_at_exit(self.device_mesh)
        self.shard_mesh = self.device_mesh["data_parallel"]
        if self.sharding == "hybrid":
            group = self.shard_group_size or self.num_processes
            replicas = hybrid_replicas(type(self).__name__, self.world_size, group, self.shard_group_size is None)
            # each row of this mesh (one shard group) is one node's processes where ranks are numbered node by node
            self.shard_mesh = init_device_mesh(
                self.root_device.type, (replicas, group), mesh_dim_names=HYBRID_MESH_DIMS
            )
            if self.global_rank != self.node_rank * self.num_processes + self.local_rank:
                warnings.warn(  # on the ranks out of order: rank 0 is always node 0's first
                    f"{type(self).__name__}(sharding='hybrid'): rank {self.global_rank} is process {self.local_rank} "
                    f"of node {self.node_rank}: ranks are not numbered node by node, so a shard group spans nodes and "
                    "its all-gathers leave the node. Number ranks by node (SLURM's block distribution, torchrun's).",
                    stacklevel=2,
                )
        release_mesh_at_exit(self.shard_mesh)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        self._check_setup(trainer)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.sync_batchnorm is True or (self.sync_batchnorm == "auto" and has_batchnorm(module)):
            self.model = module = DeviceAgnosticSyncBatchNorm().apply(module)
        self.model = module = self.precision_plugin.convert_module(module)
        if any(isinstance(sub, FSDPModule) for sub in module.modules()):
            rank_zero_info(f"{type(self).__name__}: the module shards itself in configure_model; left as it is.")
        else:
            self._shard(module)
        compat.materialize_distributed_module(module, self.root_device)
        if not self.cpu_offload:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        self._install_agreement(trainer, paused=self._hang_watch.paused)
        self._hang_watch.setup(trainer)

    def _check_setup(self, trainer: "pl.Trainer") -> None:
        self.precision_name = check_precision(type(self).__name__, str(trainer.precision))
        if self.cpu_offload and self.root_device.type != "cuda":
            raise ValueError(
                f"{type(self).__name__}(cpu_offload=True) keeps shards in host memory for a GPU to compute with; on "
                f"{self.root_device.type} devices they are in host memory already. Use cpu_offload=False."
            )

    def _shard(self, module: nn.Module) -> None:
        names = {sub: name for name, sub in module.named_modules()}
        class_names = None if self.shard_units == "auto" else self.shard_units
        blocks = sharding_units(module, class_names, owner=type(self).__name__)
        if not blocks:
            rank_zero_warn(
                f"{type(self).__name__} found no repeated blocks in {type(module).__name__}: the whole model is one "
                "unit, gathered on every rank for the whole step, so sharding saves only gradient and optimizer "
                "memory. Name the classes of its layers with shard_units=[...]."
            )
        if self.activation_checkpointing is not None:
            self.checkpointed = apply_activation_checkpointing(
                type(self).__name__, module, self.activation_checkpointing
            )
        param_dtype = _PARAM_DTYPES.get(self.precision_name)
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        mesh = self.shard_mesh
        for block in blocks:
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=self.sharding != "grad_op",
                mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                offload_policy=offload,
            )
        # the root keeps its parameters gathered from forward to backward either way; its inputs are the whole batch
        # (targets too), so they are not cast to the compute dtype
        root_policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        fully_shard(module, mesh=mesh, mp_policy=root_policy, offload_policy=offload)
        for method in _STEP_METHODS:
            register_fsdp_forward_method(module, method)
        self.units = [names[block] for block in blocks] + [""]
        over = f"{mesh.size()} processes" if mesh.ndim == 1 else "{} replicas of {} processes".format(*mesh.shape)
        rank_zero_info(
            f"{type(self).__name__} sharded {type(module).__name__} over {over} "
            f"({self.sharding} sharding) in {len(self.units)} units: {_summarise(self.units)}"
            + (f"; activations recomputed in {len(self.checkpointed)} blocks" if self.checkpointed else "")
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save as Lightning's ``ModelParallelStrategy`` does, but so that a kill mid-save never corrupts ``filepath``.

        A sharded checkpoint is written into a hidden folder beside ``filepath`` and renamed into place once complete
        (:func:`~lightning_mgpu.long_runs.atomic_save.replace_folder`); a one-file checkpoint goes through
        :func:`~lightning_mgpu.long_runs.atomic_save.save_atomically`. Remote paths save as Lightning does.
        """
        with self._hang_watch.paused():
            self._add_resume_state(checkpoint)  # into the checkpoint's metadata file, beside the shards
            target = Path(self.broadcast(str(filepath)))  # rank 0's path, as Lightning's save takes
            remote = "://" in str(filepath) or storage_options is not None
            if remote or (target.is_dir() and not self.distributed_saves):
                super().save_checkpoint(checkpoint, filepath, storage_options)  # Lightning's errors and cleanup
            elif not self.distributed_saves:
                if self.is_global_zero:
                    save_atomically(self.checkpoint_io, checkpoint, target, None)
            else:
                # rank 0 names the folder (removing stale ones) before any rank writes a shard into it
                name = staging_folder(target, uuid.uuid4().hex[:8]).name if self.is_global_zero else ""
                staging = target.with_name(self.broadcast(name))
                super().save_checkpoint(checkpoint, staging)
                states = self._sharded_callback_states()
                if states:  # a distributed checkpoint of their own, in a subfolder Lightning's loading passes over
                    dcp.save(states, checkpoint_id=staging / SHARDED_CALLBACK_STATES)
                if self.is_global_zero:
                    replace_folder(staging, target)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._exact_resume.load(checkpoint, self.global_rank, self.world_size)
        self._load_sharded_callback_states(Path(self.broadcast(str(checkpoint_path))))
        return checkpoint

    def _sharded_callback_states(self) -> dict[str, dict[str, torch.Tensor]]:
        trainer = self.lightning_module.trainer
        return {
            callback.state_key: callback.sharded_state_dict(self.lightning_module)
            for callback in trainer.callbacks
            if isinstance(callback, ShardedCallbackState)
        }

    def _load_sharded_callback_states(self, path: Path) -> None:
        if not path.is_dir():  # a one-file checkpoint: the callbacks' states hold whole tensors
            return
        folder = path / SHARDED_CALLBACK_STATES
        states = self._sharded_callback_states()
        # rank 0 reads what was saved, so every rank loads the same keys (dcp.load is a collective)
        names = list(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata) if folder.is_dir() else []
        saved = set(self.broadcast(names if self.is_global_zero else None))
        missing = [key for key in states if not any(name.startswith(f"{key}.") for name in saved)]
        for key in missing:
            rank_zero_warn(f"{type(self).__name__}: {str(path)!r} holds no sharded state of the callback {key}")
            del states[key]
        if states:
            dcp.load(states, checkpoint_id=folder)  # in place, into the tensors the callbacks handed over

    @override
    def teardown(self) -> None:
        self.end_step_service()
        self._exact_resume.teardown()
        super().teardown()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # gradients are reduce-scattered after every backward, accumulation included: the shards stay small
        yield

    @override
    def on_validation_end(self) -> None:
        self._reshard()

    @override
    def on_test_end(self) -> None:
        self._reshard()

    @override
    def on_predict_end(self) -> None:
        self._reshard()

    def _reshard(self) -> None:
        # a forward without backward (evaluation) leaves grad_op units, and the root, gathered: free them now
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def local_parameter_count(self) -> int:
        """Parameter elements this process holds (its shards), for comparing memory with DDP."""
        return sum(_local(param).numel() for param in self.lightning_module.parameters())


def hybrid_replicas(owner: str, world_size: int, group: int, per_node: bool) -> int:
    """The replicas of hybrid sharding: ``world_size`` processes in groups of ``group``.

    Raises:
        ValueError: ``group`` does not divide ``world_size``.
    """
    if world_size % group:
        given = f"the {group} processes of a node" if per_node else f"shard_group_size={group}"
        raise ValueError(
            f"{owner}(sharding='hybrid'): {world_size} processes do not split into groups of {given}; give a "
            f"shard_group_size that divides {world_size}"
        )
    return world_size // group


def check_precision(owner: str, precision: str) -> str:
    """Return ``precision`` if FSDP supports it.

    Raises:
        ValueError: ``"16-mixed"`` (it needs a gradient scaler that agrees across shards) or another unsupported one.
    """
    if precision not in _SUPPORTED_PRECISIONS:
        raise ValueError(
            f"{owner} does not support Trainer(precision={precision!r}): fp16 mixed precision needs a gradient scaler "
            f"that agrees across shards. Use one of {', '.join(_SUPPORTED_PRECISIONS)} (bf16-mixed keeps float32 "
            "master weights)."
        )
    return precision


def _local(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def _summarise(names: list[str]) -> str:
    shown = [name or "<root>" for name in names]
    return ", ".join(shown) if len(shown) <= 6 else ", ".join([*shown[:3], "...", *shown[-2:]])
