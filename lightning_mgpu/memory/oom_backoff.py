"""Recover from out-of-memory errors in the middle of ``fit``: back the micro-batch off and keep training."""

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.modules.batchnorm import SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core._logging import has_progress_bar, show_in_progress_bar
from lightning_mgpu.core.batch_split import batch_size_of, split_batch
from lightning_mgpu.core.distributed_batchnorm import DistributedBatchNorm
from lightning_mgpu.core.step_pieces import LogCall, capture_logs, merge_outputs, replay_logs
from lightning_mgpu.core.step_service import StepService, step_service
from lightning_mgpu.core.training_events import EventLog, RecordsEvents
from lightning_mgpu.core.validation import check_bool, check_choice, check_int, check_str
from lightning_mgpu.ddp.step_flag import StepFlag
from lightning_mgpu.memory.micro_batch_policy import MicroBatchSizePolicy
from lightning_mgpu.memory.oom import is_out_of_memory, memory_summary, release_memory
from lightning_mgpu.memory.oom_agreement import OOMRecoveryError
from lightning_mgpu.memory.oom_training import BackoffOptimization, MicroBatchTrainer
from lightning_mgpu.memory.step_rollback import StepRollback

LossReduction = Literal["mean", "sum"]
LOSS_REDUCTIONS: tuple[str, ...] = get_args(LossReduction)
__all__ = ["OOMBackoff", "OOMRecoveryError"]


