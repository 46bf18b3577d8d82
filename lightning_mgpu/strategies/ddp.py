"""Lightning's DDP with its options as plain values, synchronized BatchNorm on any backend and named comm hooks."""

import difflib
import functools
import inspect
import time
from datetime import timedelta
from typing import Any, Literal, TypeAlias, get_args

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu.strategies.bucket_tuning import (
    MIN_TIMED_STEPS,
    PAYBACK_FACTOR,
    SETTLE_STEPS,
    WARMUP_STEPS,
    BucketTuner,
    BucketTuningResult,
    Trial,
    bucket_candidates,
)
from lightning_mgpu.strategies.choice import StrategyChoice
from lightning_mgpu.strategies.preemption import SigtermAgreement
from lightning_mgpu.strategies.sync_batchnorm import DeviceAgnosticSyncBatchNorm
from lightning_mgpu.utilities.comm_hooks import COMM_HOOK_NAMES, CommHookName, register_comm_hook
from lightning_mgpu.utilities.distributed_batchnorm import has_batchnorm
from lightning_mgpu.utilities.validation import check_bool, check_choice, check_int, check_positive

SyncBatchNormSetting: TypeAlias = bool | Literal["auto"]
StartMethod: TypeAlias = Literal["popen", "spawn", "fork", "forkserver"]
BucketCapSetting: TypeAlias = float | Literal["auto"] | None
CommHookSetting: TypeAlias = CommHookName | Literal["auto"] | None
TunableCommHook: TypeAlias = Literal["fp16", "bf16"]

