"""Lightning's DDP with its options as plain values, synchronized BatchNorm on any backend and named comm hooks."""

import difflib
import functools
import inspect
import os
from datetime import timedelta
from typing import Any, ClassVar, Literal, TypeAlias

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.blocks import apply_activation_checkpointing
from lightning_mgpu.core.distributed_batchnorm import has_batchnorm
from lightning_mgpu.core.options import ENGINE_OPTIONS, Option, SyncBatchNormSetting, validate, with_options
from lightning_mgpu.core.step_service import OwnStepService
from lightning_mgpu.core.step_timing import CommTimer
from lightning_mgpu.core.strategy_choice import StrategyChoice
from lightning_mgpu.core.sync_batchnorm import DeviceAgnosticSyncBatchNorm
from lightning_mgpu.ddp.bucket_tuning import BucketTuningResult
from lightning_mgpu.ddp.comm_hooks import register_comm_hook, register_timed_allreduce
from lightning_mgpu.ddp.ddp_bucket_tuning import (
    BUCKET_TUNING_CHECKPOINT_KEY,
    MIN_BUCKET_TUNING_STEPS,
    DDPBucketTuning,
)
from lightning_mgpu.ddp.options import (
    DDP_OPTIONS,
    TUNABLE_COMM_HOOKS,
    BucketCapSetting,
    CommHookSetting,
    StartMethod,
    TunableCommHook,
    tunable_hooks,
)
from lightning_mgpu.ddp.step_flag import StepFlag, register_flagged_hook
from lightning_mgpu.long_runs.atomic_save import save_atomically
from lightning_mgpu.long_runs.exact_resume import ExactResume, ExactResumeHooks
from lightning_mgpu.long_runs.hang_watch import DEFAULT_HANG_TIMEOUT, HANG_TIMEOUT, FitHangWatch, HangWatchHooks
from lightning_mgpu.long_runs.preemption import SigtermAgreement, SigtermAgreementHooks

CheckpointPath: TypeAlias = str | os.PathLike[str]

# the checkpoint key and the budget floor live with the tuning, the option types with the options; importable from here
__all__ = [
    "BUCKET_TUNING_CHECKPOINT_KEY",
    "MIN_BUCKET_TUNING_STEPS",
    "TUNABLE_COMM_HOOKS",
    "BucketCapSetting",
    "CheckpointPath",
    "CommHookSetting",
    "DDPStrategy",
    "StartMethod",
    "SyncBatchNormSetting",
    "TunableCommHook",
    "ddp_keyword_arguments",
]

# how DistributedDataParallel's error for parameters that got no gradient begins (the text Lightning matches too)
_UNUSED_PARAMETERS_ERROR = "Expected to have finished reduction in the prior iteration"


