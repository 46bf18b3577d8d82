"""``MultiGPUStrategy``: picks single device, DataParallel or DDP from the hardware and the launch context."""

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.devices import accelerator_name
from lightning_mgpu.core.options import ENGINE_OPTIONS, Option, SyncBatchNormSetting, validate, with_options
from lightning_mgpu.core.strategy_choice import (
    LaunchContext,
    ModeOrAuto,
    StrategyChoice,
    choose_strategy,
    cuda_is_initialized,
    force_mode,
    is_interactive,
)
from lightning_mgpu.ddp.data_parallel import DataParallelStrategy
from lightning_mgpu.ddp.ddp import DDPStrategy
from lightning_mgpu.ddp.options import DDP_OPTIONS, BucketCapSetting, CommHookSetting, TunableCommHook
from lightning_mgpu.ddp.single_device import SingleDeviceStrategy
from lightning_mgpu.fsdp.fsdp import FSDPStrategy, check_precision
from lightning_mgpu.fsdp.memory_plan import MemoryPlan, require_fit
from lightning_mgpu.fsdp.memory_planning import make_plan
from lightning_mgpu.fsdp.options import FSDP_OPTIONS, Sharding
from lightning_mgpu.long_runs.hang_watch import DEFAULT_HANG_TIMEOUT, HANG_TIMEOUT
from lightning_mgpu.multi_gpu.options import MULTI_GPU_OPTIONS

_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}