class OOMBackoff(RecordsEvents, Callback):
    """Recover from out-of-memory errors during ``fit``: retry the batch in smaller micro-batches, on every rank.

    When a training step runs out of memory, the memory is released (the failed attempt's activations are freed
    with the exception's frames, then the allocator's cached blocks) and the same batch is run again as smaller
    micro-batches whose gradients are accumulated. The samples, the effective batch size and the number of
    optimizer steps do not change, so the optimization is the one asked for, up to float rounding (BatchNorm layers
    do see smaller batches, as with any gradient accumulation). Later batches use the micro-batch size that worked.
    The loss is taken to be a mean over the batch's samples (``loss_reduction="sum"`` for a sum).

    Detection is by exception type (``torch.OutOfMemoryError``), then by the messages of the allocation failures
    torch raises as ``RuntimeError`` (CUDA, HIP, cuDNN, cuBLAS, the CPU allocator). Errors that leave the CUDA
    context unusable (an illegal memory access) and every other error propagate unchanged.

    **Distributed.** While no OOM happens, a batch that runs whole (one batch per optimizer step) runs in
    Lightning's own closure, DDP's all-reduce overlapping the backward, with no collective of this callback's: the
    strategy carries a failure flag in the last gradient bucket
    (:class:`~lightning_mgpu.ddp.step_flag.StepFlag`). A rank whose forward or backward runs out of memory
    finishes the step's all-reduce with zeros and the flag set (with synchronized BatchNorm, after issuing the
    layers' remaining collectives from a one-sample replay of ``training_step``); no rank steps, every rank undoes
    the attempt and runs the batch again in micro-batches. On a GPU the flag is read once per step after the
    backward (a synchronisation). The batches of an ``accumulate_grad_batches`` window run whole too (under DDP,
    without synchronized BatchNorm): those before the last under ``no_sync()``, a rank that fails there redoing
    the batch in micro-batches on its own (no collective is in flight) and raising the flag at the window's last
    batch; the last batch with DDP's overlapped all-reduce, the earlier batches' gradients set aside and added into
    the buckets by the flag's hook, so that after a failure every rank goes back to them and redoes only the last
    batch. Micro-batches run under DDP's ``no_sync()``; the ranks then agree through one small all-reduce on the
    host (a gloo side group under NCCL) and the gradients are averaged once, in buckets.
    Every rank adopts the same smaller micro-batch. A rank whose own attempt succeeded keeps it (with synchronized
    BatchNorm every rank starts the batch over, so that all run the same micro-batches). Where the flag cannot ride
    (PowerSGD, a Lightning ``ddp_comm_hook``, ``find_unused_parameters``, ``static_graph``) every batch takes the
    micro-batch path, without DDP's overlap and communication hooks (a warning says so if a hook is registered; an
    fp16/bf16 reduction that carries the flag is likewise bypassed after a backoff, and gradients are then averaged
    in full precision).

    **What cannot be recovered fails on every rank at once.** An OOM at ``min_micro_batch_size`` (or on a batch
    with no tensor to split) raises :class:`OOMRecoveryError` with a memory summary. An OOM inside
    ``optimizer.step`` (some ranks may have updated their parameters, others not) raises
    :class:`OOMRecoveryError` on every rank at the next point where they all meet: the next batch, the start of
    validation, a checkpoint save (so nothing inconsistent is written) or the end of training. Until then the rank
    that failed follows the others' control flow exactly, so their collectives keep matching (an error in a hook
    after the backward, once every gradient bucket was sent, is handled the same way). An error that is not an OOM
    is re-raised on its rank and the other ranks stop with :class:`OOMRecoveryError`, instead of waiting out the
    collective timeout. Three cases end with the other ranks stopped at their next collective (at once on gloo,
    through the strategy's hang watchdog or the process group's timeout on NCCL) instead: an error before DDP's
    forward started; with synchronized BatchNorm, an error that its one-sample replay of ``training_step`` raises
    again; and an error, or an OOM at ``min_micro_batch_size``, in an accumulation window's batch before its last
    on the whole-batch path.

    **Memory:** while a batch accumulates over several micro-batches (and on the later batches of an
    ``accumulate_grad_batches`` window, whole or not) the gradients gathered so far are set aside during each
    backward, so that a backward that fails half-way can be undone: gradient memory is twice the parameters' for
    that time (three
    times on the later batches of a window with synchronized BatchNorm, whose batch's own gradients are kept apart
    too, so every rank can start the batch over).

    **Side effects of a failed attempt are undone**: BatchNorm running statistics and the states of torchmetrics
    metrics that are submodules are restored, and ``self.log`` calls are held back and logged once per batch (a
    mean weighted by the micro-batches' samples; ``reduce_fx`` ``"sum"``/``"max"``/``"min"`` honoured). State kept
    elsewhere (a Python counter) sees the failed attempt's samples again: on the rank that ran out of memory, and,
    after a failure on the whole-batch path, on every rank (each runs the batch again).

    **Validation, test, predict**: an OOM splits the batch; the outputs are concatenated (scalars averaged by
    samples) and the logged values combined, so metrics and predictions are unchanged. The evaluation micro-batch
    size is separate from the training one.

    Requirements: automatic optimization; single device, DataParallel or DDP; a ``training_step`` without
    collectives of its own other than the strategy's synchronized BatchNorm (torch's ``SyncBatchNorm`` is refused:
    its collectives cannot be replayed), with the same batch size on every rank when BatchNorm is synchronized; and
    none of DDP's ``delay_all_reduce_named_params`` (an all-reduce of DDP's own on every backward, ``no_sync()`` or
    not, which a rank that fails or backs off alone would leave unmatched) or ``mixed_precision`` (its full-precision
    parameters come back only in DDP's own hook, which micro-batches skip): both refused when the fit starts.

    Logged keys, on the steps Lightning's loggers write: ``oom/micro_batch_size`` (samples; the batch size until the
    first backoff) and ``oom/recoveries`` (count since the start of training). One line is printed on rank 0 for
    each backoff. The micro-batch size and counters are saved in checkpoints and used after resuming.

    Progress bar field, with ``progress_bar=True`` and a Trainer that draws a bar: ``micro_bs``, the training
    micro-batch size in use (samples): the batch size (the largest batch of the fit so far, so a short last batch
    does not count) until the first backoff, then the backed-off size, and the batch size again if a probe climbs
    back to it. Shown from the end of the first training batch, and refreshed at the end of the batch where it
    changes only: a host-side number, no device read. It is not sent to the loggers.

    The sizes are chosen by a :class:`~lightning_mgpu.memory.micro_batch_policy.MicroBatchSizePolicy`
    (:attr:`policy`); this callback wires it into the Trainer.

    Args:
        min_micro_batch_size: the smallest micro-batch to back off to; an OOM at this size is not recovered.
        keep_effective_batch: ``True`` keeps the batch the optimizer sees through accumulation. ``False`` instead
            reduces the batch size itself from the next epoch on (the rest of the current epoch accumulates, so no
            sample is lost): the model's or datamodule's ``batch_arg_name`` attribute is set and the train
            dataloader rebuilt. This changes the optimization: more, noisier optimizer steps per epoch; scale the
            learning rate (linearly with the batch size is the usual rule) and note that step-based schedules
            stretch.
        probe_up_after: after this many batches without an OOM, try twice the micro-batch size (up to the whole
            batch); a failed probe goes back to the size that worked and doubles the wait. ``None`` never probes.
        batch_arg_name: the attribute holding the loader's batch size, for ``keep_effective_batch=False``.
        loss_reduction: ``"mean"`` if the loss is a mean over the batch's samples, ``"sum"`` if it is a sum.
        recover_eval: also split validation, test and predict batches that run out of memory.
        progress_bar: show ``micro_bs`` in the progress bar.

    Raises:
        TypeError: a ``min_micro_batch_size`` or ``probe_up_after`` that is not an int, a ``keep_effective_batch``,
            ``recover_eval`` or ``progress_bar`` that is not a bool, a ``loss_reduction`` or ``batch_arg_name``
            that is not a string.
        ValueError: a ``min_micro_batch_size`` or ``probe_up_after`` below 1 (or a ``probe_up_after`` given with
            ``keep_effective_batch=False``), an unknown ``loss_reduction`` or an empty ``batch_arg_name``.
        OOMRecoveryError: as above.

    Example::

        trainer = Trainer(strategy="mgpu", callbacks=[OOMBackoff(min_micro_batch_size=2)])
    """

    def __init__(
        self,
        min_micro_batch_size: int = 1,
        keep_effective_batch: bool = True,
        probe_up_after: int | None = None,
        batch_arg_name: str = "batch_size",
        loss_reduction: LossReduction = "mean",
        recover_eval: bool = True,
        progress_bar: bool = True,
    ) -> None:
        name = type(self).__name__
        check_int(name, "min_micro_batch_size", min_micro_batch_size, minimum=1, hint="it counts samples")
        check_bool(name, "keep_effective_batch", keep_effective_batch)
        check_int(
            name, "probe_up_after", probe_up_after, minimum=1, allow_none=True, hint="use None to never probe back up"
        )
        if probe_up_after is not None and not keep_effective_batch:
            raise ValueError(
                f"{name}: probe_up_after={probe_up_after} needs keep_effective_batch=True; with False the batch size"
                " itself is reduced and is not probed back up"
            )
        check_choice(name, "loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        check_str(name, "batch_arg_name", batch_arg_name, what="a non-empty attribute name")
        check_bool(name, "recover_eval", recover_eval)
        check_bool(name, "progress_bar", progress_bar)
        self.policy = MicroBatchSizePolicy(min_micro_batch_size, probe_up_after)
        self.keep_effective_batch = keep_effective_batch
        self.batch_arg_name = batch_arg_name
        self.loss_reduction = loss_reduction
        self.recover_eval = recover_eval
        self.progress_bar = progress_bar

        self._loader_batch_size: int | None = None
        self._runner: MicroBatchTrainer | None = None
        self._loop: BackoffOptimization | None = None
        self._trainer: pl.Trainer | None = None
        self._service: StepService | None = None  # the fit's, asked at setup to carry the flag
        self._eval_route: Callable[[], None] | None = None  # undoes the routing of an evaluation loop's steps
        self._eval_rollback: StepRollback | None = None
        self._largest_batch = 0  # this fit's, for the progress bar: a short last batch is no smaller micro-batch
        self._bar_on = False
        self._bar_shown: int | None = None
        self.events = EventLog()  # each backoff, for GPUMemoryMonitor's timeline

    # ------------------------------------------------------------------------------ the policy's numbers
    @property
    def min_micro_batch_size(self) -> int:
        """The smallest micro-batch to back off to, in samples."""
        return self.policy.min_size

    @property
    def probe_up_after(self) -> int | None:
        """Batches without an out-of-memory error before a probe upwards; ``None`` never probes."""
        return self.policy.probe_up_after

    @property
    def micro_batch_size(self) -> int | None:
        """The training micro-batch size in use, in samples; ``None`` while whole batches run."""
        return self.policy.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, size: int | None) -> None:
        # settable as before the policy was split out: None goes back to whole batches
        self.policy.micro_batch_size = size

    @property
    def eval_micro_batch_size(self) -> int | None:
        """The evaluation micro-batch size in use, in samples; ``None`` while whole batches run."""
        return self.policy.eval_micro_batch_size

    @property
    def recoveries(self) -> int:
        """Training backoffs since the start of training (failed probes not counted)."""
        return self.policy.recoveries

    @property
    def last_batch_size(self) -> int:
        """The size of the last training batch, in samples."""
        return self.policy.last_batch_size

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        self._stop_eval_routing()  # one an earlier trainer left, if its loop ended without our end hooks
        self._trainer = trainer
        self._refuse_sharding(trainer)
        if stage == "fit" and not pl_module.automatic_optimization:
            raise MisconfigurationException(
                f"{type(self).__name__} needs automatic optimization: with `automatic_optimization = False` the"
                " training_step runs backward and the optimizer itself, so it cannot be split into micro-batches."
                " Remove the callback or use automatic optimization."
            )
        if not self.keep_effective_batch and stage == "fit" and not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"{type(self).__name__}(keep_effective_batch=False) sets the loader's batch size through the attribute"
                f" batch_arg_name={self.batch_arg_name!r}, which neither the model, its hparams nor the datamodule"
                " has. Add it (and use it in the train dataloader) or pass the attribute's name."
            )
        if stage == "fit" and isinstance(trainer.strategy, LightningDDPStrategy):
            # before DDP wraps the model (which broadcasts): the options this callback cannot run with
            kwargs = compat.ddp_kwargs(trainer.strategy)
            self._refuse_ddp_options(
                kwargs.get("delay_all_reduce_named_params") is not None, kwargs.get("mixed_precision")
            )
        self._service = step_service(trainer)
        if stage == "fit" and self._service.reads_requests:
            # before the model is wrapped: a rank that runs out of memory tells the others in the gradient all-reduce
            # (one bit, in the last bucket itself; in this callback's own steps the loss's gradient is scaled instead
            # of each bucket divided)
            self._service.carry_flag(StepFlag(slots=1, in_place=True))
        self._eval_rollback = None  # built at the first evaluation step, after configure_model and the device move

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._check_strategy(trainer, pl_module)
        service = step_service(trainer)  # the FSDP strategy's, if a memory plan switched to it: then it reads nothing
        if service.reads_requests and not service.flag_carried:
            # bucket sizes and hooks change nothing while this callback averages the gradients itself
            service.keep_buckets_untimed(f"{type(self).__name__} averages gradients outside DDP's buckets")
        if self._loader_batch_size is not None:
            # restored from a checkpoint of a run whose batch size was reduced: the loader is built after this hook
            lightning_setattr(pl_module, self.batch_arg_name, self._loader_batch_size)
        self._largest_batch = 0
        self._runner = MicroBatchTrainer(trainer, self.policy, self, self.loss_reduction)
        epoch_loop = trainer.fit_loop.epoch_loop
        self._loop = BackoffOptimization(trainer, self._runner, epoch_loop.automatic_optimization)
        epoch_loop.automatic_optimization = self._loop

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Lightning empties the progress bar's metrics before this (and after the sanity check): show it again
        self._bar_on = self.progress_bar and has_progress_bar(trainer)
        self._bar_shown = None

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._restore(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning skips teardown when fit raises: leave nothing of ours on the trainer
        self._restore(trainer)

    def _restore(self, trainer: "pl.Trainer") -> None:
        if self._loop is not None:
            epoch_loop = trainer.fit_loop.epoch_loop
            if epoch_loop.automatic_optimization is self._loop:
                epoch_loop.automatic_optimization = self._loop.replaced
            self._loop = None
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._service is not None:
            self._service.drop_flag()
            self._service = None
        self._stop_eval_routing()

    # ------------------------------------------------------------------------ points where every rank meets
    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._runner is not None:
            self._runner.check_peers("before validation")
        self._route_eval_steps(trainer, pl_module)

    @override
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict) -> None:
        if self._runner is not None:
            self._runner.check_peers("instead of saving a checkpoint")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._runner is not None:
            self._runner.check_peers("at the end of training")

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the step counter already moved on: ask the logger connector whether this step's metrics are written
        if compat.is_logging_step(trainer):
            size = self.micro_batch_size if self.micro_batch_size is not None else self.last_batch_size
            pl_module.log("oom/micro_batch_size", float(size), on_step=True, on_epoch=False)
            pl_module.log("oom/recoveries", float(self.recoveries), on_step=True, on_epoch=False)
        self._largest_batch = max(self._largest_batch, self.policy.last_batch_size)
        if self._bar_on:
            self._show_micro_batch_size(pl_module)

    def _show_micro_batch_size(self, pl_module: "pl.LightningModule") -> None:
        size = self.micro_batch_size if self.micro_batch_size is not None else self._largest_batch
        if size and size != self._bar_shown:  # a self.log call costs ~0.6 ms: only when the number changes
            self._bar_shown = size
            show_in_progress_bar(pl_module, "micro_bs", size)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.keep_effective_batch or self.micro_batch_size is None:
            return
        if self._loader_batch_size == self.micro_batch_size:
            return
        self._loader_batch_size = self.micro_batch_size
        lightning_setattr(pl_module, self.batch_arg_name, self._loader_batch_size)
        compat.rebuild_train_dataloader(trainer)  # with the new batch size, when the next epoch starts
        rank_zero_info(
            f"{type(self).__name__}: the train dataloader's batch size is now {self._loader_batch_size}"
            f" ({self.batch_arg_name}); optimizer steps see the smaller batch from this epoch on."
        )

    # ---------------------------------------------------------------------------------- checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self.policy.state_dict(), "loader_batch_size": self._loader_batch_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict)
        self._loader_batch_size = state_dict.get("loader_batch_size")

    # ------------------------------------------------------------- what the training runner reports and asks for
    def report_backoff(self, old: int, new: int, oom_rank: int, total: int, probe: bool) -> None:
        """Record and print a training backoff the policy adopted. Called on every rank with the same arguments.

        Args:
            old: the micro-batch size that ran out of memory.
            new: the size adopted.
            oom_rank: the highest-numbered rank that ran out of memory.
            total: the batch's size.
            probe: whether ``old`` was a probe upwards.
        """
        name = type(self).__name__
        step = self._trainer.global_step if self._trainer is not None else 0
        prefix = "failed probe, " if probe else ""
        self.events.record(step, "oom_backoff", f"{prefix}rank {oom_rank}, micro-batch {old} -> {new}")
        if probe:
            rank_zero_info(
                f"{name}: probing micro-batch size {old} ran out of memory on rank {oom_rank} (step {step}); back to"
                f" {new}, next probe after {self.policy.probe_wait} batches."
            )
            return
        per_batch = math.ceil(total / new)
        consequence = (
            "the effective batch size is unchanged"
            if self.keep_effective_batch
            else "the batch size itself becomes this size from the next epoch"
        )
        rank_zero_info(
            f"{name}: rank {oom_rank} ran out of memory at micro-batch size {old} (step {step}, a batch of {total});"
            f" micro-batch size {old} -> {new} ({per_batch} micro-batches per batch); {consequence}."
        )

    def report_probe_success(self, size: int) -> None:
        """Print that a probe upwards to ``size`` samples did not run out of memory."""
        rank_zero_info(
            f"{type(self).__name__}: probed the micro-batch size up to {size} without running out of memory."
        )

    def floor_message(self, rank: int, size: int, total: int, description: str) -> str:
        """The error for rank ``rank`` running out of memory at the smallest micro-batch size."""
        device = self._trainer.strategy.root_device if self._trainer is not None else None
        return (
            f"{type(self).__name__}: rank {rank} ran out of memory with a micro-batch of {size} samples (a batch of"
            f" {total}), and min_micro_batch_size={self.min_micro_batch_size} allows no smaller one.\n"
            f"{description}\n{memory_summary(device)}\n"
            "Lower the memory one sample needs (mixed precision, activation checkpointing, a smaller model or"
            " sequence) or lower min_micro_batch_size."
        )

    def optimizer_step_message(self, rank: int, description: str) -> str:
        """The error for rank ``rank`` running out of memory inside the optimizer step."""
        device = self._trainer.strategy.root_device if self._trainer is not None else None
        step = self._trainer.global_step if self._trainer is not None else 0
        return (
            f"{type(self).__name__}: rank {rank} ran out of memory inside the optimizer step (step {step}), after"
            " its gradients were complete. Smaller micro-batches do not help here: the optimizer's own memory (its"
            " state, such as Adam's moments allocated at the first step) did not fit, and ranks may have updated"
            f" their parameters differently, so every rank stops.\n{description}\n{memory_summary(device)}"
        )

    # ----------------------------------------------------------------------------------------- checks
    def _refuse_sharding(self, trainer: "pl.Trainer") -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy):
            raise MisconfigurationException(
                f"{type(self).__name__} does not run under {type(trainer.strategy).__name__}: FSDP's collectives run"
                " inside every unit's forward and backward, so a rank that fails mid-step cannot drop out of them."
                " Make the step fit instead: MultiGPUStrategy(mode='fsdp', activation_checkpointing='auto'),"
                " sharding='full', cpu_offload=True on GPUs, or a smaller batch with accumulate_grad_batches."
            )

    def _refuse_ddp_options(self, delayed: bool, mixed_precision: Any) -> None:
        """Refuse the DDP options a step run in pieces would get wrong, at any number of processes."""
        name = type(self).__name__
        if delayed:
            # a micro-batch or a failed attempt would issue it on one rank and not another; and, one process too, the
            # gradients set aside between micro-batches are views of DDP's buffer, which its next forward zeroes
            raise MisconfigurationException(
                f"{name} cannot back off a model built with DistributedDataParallel's delay_all_reduce_named_params:"
                " DDP issues an all-reduce of its own on every backward that reaches param_to_hook_all_reduce, under"
                " no_sync() too, which a rank that fails or backs off alone leaves unmatched; and it keeps those"
                " gradients in a buffer that its next forward zeroes, under the gradients set aside between"
                " micro-batches. Leave out delay_all_reduce_named_params and param_to_hook_all_reduce, or remove the"
                " callback."
            )
        if mixed_precision is not None:
            raise MisconfigurationException(
                f"{name} cannot back off a model built with DistributedDataParallel's mixed_precision="
                f"{mixed_precision!r}: DDP puts the full-precision parameters back only in its own communication hook,"
                " which micro-batches under no_sync() never run, so the optimizer would step the low-precision copies."
                " Use the Trainer's precision='bf16-mixed' instead, or remove the callback."
            )

    def _check_strategy(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._refuse_sharding(trainer)  # again: a memory plan may have switched the strategy to FSDP since setup
        name = type(self).__name__
        runner_model = trainer.strategy.model
        if isinstance(runner_model, DistributedDataParallel):  # as wrapped, whatever strategy did it
            self._refuse_ddp_options(
                bool(compat.ddp_delayed_params(runner_model)), getattr(runner_model, "mixed_precision", None)
            )
        if trainer.world_size > 1:
            if not isinstance(runner_model, DistributedDataParallel):
                raise MisconfigurationException(
                    f"{name} supports single-device, DataParallel and DDP training; with {trainer.world_size}"
                    f" processes it needs the model wrapped in DistributedDataParallel, but"
                    f" {type(trainer.strategy).__name__} wraps it in {type(runner_model).__name__}."
                )
            synced = [m for m in pl_module.modules() if isinstance(m, SyncBatchNorm)]
            if synced:
                raise MisconfigurationException(
                    f"{name} cannot back off a model with torch's {type(synced[0]).__name__} under several processes:"
                    " a rank that fails part way through a step cannot finish the collectives its layers leave"
                    f" undone. Use {type(trainer.strategy).__name__}(sync_batchnorm=True), whose"
                    f" {DistributedBatchNorm.__name__} layers {name} can replay, or turn sync_batchnorm off."
                )
            service = step_service(trainer)
            # PerformanceMonitor's timing only, or the hook is DDP's reduction carrying the flag: kept
            if compat.ddp_has_comm_hook(runner_model) and not (service.plain_reduction or service.flag_carried):
                rank_zero_warn(
                    f"{name}: the DDP communication hook registered on the model is bypassed; gradients are averaged"
                    " in full precision after the local backward passes."
                )

    # ------------------------------------------------------------------------------------------- evaluation
    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stop_eval_routing()

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._route_eval_steps(trainer, pl_module)

    @override
    def on_test_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stop_eval_routing()

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._route_eval_steps(trainer, pl_module)

    @override
    def on_predict_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stop_eval_routing()

    def _route_eval_steps(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # around Lightning's dispatch of the step, for this loop only: the strategy and the module keep their own
        # methods, so Lightning's checks of what the user overrode, and DataParallel's replicas (copies of the
        # module), see them as the user wrote them
        if self.recover_eval and self._eval_route is None:
            self._eval_route = compat.route_eval_steps(trainer, functools.partial(self._evaluation_step, pl_module))

    def _stop_eval_routing(self) -> None:
        if self._eval_route is not None:
            self._eval_route()
            self._eval_route = None

    def _evaluation_step(
        self, pl_module: "pl.LightningModule", hook_name: str, run: Callable, batch: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Run the evaluation step ``hook_name`` through ``run``, split into micro-batches after an OOM."""
        try:
            total = batch_size_of(batch)
        except ValueError:
            return run(batch, *args, **kwargs)
        size = self.policy.start_eval_batch(total)
        if self._eval_rollback is None:
            self._eval_rollback = StepRollback(pl_module)
        rollback = self._eval_rollback
        while True:
            pieces = split_batch(batch, size)
            outputs: list[Any] = []
            logs: list[LogCall] = []
            if rollback is not None:
                rollback.save()
            try:
                for piece, samples in pieces:
                    with capture_logs(pl_module, logs, samples):
                        outputs.append(run(piece, *args, **kwargs))
                break
            except Exception as err:
                if rollback is not None:
                    rollback.restore()
                if not is_out_of_memory(err):
                    raise
                smaller = self.policy.eval_back_off(size)
                if smaller is None:
                    device = self._trainer.strategy.root_device if self._trainer is not None else None
                    raise OOMRecoveryError(
                        f"{type(self).__name__}: {hook_name} ran out of memory with a micro-batch of {size} samples,"
                        f" and min_micro_batch_size={self.min_micro_batch_size} allows no smaller one.\n"
                        f"{memory_summary(device)}"
                    ) from err
            # outside the except block: the failed attempt's frames, and the activations they hold, are gone
            del outputs
            release_memory()
            old, size = size, smaller
            step = self._trainer.global_step if self._trainer is not None else 0
            self.events.record(step, "oom_backoff", f"{hook_name}, micro-batch {old} -> {size}")
            rank_zero_info(
                f"{type(self).__name__}: {hook_name} ran out of memory at micro-batch size {old};"
                f" evaluation micro-batch size {old} -> {size} (training's is unchanged)."
            )
        replay_logs(pl_module, logs, hook_name)
        return merge_outputs(outputs, [samples for _, samples in pieces])