TUNABLE_COMM_HOOKS: tuple[str, ...] = ("fp16", "bf16")
# the key under which the tuning result travels in a Lightning checkpoint
BUCKET_TUNING_CHECKPOINT_KEY = "lightning_mgpu_bucket_tuning"
# the smallest budget that times two settings with MIN_TIMED_STEPS each
MIN_BUCKET_TUNING_STEPS = WARMUP_STEPS + 2 * (SETTLE_STEPS + MIN_TIMED_STEPS)
# how DistributedDataParallel's error for parameters that got no gradient begins (the text Lightning matches too)
_UNUSED_PARAMETERS_ERROR = "Expected to have finished reduction in the prior iteration"


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

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        sync_batchnorm: ``True``, ``False`` or ``"auto"``.
        bucket_cap_mb: DDP gradient bucket size in MB; ``None`` keeps torch's default (25); ``"auto"`` times
            candidate sizes on the first training steps and keeps the fastest.
        bucket_tuning_steps: at most this many optimizer steps are spent timing ``"auto"`` settings (at least 10).
        gradient_as_bucket_view: let gradients be views into the DDP buckets (saves one copy and memory).
        static_graph: promise DDP the set of used parameters never changes between steps.
        find_unused_parameters: let DDP detect parameters that got no gradient in a step (costs a graph walk).
        broadcast_buffers: ``False`` stops DDP copying rank 0's buffers (BatchNorm running statistics...) to every
            rank, at the start and before each forward: for buffers kept per rank on purpose. ``None`` leaves torch's
            default (copied). torch 2.13 deprecates it for ``forward_sync_buffers`` (a keyword argument here), which
            still copies them once at the start.
        comm_hook: ``None``, ``"fp16"``, ``"bf16"``, ``"powersgd"`` or ``"auto"`` (time ``comm_hook_candidates``).
        comm_hook_candidates: the hooks ``comm_hook="auto"`` may choose, from ``"fp16"`` and ``"bf16"``; ``None``
            allows both. Only with ``comm_hook="auto"``.
        powersgd_rank: rank of the PowerSGD low-rank approximation.
        powersgd_warmup_steps: optimizer steps of exact all-reduce before PowerSGD starts compressing.
        start_method: how processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``
            or ``"forkserver"``.
        timeout: process group timeout.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device.
        **kwargs: any further keyword argument of ``torch.nn.parallel.DistributedDataParallel``, or of Lightning's
            ``DDPStrategy`` (``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper``, ``model_averaging_period``).
            From a LightningCLI YAML config they go under ``dict_kwargs:`` next to ``init_args:``.

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
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        _check_ddp_kwargs(self, kwargs)
        check_choice(owner, "sync_batchnorm", sync_batchnorm, (True, False, "auto"))
        if bucket_cap_mb is not None and bucket_cap_mb != "auto":
            check_positive(
                owner,
                "bucket_cap_mb",
                bucket_cap_mb,
                unit="MB",
                hint="use None for torch's default (25) or 'auto' to time sizes on the first steps",
            )
        check_int(owner, "bucket_tuning_steps", bucket_tuning_steps, minimum=MIN_BUCKET_TUNING_STEPS)
        check_bool(owner, "gradient_as_bucket_view", gradient_as_bucket_view)
        check_bool(owner, "static_graph", static_graph)
        check_bool(owner, "find_unused_parameters", find_unused_parameters)
        check_bool(owner, "broadcast_buffers", broadcast_buffers, allow_none=True)
        check_choice(owner, "comm_hook", comm_hook, (None, "auto", *COMM_HOOK_NAMES))
        hook_candidates = _check_comm_hook_candidates(owner, comm_hook, comm_hook_candidates, kwargs)
        check_int(owner, "powersgd_rank", powersgd_rank, minimum=1)
        check_int(owner, "powersgd_warmup_steps", powersgd_warmup_steps, minimum=0)
        check_choice(owner, "start_method", start_method, get_args(StartMethod))
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
        self.bucket_cap_mb = bucket_cap_mb
        self._configured_bucket_cap = ddp_kwargs.get("bucket_cap_mb")
        self.bucket_tuning_steps = bucket_tuning_steps
        self.comm_hook = comm_hook
        self.comm_hook_candidates = hook_candidates
        # what bucket_cap_mb="auto" / comm_hook="auto" settled on; None until the first training batch
        self.bucket_tuning: BucketTuningResult | None = None
        self._tuner: BucketTuner | None = None
        self._tuning_step: int | None = None  # the global step the tuner last saw
        self._tuning_marker: tuple[int, int] | None = None  # (epoch, validation runs) when that step started
        self._tuning_disabled_reason: str | None = None
        self._sync_batchnorm_declined: str | None = None
        self._restored_tuning: BucketTuningResult | None = None
        self._active_comm_hook: str | None = None if comm_hook == "auto" else comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_warmup_steps = powersgd_warmup_steps
        self.choice: StrategyChoice | None = None
        self._sigterm_agreement: SigtermAgreement | None = None

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """A copy of the keyword arguments ``DistributedDataParallel`` is built with (the bucket size in use)."""
        return dict(self._ddp_kwargs)

    @property
    def tunes_buckets(self) -> bool:
        """Whether ``bucket_cap_mb`` or ``comm_hook`` is ``"auto"``."""
        return self.bucket_cap_mb == "auto" or self.comm_hook == "auto"

    def disable_bucket_tuning(self, reason: str) -> None:
        """Keep the configured (or torch's default) bucket size and hook untimed for the next fit.

        For callbacks that reduce gradients themselves, outside DDP's buckets, where timing buckets means nothing.

        Args:
            reason: why, for the log line and :attr:`bucket_tuning`.
        """
        self._tuning_disabled_reason = reason

    def decline_auto_sync_batchnorm(self, reason: str) -> None:
        """Leave BatchNorm local for the next fit when ``sync_batchnorm="auto"``; an explicit ``True`` is kept.

        For callbacks that run a different number of forward passes on each rank (a synchronized BatchNorm would
        then call its collective a different number of times and hang). Call it before the strategy's ``setup``,
        from a callback's ``setup`` hook.

        Args:
            reason: why, for the log line.
        """
        self._sync_batchnorm_declined = reason

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self._layer_sync = self._choose_layer_sync()
        self._tuner, self._tuning_step, self._tuning_marker = None, None, None
        restored, self._restored_tuning = self._restored_tuning, None
        if self.tunes_buckets and trainer.state.fn == TrainerFn.FITTING:
            # a fit starts from the configured setting, whatever trial an earlier fit on this strategy stopped in
            self.bucket_tuning = None
            self._set_bucket_cap(self._configured_bucket_cap)
            self._active_comm_hook = None if self.comm_hook == "auto" else self.comm_hook
            if restored is not None:
                self._apply_restored_tuning(restored)  # before DDP wraps the model: it wraps once, with this
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
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.uninstall()
            self._sigterm_agreement = None
        self._tuner = None
        self._tuning_disabled_reason = None
        super().teardown()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.at_train_batch_start()
        if not self.tunes_buckets or (self.bucket_tuning is not None and self._tuner is None):
            return
        trainer = self.lightning_module.trainer
        if trainer.global_step == self._tuning_step:
            return  # the same optimizer step, accumulating
        self._tuning_step = trainer.global_step
        if self.bucket_tuning is None and self._tuner is None:
            self._start_tuning(trainer)
        if self._tuner is not None:
            self._tuning_step_started(trainer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.bucket_tuning is not None and self.bucket_tuning.tuned:
            checkpoint[BUCKET_TUNING_CHECKPOINT_KEY] = self.bucket_tuning.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # forwards whatever this Lightning's signature takes: `weights_only` arrived in 2.6
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = checkpoint.get(BUCKET_TUNING_CHECKPOINT_KEY)
        self._restored_tuning = BucketTuningResult.restored(state) if isinstance(state, dict) else None
        return checkpoint

    # ------------------------------------------------------------------------------------ bucket_cap_mb="auto"
    def _apply_restored_tuning(self, restored: BucketTuningResult) -> None:
        fixed_hook = None if self.comm_hook == "auto" else self.comm_hook
        matches = (
            restored.world_size == self.world_size
            and (self.comm_hook == "auto" or restored.comm_hook == fixed_hook)
            and (self.bucket_cap_mb == "auto" or restored.bucket_cap_mb == self._configured_bucket_cap)
        )
        if not matches:
            rank_zero_info(
                f"{type(self).__name__}: the checkpoint's tuned DDP setting ({restored.world_size} processes, "
                f"{Trial(restored.bucket_cap_mb, restored.comm_hook).label}) was not taken with this run's processes "
                "and fixed settings; tuning again."
            )
            return
        if self.bucket_cap_mb == "auto":
            self._set_bucket_cap(restored.bucket_cap_mb)
        if self.comm_hook == "auto":
            self._active_comm_hook = restored.comm_hook
        self.bucket_tuning = restored
        rank_zero_info(f"{type(self).__name__}: tuned DDP setting {restored.summary()}.")

    def _tuning_skip_reason(self, trainer: "pl.Trainer", bucket_sizes: list[float | None]) -> str | None:
        if self._tuning_disabled_reason is not None:
            return self._tuning_disabled_reason
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(self.model, DistributedDataParallel):
            return "not fitting with DDP"
        if self.comm_hook == "powersgd":
            return "comm_hook='powersgd' keeps error feedback per bucket, which a re-wrap would lose"
        if self._ddp_comm_hook is not None or self._ddp_comm_state is not None or self._model_averaging_period:
            return "a ddp_comm_hook, ddp_comm_state or model averaging set through Lightning keeps state per bucket"
        if self.world_size < 2:
            return "one process: no gradients are communicated"
        steps_left = trainer.estimated_stepping_batches - trainer.global_step
        if steps_left < PAYBACK_FACTOR * self.bucket_tuning_steps:
            return (
                f"the fit has {steps_left:g} optimizer steps left, fewer than {PAYBACK_FACTOR} x "
                f"bucket_tuning_steps ({self.bucket_tuning_steps}) needed to pay tuning back"
            )
        if len(bucket_sizes) == 1 and not (self.comm_hook == "auto" and self.comm_hook_candidates):
            return "one bucket holds every gradient whatever the size: nothing to choose"
        return None

    def _start_tuning(self, trainer: "pl.Trainer") -> None:
        fixed_hook = None if self.comm_hook == "auto" else self.comm_hook
        current_size = self._ddp_kwargs.get("bucket_cap_mb")
        if self.bucket_cap_mb == "auto":
            trainable = (p for p in self.lightning_module.parameters() if p.requires_grad)
            bucket_sizes = bucket_candidates(sum(p.numel() * p.element_size() for p in trainable) / 2**20)
        else:
            bucket_sizes = [current_size]
        hooks = list(self.comm_hook_candidates) if self.comm_hook == "auto" else []
        reason = self._tuning_skip_reason(trainer, bucket_sizes)
        if self.world_size > 1:
            # ranks may see different loader lengths: rank 0's view decides, or some ranks would tune alone
            reason, bucket_sizes = self.broadcast((reason, bucket_sizes), src=0)
        if reason is not None:
            self.bucket_tuning = BucketTuningResult(
                current_size, self._active_comm_hook, reason, world_size=self.world_size
            )
            rank_zero_info(f"{type(self).__name__}: bucket tuning {self.bucket_tuning.summary()}.")
            return
        self._tuner = BucketTuner(bucket_sizes, hooks, fixed_hook, self.bucket_tuning_steps, self.world_size)
        if self._tuner.current != Trial(current_size, self._active_comm_hook):
            self._rewrap_ddp(self._tuner.current)

    def _tuning_step_started(self, trainer: "pl.Trainer") -> None:
        tuner = self._tuner
        assert tuner is not None
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)  # time the GPU's work, not how fast the host queued it
        now = time.perf_counter()
        # a step that also ran validation or ended an epoch is not timed
        marker = (trainer.current_epoch, trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed)
        discard, self._tuning_marker = marker != self._tuning_marker, marker
        switch = tuner.step_started(now, discard=discard)
        if tuner.needs_decision:
            # rank 0's timings decide on every rank: one broadcast, at the same step everywhere
            switch = tuner.decide(self.broadcast(tuner.timings(), src=0), now)
        if switch is not None:
            self._rewrap_ddp(switch)
        if tuner.result is not None:
            self._tuner = None
            self.bucket_tuning = tuner.result
            self._log_tuning(trainer, tuner.result)

    def _rewrap_ddp(self, trial: Trial) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        module = self.model.module
        self.model = module  # the old wrapper's buckets are freed before the new ones are allocated
        kept_kwargs = self._ddp_kwargs
        self._ddp_kwargs = dict(kept_kwargs, init_sync=False)  # the parameters are equal on every rank already
        self._set_bucket_cap(trial.bucket_cap_mb)
        try:
            self.model = self._setup_model(module)
        except BaseException:
            self._ddp_kwargs = kept_kwargs  # the fit is failing: leave the settings as they were
            raise
        self._ddp_kwargs.pop("init_sync")
        self._active_comm_hook = trial.comm_hook
        self._register_ddp_hooks()
        # Lightning flushes a static graph's first all-reduce once per strategy under manual optimization
        self._pl_static_graph_delay_done = False
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)  # gradients copied into the new buckets on the wrap's stream

    def _set_bucket_cap(self, bucket_cap_mb: float | None) -> None:
        if bucket_cap_mb is None:
            self._ddp_kwargs.pop("bucket_cap_mb", None)
        else:
            self._ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    def _log_tuning(self, trainer: "pl.Trainer", result: BucketTuningResult) -> None:
        rank_zero_info(f"{type(self).__name__}: bucket tuning {result.summary()}.")
        metrics = {
            "ddp/bucket_cap_mb": result.effective_bucket_cap_mb,
            "ddp/bucket_tuning_seconds": result.tuning_seconds,
            "ddp/bucket_tuning_speedup": result.speedup or 1.0,
        }
        metrics.update({f"ddp/bucket_trial_ms/{label}": ms for label, ms in result.step_ms.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _choose_layer_sync(self) -> LayerSync | None:
        trainer_plugin = self._layer_sync  # the Trainer's: TorchSyncBatchNorm for Trainer(sync_batchnorm=True)
        if trainer_plugin is not None and not isinstance(trainer_plugin, TorchSyncBatchNorm):
            return trainer_plugin  # a LayerSync of the user's own choosing
        wanted = True if trainer_plugin is not None else self.sync_batchnorm
        declined, self._sync_batchnorm_declined = self._sync_batchnorm_declined, None
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

    @override
    def _register_ddp_hooks(self) -> None:
        if self._active_comm_hook is None:
            super()._register_ddp_hooks()
            return
        assert isinstance(self.model, DistributedDataParallel)
        register_comm_hook(
            self.model,
            self._active_comm_hook,  # type: ignore[arg-type]
            powersgd_rank=self.powersgd_rank,
            powersgd_warmup_steps=self.powersgd_warmup_steps,
        )


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


def _check_comm_hook_candidates(owner: str, comm_hook: Any, candidates: Any, ddp_kwargs: dict) -> tuple[str, ...]:
    allowed = ", ".join(map(repr, TUNABLE_COMM_HOOKS))
    if comm_hook != "auto":
        if candidates is not None:
            raise ValueError(
                f"{owner}: comm_hook_candidates={candidates!r} only applies with comm_hook='auto', got "
                f"comm_hook={comm_hook!r}"
            )
        return ()
    if ddp_kwargs.get("ddp_comm_hook") is not None:
        raise ValueError(f"{owner}: comm_hook='auto' chooses the hook itself; drop ddp_comm_hook or name a comm_hook")
    if candidates is None:
        return TUNABLE_COMM_HOOKS
    if isinstance(candidates, str) or not isinstance(candidates, (list, tuple)) or not candidates:
        raise TypeError(
            f"{owner}: comm_hook_candidates must be a non-empty list of hook names from {allowed}, got {candidates!r}"
        )
    for name in candidates:
        if name in TUNABLE_COMM_HOOKS:
            continue
        message = f"{owner}: comm_hook_candidates may hold {allowed}, got {name!r}"
        if name == "powersgd":
            message += (
                " (its warm-up steps are exact all-reduces, so a short trial cannot time it); use comm_hook='powersgd'"
                " to choose it yourself"
            )
        raise ValueError(message)
    return tuple(dict.fromkeys(candidates))