# the Args: section is generated from the declarations (core/options.py, ddp/options.py, long_runs/hang_watch.py)
@with_options(ENGINE_OPTIONS, DDP_OPTIONS, (HANG_TIMEOUT,))
class DDPStrategy(OwnStepService, HangWatchHooks, SigtermAgreementHooks, ExactResumeHooks, compat.DDPStrategyBase):
    """Lightning's DDPStrategy whose options are plain values, so a strategy name or a YAML config can set them.

    Additions over Lightning's DDP:

    - ``sync_batchnorm`` converts BatchNorm layers into :class:`DistributedBatchNorm`, which synchronises
      statistics over gloo on CPU as well as NCCL on CUDA (torch's ``SyncBatchNorm`` refuses CPU). ``"auto"``
      enables it when the model has BatchNorm layers and more than one process trains, and logs that it did.
      ``Trainer(sync_batchnorm=True)`` is honoured with the same layers.
    - ``comm_hook`` names a gradient compression: ``"fp16"``, ``"bf16"`` or ``"powersgd"`` (with error feedback).
      All three work over gloo and NCCL; Lightning registers hooks on CUDA only, and torch's own PowerSGD hook
      aborts or hangs on gloo.
    - ``bucket_cap_mb="auto"`` times the gradient bucket sizes worth trying for the model on the fit's own first
      optimizer steps (at most ``bucket_tuning_steps``, after a warm-up and after DDP's bucket rebuild), keeps the
      fastest and re-wraps DDP with it. Rank 0's timings decide, so every rank takes the same size. The trial
      steps are ordinary training steps: nothing is skipped or repeated (on 2 processes the parameters are
      bit-identical to a run with the chosen size from the start; on more, the all-reduce may sum in another order).
      Guard rails: a size must beat torch's default (a 1 MiB first bucket, then 25 MiB) by 2%, or by more when the
      timed steps are noisy, to replace it; fits with fewer than 10 x ``bucket_tuning_steps`` optimizer steps keep
      the default untimed, as do a fixed ``powersgd`` hook and Lightning's own ``ddp_comm_hook`` (their state is per
      bucket). The result is logged (``ddp/bucket_cap_mb``, ``ddp/bucket_tuning_seconds``,
      ``ddp/bucket_tuning_speedup``, ``ddp/bucket_trial_ms/<setting>``), kept in :attr:`bucket_tuning` and saved in
      checkpoints, so a resumed fit re-uses it without tuning again.
    - ``comm_hook="auto"`` then times each hook of ``comm_hook_candidates`` (compression changes the numerics, so
      only hooks listed there are tried; their trial steps train with compressed gradients) against no hook at the
      chosen bucket size, and keeps one only if it is faster by the same margin. PowerSGD is not a candidate: its
      warm-up steps are exact all-reduces, so a short trial cannot time it.

    - Long runs: a mid-epoch checkpoint resumes exactly (the training loader's remaining batches in their order, each
      rank's random streams as at the save; :mod:`lightning_mgpu.long_runs.exact_resume`), checkpoints are written
      atomically, and a hang watchdog (``hang_timeout``; :mod:`lightning_mgpu.long_runs.hang_watch`) names a rank
      that stopped making progress, with every rank's stack, and ends every rank with status 124.

    Raises:
        TypeError: an option of the wrong type (a non-bool flag, a non-int step count, a ``bucket_cap_mb`` that is
            not a number, ``"auto"`` or None, a ``comm_hook``, ``sync_batchnorm`` or ``start_method`` of no allowed
            type), or a keyword argument that neither ``DistributedDataParallel`` nor Lightning's ``DDPStrategy``
            takes (the message names the closest valid name).
        ValueError: an option outside its allowed values, or ``comm_hook_candidates`` without
            ``comm_hook="auto"``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(sync_batchnorm=True, comm_hook="bf16"))
        trainer = Trainer(devices=8, strategy=DDPStrategy(bucket_cap_mb="auto", comm_hook="auto"))
        trainer.fit(model)
        trainer.strategy.bucket_tuning  # BucketTuningResult(bucket_cap_mb=50, comm_hook=None, reason='tuned', ...)
    """

    OPTIONS: ClassVar[tuple[Option, ...]]  # the declared options this class takes, in its signature's order
    reads_step_requests = True  # the step service's reduction requests, read when the model is wrapped

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        sync_batchnorm: SyncBatchNormSetting = False,
        bucket_cap_mb: BucketCapSetting = None,
        bucket_tuning_steps: int = 30,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool | None = None,
        comm_hook: CommHookSetting = None,
        comm_hook_candidates: list[TunableCommHook] | None = None,
        powersgd_rank: int = 1,
        powersgd_warmup_steps: int = 100,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        activation_checkpointing: Literal["auto"] | list[str] | None = None,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        _check_ddp_kwargs(self, kwargs)
        validate(type(self).__name__, DDPStrategy.OPTIONS, locals())
        ddp_kwargs = dict(
            kwargs,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        if broadcast_buffers is not None:  # torch 2.13 deprecates it (FutureWarning): pass it only when asked for
            ddp_kwargs["broadcast_buffers"] = broadcast_buffers
        if bucket_cap_mb not in (None, "auto"):
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
        self.activation_checkpointing = activation_checkpointing
        self.checkpointed: list[str] = []  # the blocks whose activations are recomputed, by module name
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_tuning_steps = bucket_tuning_steps
        self.comm_hook = comm_hook
        self.comm_hook_candidates = tunable_hooks(comm_hook, comm_hook_candidates)
        self._tuning = DDPBucketTuning(self)
        self.powersgd_rank = powersgd_rank
        self.powersgd_warmup_steps = powersgd_warmup_steps
        self.choice: StrategyChoice | None = None
        self._sigterm_agreement: SigtermAgreement | None = None
        self._exact_resume = ExactResume(type(self).__name__)
        self.hang_timeout = hang_timeout
        self._hang_watch = FitHangWatch(hang_timeout)

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """A copy of the keyword arguments ``DistributedDataParallel`` is built with (the bucket size in use)."""
        return dict(compat.ddp_kwargs(self))

    @property
    def bucket_tuning(self) -> BucketTuningResult | None:
        """What ``bucket_cap_mb="auto"`` / ``comm_hook="auto"`` settled on (or why not); ``None`` until a batch."""
        return self._tuning.result

    @property
    def tunes_buckets(self) -> bool:
        """Whether ``bucket_cap_mb`` or ``comm_hook`` is ``"auto"``."""
        return self.bucket_cap_mb == "auto" or self.comm_hook == "auto"

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        compat.set_layer_sync(self, self._choose_layer_sync())
        self._tuning.setup(trainer)  # before DDP wraps the model: it wraps once, with the setting chosen here
        if self.activation_checkpointing is not None:
            self.checkpointed = apply_activation_checkpointing(
                type(self).__name__, self.lightning_module, self.activation_checkpointing
            )
        super().setup(trainer)
        self._install_agreement(trainer, paused=self._hang_watch.paused)
        self._hang_watch.setup(trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning's DDPStrategy rewrites DDP's unused-parameter error to suggest one of its own strategy names,
        # which would replace this strategy; point at this class's option instead and keep DDP's own text
        super(LightningDDPStrategy, self).on_exception(exception)
        owner = type(self).__name__
        module = type(self).__module__
        class_path = f"lightning_mgpu.{owner}" if module.startswith("lightning_mgpu.") else f"{module}.{owner}"
        hint = (
            "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
            f"training_step. If this is intentional, enable DDP's detection of unused parameters with "
            f"`{owner}(find_unused_parameters=True)`, or in a YAML config `init_args: {{find_unused_parameters: "
            f"true}}` under `class_path: {class_path}`. DistributedDataParallel's error: "
        )
        exception.args = tuple(
            hint + arg if isinstance(arg, str) and _UNUSED_PARAMETERS_ERROR in arg else arg for arg in exception.args
        )

    @override
    def teardown(self) -> None:
        self.end_step_service()
        self._hang_watch.stop()
        self._tuning.teardown()
        self._exact_resume.teardown()
        super().teardown()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if not self._tuning.settled:
            self._tuning.on_train_batch_start()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        self._tuning.save(checkpoint)
        with self._hang_watch.paused():
            self._add_resume_state(checkpoint)
            if self.is_global_zero:
                save_atomically(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: CheckpointPath, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # forwards whatever this Lightning's signature takes: `weights_only` arrived in 2.6
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._tuning.load(checkpoint)
        self._exact_resume.load(checkpoint, self.global_rank, self.world_size)
        return checkpoint

    @property
    def _restored_tuning(self) -> BucketTuningResult | None:
        """The tuned setting read from the checkpoint the next fit resumes from, if any."""
        return self._tuning.restored

    @property
    def _active_comm_hook(self) -> str | None:
        """The comm hook registered on DDP's current wrapper (the fixed one, or ``comm_hook="auto"``'s)."""
        return self._tuning.active_comm_hook

    def _choose_layer_sync(self) -> LayerSync | None:
        trainer_plugin = compat.layer_sync(self)  # the Trainer's: TorchSyncBatchNorm for Trainer(sync_batchnorm=True)
        if trainer_plugin is not None and not isinstance(trainer_plugin, TorchSyncBatchNorm):
            return trainer_plugin  # a LayerSync of the user's own choosing
        wanted = True if trainer_plugin is not None else self.sync_batchnorm
        declined = self.step_service.local_batchnorm
        if wanted == "auto":
            module = self.lightning_module
            if module is None or not has_batchnorm(module) or self.world_size <= 1:
                return None
            if declined is not None:
                rank_zero_info(
                    f"{type(self).__name__}: sync_batchnorm='auto' leaves BatchNorm per process: {declined}."
                )
                return None
            rank_zero_info(
                f"{type(self).__name__}: sync_batchnorm='auto' synchronises BatchNorm statistics across "
                f"{self.world_size} processes (the model has BatchNorm layers)."
            )
        return DeviceAgnosticSyncBatchNorm() if wanted else None

    @property
    def comm_timed(self) -> bool:
        """Whether the gradient reductions of the wrapped model are timed: a timed hook was registered on it.

        Not with PowerSGD (its buckets all complete with the last one, so per-bucket spans would not say when each
        was reduced), a ``ddp_comm_hook`` of Lightning's, or a hook DDP registered itself (``mixed_precision``).
        """
        return self.step_service_started and self.step_service.reductions_timed

    @override
    def register_own_comm_hook(self) -> bool:
        hook, service = self._active_comm_hook, self.step_service
        service.plain_reduction = service.reductions_timed = service.flag_carried = False
        timer = service.comm_timer if hook != "powersgd" else None
        if self._register_step_flag(hook, timer):
            return True
        if hook is None and (
            timer is None or compat.lightning_comm_state(self) or compat.ddp_has_comm_hook(self.model)
        ):
            return False  # Lightning registers its ddp_comm_hook, if one was given; or DDP registered its own
        assert isinstance(self.model, DistributedDataParallel)
        wrap = timer.wrap if timer is not None else None
        service.reductions_timed = wrap is not None
        if hook is None:
            assert wrap is not None
            register_timed_allreduce(self.model, wrap)
            service.plain_reduction = True
            return True
        register_comm_hook(
            self.model,
            hook,  # type: ignore[arg-type]
            powersgd_rank=self.powersgd_rank,
            powersgd_warmup_steps=self.powersgd_warmup_steps,
            process_group=self.model.process_group,
            wrap=wrap,
        )
        return True

    def _register_step_flag(self, hook: str | None, timer: CommTimer | None) -> bool:
        """Register the flag-carrying variant of ``hook`` if the step service has a :class:`StepFlag` to carry.

        Not with PowerSGD (its buckets are reduced together, not one by one), a ``ddp_comm_hook`` of Lightning's, a
        hook DDP registered itself, DDP's ``find_unused_parameters`` / ``static_graph``, or parameters DDP reduces by
        an all-reduce of its own (``delay_all_reduce_named_params``): then the service's ``flag_carried`` stays
        ``False`` and the asking callback keeps its own way.
        """
        service, flag = self.step_service, self.step_service.flag
        if not isinstance(flag, StepFlag) or hook == "powersgd" or compat.lightning_comm_state(self):
            return False
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        if compat.ddp_has_comm_hook(model) or model.find_unused_parameters or model.static_graph:
            return False
        if compat.ddp_delayed_params(model):
            return False
        flag.process_group = model.process_group
        wrap = timer.wrap if timer is not None else None
        register_flagged_hook(model, flag, hook or "mean", wrap=wrap)  # type: ignore[arg-type]
        service.reductions_timed = wrap is not None
        service.plain_reduction = hook is None
        service.flag_carried = True
        return True


# passed by Lightning's DDPStrategy itself when it wraps the model
_SET_BY_THE_STRATEGY = ("module", "device_ids")


@functools.cache
def ddp_keyword_arguments() -> frozenset[str]:
    """The names :class:`DDPStrategy`'s ``**kwargs`` may hold.

    The keyword arguments of ``DistributedDataParallel`` (but ``module`` and ``device_ids``, which Lightning passes)
    and of Lightning's ``DDPStrategy`` that this class does not name itself (``ddp_comm_state``, ``ddp_comm_hook``,
    ``ddp_comm_wrapper``, ``model_averaging_period``), read from the installed torch's and Lightning's signatures.
    """

    def names(function: Any) -> set[str]:
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name for p in inspect.signature(function).parameters.values() if p.kind in named} - {"self"}

    own = names(DDPStrategy.__init__)
    ddp_only = names(DistributedDataParallel.__init__) - own - set(_SET_BY_THE_STRATEGY)
    return frozenset(ddp_only | (names(LightningDDPStrategy.__init__) - own))


def _check_ddp_kwargs(strategy: LightningDDPStrategy, kwargs: dict[str, Any]) -> None:
    owner = type(strategy).__name__
    accepted = ddp_keyword_arguments()
    for name in kwargs:
        if name in accepted:
            continue
        if name in _SET_BY_THE_STRATEGY:
            what = "the LightningModule" if name == "module" else "the Trainer's devices"
            raise TypeError(f"{owner}: {name} is set by the strategy from {what}; leave it out")
        own = inspect.signature(type(strategy).__init__).parameters
        candidates = accepted | {n for n, p in own.items() if n != "self" and p.kind is not p.VAR_KEYWORD}
        close = difflib.get_close_matches(name, sorted(candidates), n=1)
        raise TypeError(
            f"{owner}: unexpected keyword argument {name!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + "; further keyword arguments go to torch.nn.parallel.DistributedDataParallel or Lightning's DDPStrategy:"
            f" {', '.join(sorted(accepted))}"
        )