# the Args: section is generated from the declarations (core/options.py, ddp/, fsdp/ and multi_gpu/options.py,
# long_runs/hang_watch.py)
@with_options(MULTI_GPU_OPTIONS, ENGINE_OPTIONS, DDP_OPTIONS, FSDP_OPTIONS, (HANG_TIMEOUT,))
class MultiGPUStrategy(DDPStrategy):
    """Use every device the Trainer was given, choosing how from the hardware and the launch context.

    The choice is made when the Trainer is built, without initialising CUDA, and logged once on rank 0:

    | situation | mode |
    |---|---|
    | ``num_nodes > 1`` | ``ddp`` |
    | processes launched by torchrun, SLURM, LSF, MPI, Lightning | ``ddp`` (joins them) |
    | one device | ``single`` |
    | several devices, run as a script | ``ddp`` (Lightning re-runs the script) |
    | several CPU devices, interactive | ``ddp_fork`` (``ddp_spawn`` without fork) |
    | several GPUs, interactive, CUDA not initialised | ``ddp_fork`` |
    | several GPUs, interactive, CUDA initialised or no fork | ``dp`` (DataParallel) |

    In a DDP mode the strategy stays a :class:`DDPStrategy` (this class); for ``single``, ``dp`` and ``fsdp`` it
    builds a :class:`SingleDeviceStrategy`, :class:`DataParallelStrategy` or :class:`FSDPStrategy` from its options
    and hands it to the Trainer, so ``trainer.strategy`` is always the strategy that runs. ``trainer.strategy.choice``
    (and this object's ``choice``) holds the :class:`StrategyChoice` (mode and reason). The DDP options only apply
    when a DDP mode is chosen.

    With ``mode="auto"`` and several processes, on CUDA or wherever ``memory_budget_mb`` is given, a memory plan runs
    at ``setup`` (:mod:`lightning_mgpu.fsdp.memory_planning`): the model is measured on its first micro-batch and
    the least-sharded setup that fits is chosen, DDP first, then FSDP (``hybrid`` on several nodes, ``grad_op``,
    ``full``, with activation checkpointing, with CPU offload). ``trainer.strategy.plan`` holds the table; for a choice
    other than DDP, the Trainer runs the fit with an :class:`FSDPStrategy` built from this strategy's options.

    Raises:
        TypeError: a ``mode`` or DDP option of the wrong type, or a keyword argument that neither
            ``DistributedDataParallel`` nor Lightning's ``DDPStrategy`` takes (the message names the closest valid
            name).
        ValueError: an unknown ``mode`` or a bad DDP, FSDP or memory option (at construction); ``mode="dp"`` without
            CUDA, ``mode="single"`` with several devices, ``mode="fsdp"`` with ``precision="16-mixed"`` (when the
            Trainer is built).
        MemoryPlanError: at ``setup``, on every rank, when the memory plan finds that nothing fits.

    Example::

        trainer = Trainer(strategy="mgpu", devices=2)
        trainer = Trainer(strategy=MultiGPUStrategy(mode="ddp", comm_hook="bf16"), devices=2)
        trainer.strategy.choice  # StrategyChoice(mode='ddp', reason='2 cuda devices from a script: ...')
    """

    strategy_name = "mgpu"
    OPTIONS: ClassVar[tuple[Option, ...]]  # the declared options this class takes, in its signature's order

    def __init__(
        self,
        mode: ModeOrAuto = "auto",
        sync_batchnorm: SyncBatchNormSetting = "auto",
        bucket_cap_mb: BucketCapSetting = "auto",
        bucket_tuning_steps: int = 30,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool | None = None,
        comm_hook: CommHookSetting = None,
        comm_hook_candidates: list[TunableCommHook] | None = None,
        powersgd_rank: int = 1,
        powersgd_warmup_steps: int = 100,
        sharding: Sharding = "full",
        shard_group_size: int | None = None,
        shard_units: Literal["auto"] | list[str] = "auto",
        cpu_offload: bool = False,
        activation_checkpointing: Literal["auto"] | list[str] | None = None,
        memory_budget_mb: float | None = None,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **kwargs: Any,
    ) -> None:
        # the options DDPStrategy does not take are checked here, in every mode; DDPStrategy checks its own
        validate(type(self).__name__, [o for o in MultiGPUStrategy.OPTIONS if o not in DDPStrategy.OPTIONS], locals())
        self.fsdp_options = dict(
            sharding=sharding, shard_group_size=shard_group_size, shard_units=shard_units, cpu_offload=cpu_offload
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            sync_batchnorm=sync_batchnorm,
            bucket_cap_mb=bucket_cap_mb,
            bucket_tuning_steps=bucket_tuning_steps,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
            comm_hook=comm_hook,
            comm_hook_candidates=comm_hook_candidates,
            powersgd_rank=powersgd_rank,
            powersgd_warmup_steps=powersgd_warmup_steps,
            timeout=timeout,
            process_group_backend=process_group_backend,
            activation_checkpointing=activation_checkpointing,
            hang_timeout=hang_timeout,
            **kwargs,
        )
        self.mode = mode
        self.memory_budget_mb = memory_budget_mb
        self.plan: MemoryPlan | None = None
        self.sharded_resume: Path | None = None  # a sharded checkpoint this fit resumes from, read by FSDPStrategy
        self._replacement: pl.strategies.Strategy | None = None  # the strategy chosen at launch, when not this one
        compat.check_launch_hook(self)

    @override
    def before_launch(self) -> bool:
        # Lightning's connector calls this last, once accelerator, devices, cluster environment and num_nodes are
        # set: the first moment everything the choice depends on is known
        if self.choice is None:
            context = self.launch_context()
            self.choice = choose_strategy(context) if self.mode == "auto" else force_mode(self.mode, context)
            rank_zero_info(f"{type(self).__name__} chose {self.choice.mode!r}: {self.choice.reason}.")
        if self.choice.mode == "fsdp":
            self._replacement = self.fsdp_strategy(self.choice)
            return False
        if self.choice.mode not in _START_METHODS:
            self._replacement = self.one_process_strategy(self.choice)
            return False
        compat.set_start_method(self, _START_METHODS[self.choice.mode])
        return True

    @override
    def launch_replacement(self) -> "pl.strategies.Strategy | None":
        replacement, self._replacement = self._replacement, None  # the Trainer holds it from now on
        return replacement

    @override
    def setup_environment(self) -> None:
        if self.choice is not None and self.choice.mode not in _START_METHODS:
            # the Trainer kept this object: its connector lost the patch that hands over the strategy chosen
            raise compat.UnsupportedLightningError(
                f"{type(self).__name__} chose {self.choice.mode!r}, but the Trainer runs this DDP strategy: the "
                "lightning_mgpu patch 'strategy_replacement' of Lightning's accelerator connector was removed or "
                "bypassed. Pass the chosen strategy itself (for example lightning_mgpu.FSDPStrategy()), or leave the "
                "patch in place."
            )
        self.sharded_resume = None  # each fit names its own checkpoint
        super().setup_environment()

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Lightning restores a DDP strategy's modules before setup, but a sharded checkpoint (a folder) can only be read
        # by FSDPStrategy, which the memory plan may make this strategy at setup: take the loops' and callbacks' state
        # now and leave the weights to FSDPStrategy, which restores after its setup
        if self.mode == "auto" and isinstance(checkpoint_path, (str, os.PathLike)) and Path(checkpoint_path).is_dir():
            self.sharded_resume = Path(checkpoint_path)
            return compat.sharded_checkpoint_metadata(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.sharded_resume is None:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if not self._plans(trainer):
            self._check_sharded_resume("no memory plan runs (mode='auto' plans on CUDA, or with memory_budget_mb)")
            super().setup(trainer)
            return
        compat.check_lightning_internals(trainer, type(self).__name__)
        shard_units = self.fsdp_options["shard_units"]
        # hybrid sharding is offered over a node's processes on several nodes, or over a shard_group_size given
        node_size = self.fsdp_options["shard_group_size"] or (self.num_processes if self.num_nodes > 1 else None)
        units = None if shard_units == "auto" else shard_units
        self.plan = make_plan(trainer, self, self.memory_budget_mb, units, node_size)
        option = require_fit(self.plan)
        rank_zero_info(f"{type(self).__name__} memory plan:\n{self.plan.table()}")
        if option == "ddp":
            self._check_sharded_resume("the memory plan chose DDP")
            super().setup(trainer)
            return
        self._switch_to_fsdp(trainer, option)

    def _check_sharded_resume(self, why: str) -> None:
        if self.sharded_resume is not None:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint {str(self.sharded_resume)!r} is sharded (a folder of FSDP "
                f"shards), but {why}, so this run trains with DDP. Resume with MultiGPUStrategy(mode='fsdp'), or turn "
                "it into one file first: python -m lightning_mgpu export CHECKPOINT OUT.pt."
            )

    def _plans(self, trainer: "pl.Trainer") -> bool:
        # the plan needs the model and its data, known only now; on CPU it runs when given a budget, since host memory
        # rarely limits a CPU run and measuring costs one extra forward pass
        return (
            self.mode == "auto"
            and trainer.state.fn == TrainerFn.FITTING
            and self.world_size > 1
            and (self.memory_budget_mb is not None or self.root_device.type == "cuda")
        )

    def _switch_to_fsdp(self, trainer: "pl.Trainer", option: str) -> None:
        # the processes and their process group exist already: FSDPStrategy joins them and builds its device mesh
        plan = self.plan
        recomputes = plan.row("fsdp_full_ac").activations_mb < plan.row("fsdp_full").activations_mb
        choice = StrategyChoice(
            "fsdp",
            f"the memory plan chose {option!r}: DDP needs {plan.row('ddp').total_mb:,.1f} MB a device, "
            f"{plan.budget_mb * (1 - plan.margin):,.1f} MB are usable",
        )
        fsdp = self.fsdp_strategy(
            choice,
            sharding={"fsdp_grad_op": "grad_op", "fsdp_hybrid": "hybrid"}.get(option, "full"),
            shard_group_size=self.fsdp_options["shard_group_size"] if option == "fsdp_hybrid" else None,
            # "auto" only where the plan found blocks to recompute (without them the estimate counted no saving)
            activation_checkpointing="auto" if "_ac" in option and recomputes else self.activation_checkpointing,
            cpu_offload=option.endswith("offload"),
            launch=False,
        )
        compat.set_launcher(fsdp, self.launcher)
        fsdp.connect(self.lightning_module)
        fsdp.plan = plan
        # the fit's step service goes on with the FSDP strategy; what callbacks asked of DDP's reduction in their setup
        # hooks does not apply to it
        service = self.hand_step_service_to(fsdp)
        service.drop_flag()
        service.time_reductions(None)
        service.reads_requests = False
        compat.replace_trainer_strategy(trainer, fsdp)
        fsdp.setup_environment()
        fsdp.setup(trainer)

    def launch_context(self) -> LaunchContext:
        """Describe the hardware and launch context this strategy was configured with."""
        env = self.cluster_environment
        external = env is not None and env.creates_processes_externally
        return LaunchContext(
            accelerator=accelerator_name(self.accelerator),
            num_devices=len(self.parallel_devices or []),
            num_nodes=self.num_nodes,
            external_launcher=type(env).__name__ if external else None,
            external_world_size=env.world_size() if external else 1,
            interactive=is_interactive(),
            cuda_initialized=cuda_is_initialized(),
            fork_available="fork" in mp.get_all_start_methods(),
        )

    def fsdp_strategy(self, choice: StrategyChoice, launch: bool = True, **overrides: Any) -> FSDPStrategy:
        """The :class:`FSDPStrategy` this strategy's options describe, with the plugins the Trainer gave it.

        Args:
            choice: why FSDP runs; the new strategy's ``choice``.
            launch: build its launcher (at the Trainer's construction); ``False`` when the processes run already.
            **overrides: FSDP options that replace this strategy's (the memory plan's sharding, for example).
        """
        # FSDPStrategy derives from Lightning's ModelParallelStrategy, which builds its own launcher
        plugins = compat.strategy_plugins(self)
        # the Trainer's precision is known now: refuse fp16 mixed precision when the Trainer is built, not at fit
        check_precision(type(self).__name__, str(getattr(plugins["precision_plugin"], "precision", "32-true")))
        sync_batchnorm = True if compat.layer_sync(self) is not None else self.sync_batchnorm
        settings = dict(
            self.fsdp_options,
            activation_checkpointing=self.activation_checkpointing,
            sync_batchnorm=sync_batchnorm,
            hang_timeout=self.hang_timeout,
            timeout=compat.process_group_timeout(self),
            process_group_backend=self.process_group_backend,
            parallel_devices=self.parallel_devices,
            cluster_environment=self.cluster_environment,
        )
        settings.update(overrides)
        fsdp = FSDPStrategy(**settings, **plugins)
        fsdp.num_nodes = self.num_nodes
        fsdp.choice = choice
        if launch:
            compat.configure_launcher(fsdp)
        return fsdp

    def one_process_strategy(self, choice: StrategyChoice) -> "DataParallelStrategy | SingleDeviceStrategy":
        """The strategy of a ``dp`` or ``single`` choice, on this strategy's devices and with its plugins.

        Only what the Trainer's connector has set so far carries over; everything else starts fresh.
        """
        plugins = compat.strategy_plugins(self)
        devices = list(self.parallel_devices or [torch.device("cpu")])
        if choice.mode == "dp":
            strategy: DataParallelStrategy | SingleDeviceStrategy = DataParallelStrategy(
                parallel_devices=devices, **plugins
            )
        else:
            strategy = SingleDeviceStrategy(device=devices[0], **plugins)
        strategy.choice = choice
        return strategy
