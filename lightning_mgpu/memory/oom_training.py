"""Where :class:`~lightning_mgpu.OOMBackoff` runs a training batch: the recovery's states, from the whole batch on.

Lightning's automatic optimization builds a closure (``training_step``, ``zero_grad``, ``backward``) that the
optimizer calls. An exception escaping it tears the trainer down, so the retry loop replaces that closure: the
epoch loop's ``automatic_optimization`` object is swapped for a subclass whose closure runs the batch through
:class:`MicroBatchTrainer`.

A batch that runs whole (no out-of-memory error yet) takes the whole-batch path
(:mod:`~lightning_mgpu.memory.oom_whole_batch`). If it fails on some rank, or once a backoff was agreed, the batch
goes through the recovery's states, on every rank (:class:`RecoveryState`):

1. ``MICRO_BATCHES``: this rank runs its pending micro-batches, each forward and backward under DDP's
   ``no_sync()``: no gradient collective is in flight while a rank may still run out of memory (the deadlock
   Composer documents for an OOM in the backward).
2. ``AGREE``: the ranks agree through one small all-reduce on the host (:mod:`~lightning_mgpu.memory.oom_agreement`):
   who ran out of memory, the largest micro-batch size that every rank can take, who failed for good. The agreement's
   :class:`~lightning_mgpu.memory.oom_agreement.Outcome` is the next state, the same on every rank.
3. ``BACK_OFF``: every rank adopts the agreed size. A rank whose micro-batches all succeeded keeps them; only the
   rank that failed recomputes the samples it had not finished, in smaller micro-batches (back to 1).
4. ``FINISH``: the gradients are averaged across ranks once, in buckets, as DDP would have done during the backward.

The sizes come from a :class:`~lightning_mgpu.memory.micro_batch_policy.MicroBatchSizePolicy`, told only what
every rank agreed on; the callback prints, records and words the errors
(:class:`~lightning_mgpu.memory.oom_agreement.BackoffReporter`).
"""

import dataclasses
import enum
import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.batch_split import batch_size_of, slice_batch, split_batch
from lightning_mgpu.core.host_group import host_side_group
from lightning_mgpu.core.step_pieces import replay_logs
from lightning_mgpu.ddp.step_flag import bucket_params
from lightning_mgpu.memory.grad_allreduce import DEFAULT_BUCKET_BYTES, average_gradients
from lightning_mgpu.memory.micro_batch_policy import MicroBatchSizePolicy
from lightning_mgpu.memory.oom import is_out_of_memory, release_memory
from lightning_mgpu.memory.oom_agreement import (
    NO_PROPOSAL,
    Agreement,
    BackoffReporter,
    FailureKind,
    LocalFailure,
    OOMRecoveryError,
    Outcome,
    Proposal,
    RankAgreement,
    first_line,
)
from lightning_mgpu.memory.oom_pieces import (
    BatchRunner,
    Piece,
    TrainingStepLoop,
    closure_result,
    merge_stashed_grads,
    stash_grads,
)
from lightning_mgpu.memory.oom_whole_batch import WholeBatchPath


class RecoveryState(enum.Enum):
    """Where a batch is in the recovery; :meth:`MicroBatchTrainer.recover` moves it from one to the next."""

    MICRO_BATCHES = "this rank runs its pending micro-batches"
    AGREE = "the ranks agree on the round: an Outcome, the same on every rank"
    BACK_OFF = "every rank adopts the agreed micro-batch size"
    FINISH = "the batch is done: its logs replayed, its gradients averaged once"


# after an agreement (Outcome.STOP raises on every rank)
_NEXT_STATE = {
    Outcome.BACK_OFF: RecoveryState.BACK_OFF,
    Outcome.RESUME: RecoveryState.MICRO_BATCHES,
    Outcome.FINISH: RecoveryState.FINISH,
}


@dataclass(eq=False)
class RecoveringBatch:
    """One training batch in recovery on this rank: what ran, what is left, and at what micro-batch size.

    Attributes:
        kwargs: the training step's arguments, the batch among them.
        total: the batch's samples (1 for a batch without a tensor to split).
        splittable: whether the batch has a tensor with a batch dimension.
        size: the micro-batch size in use.
        reduce_now: the gradients are averaged across ranks at the end of this batch (DDP, last of its window).
        backward_fn: Lightning's backward closure (``None``: no backward).
        pending: the micro-batches left to run, each with its samples.
        carried: the failure of the whole-batch attempt, told in the first agreement.
        size_hint: the size this rank backed off to alone, earlier in the window, proposed in the first agreement.
        notice_only: that backoff is all this rank has to tell (its own attempt at this batch was a slice that fits).
        done: the micro-batches that succeeded, in order.
        set_aside: the window's earlier gradients, set aside while every rank starts the batch over (synchronized
            BatchNorm).
    """

    kwargs: OrderedDict
    total: int
    splittable: bool
    size: int
    reduce_now: bool
    backward_fn: Any
    pending: list[tuple[Any, int]]
    carried: LocalFailure | None = None
    size_hint: int | None = None
    notice_only: bool = False
    done: list[Piece] = field(default_factory=list)
    set_aside: list[Tensor | None] | None = None

    def finished(self) -> int:
        """The samples the micro-batches that succeeded hold."""
        return sum(piece.samples for piece in self.done)

    def rest(self) -> list[tuple[Any, int]]:
        """The samples not finished, in micro-batches of the size in use."""
        return split_batch(slice_batch(self.kwargs["batch"], self.finished(), self.total), self.size)


class MicroBatchTrainer:
    """Runs one training batch for :class:`OOMBackoff`: whole while it can, else as micro-batches the ranks agree on.

    Args:
        trainer: the trainer, after the strategy wrapped the model.
        policy: chooses the micro-batch sizes; told every backoff the ranks agreed on.
        reporter: the callback, which prints and records backoffs and words the errors.
        loss_reduction: ``"mean"`` if the loss is a mean over the batch's samples, ``"sum"`` if it is a sum.
    """

    def __init__(
        self, trainer: "pl.Trainer", policy: MicroBatchSizePolicy, reporter: BackoffReporter, loss_reduction: str
    ) -> None:
        self.policy = policy
        self.reporter = reporter
        self.owner = type(reporter).__name__
        self.runner = BatchRunner(trainer, loss_reduction, self.owner)
        self.whole = WholeBatchPath(self.runner, policy, reporter)
        group, device = None, torch.device("cpu")
        if trainer.world_size > 1:
            strategy = trainer.strategy
            group, device = host_side_group(strategy.root_device, compat.process_group_timeout(strategy))
        self.ranks = RankAgreement(trainer.global_rank, trainer.world_size, group, device, self.owner)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.runner.rank

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return self.runner.world_size

    @property
    def whole_batches(self) -> int:
        """The batches that took the whole-batch path."""
        return self.runner.whole_batches

    # ---------------------------------------------------------------------------------------------- one batch
    def run_batch(
        self, loop: TrainingStepLoop, kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int
    ) -> ClosureResult:
        """Train on the batch in ``kwargs``; return what Lightning's closure would have returned."""
        runner = self.runner
        batch = kwargs["batch"]
        try:
            total = batch_size_of(batch)
            splittable = True
        except ValueError:
            # no tensor with a batch dimension: the batch runs whole, and an OOM on it cannot be recovered
            total, splittable = 1, False
        strategy = runner.trainer.strategy
        model = strategy.model
        runner.ddp = model if isinstance(model, DistributedDataParallel) else None  # bucket tuning wraps anew
        zero_grad_fn = loop.zero_grad_fn(batch_idx, optimizer)
        backward_fn = loop.backward_fn(optimizer)
        accumulating = not strategy.handles_gradient_accumulation and compat.should_accumulate(runner.trainer)
        size = self.policy.start_batch(total)
        if zero_grad_fn is not None:
            runner.window_size = None  # a new window (or none): nothing left from the last one
        # the path is chosen from the policy, which every rank holds alike (not from this rank's batch size)
        single = zero_grad_fn is not None and not accumulating  # the batch is the whole optimizer step
        whole = self.policy.micro_batch_size is None
        whole = whole and (single or (backward_fn is not None and self.whole.runs_windows())) and runner.flag_carried()
        if not whole:
            reduce_now = runner.ddp is not None and not accumulating
            state = RecoveringBatch(kwargs, total, splittable, size, reduce_now, backward_fn, [])
            return self.recover(loop, self._start_micro_batches(state, zero_grad_fn))
        if zero_grad_fn is not None:
            zero_grad_fn()
        if accumulating:
            return self.whole.run_window_batch(loop, kwargs, total, splittable, backward_fn)
        window_grads = None if single else self._window_grads()
        result, failure = self.whole.run(loop, kwargs, total, backward_fn, window_grads)
        if result is not None:
            runner.whole_batches += 1
            self._batch_succeeded(whole_everywhere=True)
            return result
        state = RecoveringBatch(kwargs, total, splittable, size, runner.ddp is not None, backward_fn, [], failure)
        return self.recover(loop, self._after_whole_failure(state, single))

    def _window_grads(self) -> list[Tensor | None] | None:
        """The window's gradients so far, set aside for its last batch (copies, where they are views of buckets)."""
        window_grads = stash_grads(self.runner.list_params())
        if window_grads is not None and getattr(self.runner.ddp, "gradient_as_bucket_view", False):
            flag = self.runner.flag
            assert flag is not None
            window_grads = flag.out_of_buckets(window_grads)  # kept views of DDP's buckets: copies
        return window_grads

    def _start_micro_batches(self, state: RecoveringBatch, zero_grad_fn: Any) -> RecoveringBatch:
        runner = self.runner
        runner.params = runner.trainable_params()
        if runner.ddp is not None:
            self._broadcast_buffers(first_of_window=zero_grad_fn is not None)
        if zero_grad_fn is not None:
            zero_grad_fn()
        batch = state.kwargs["batch"]
        state.pending = split_batch(batch, state.size) if state.splittable else [(batch, 1)]
        return state

    def _after_whole_failure(self, state: RecoveringBatch, single: bool) -> RecoveringBatch:
        """The batch failed whole on some rank: every rank runs it again from the agreement, in micro-batches."""
        runner = self.runner
        if runner.window_size is not None:
            # this rank backed off alone earlier in the window and raised the flag for it: it proposes that size
            state.size_hint, runner.window_size = runner.window_size, None
            if state.carried is None:
                state.notice_only = True  # its own attempt at this batch was a slice that fits: the size is enough
                state.carried = LocalFailure(FailureKind.RECOVERABLE_OOM, "ran out of memory earlier in the window")
        if runner.ddp is not None:
            # the statistics were put back to the step's start; in a window DDP broadcast them at its first batch
            self._broadcast_buffers(first_of_window=single)
        return state

    # -------------------------------------------------------------------------------------- the recovery's states
    def recover(self, loop: TrainingStepLoop, batch: RecoveringBatch) -> ClosureResult:
        """Move ``batch`` through the :class:`RecoveryState` s until it is done; the closure's result."""
        runner = self.runner
        if runner.batch_rollback is not None:
            # synchronised BatchNorm: a failed micro-batch changed the statistics every rank normalised with, so
            # every rank starts the batch over; the gradients of earlier batches of the window wait aside
            runner.batch_rollback.save()
            batch.set_aside = stash_grads(runner.params)
        state, failure, agreed = RecoveryState.MICRO_BATCHES, None, Agreement()
        while state is not RecoveryState.FINISH:
            if state is RecoveryState.MICRO_BATCHES:
                failure, state = self._run_pending(loop, batch), RecoveryState.AGREE
            elif state is RecoveryState.AGREE:
                agreed = self._agree(batch, failure)
                outcome = agreed.outcome(samples_left=batch.finished() < batch.total)
                if outcome is Outcome.RESUME:
                    # the whole-batch attempt failed for a reason every rank has put behind it
                    batch.pending = batch.rest() if batch.splittable else [(batch.kwargs["batch"], 1)]
                state = _NEXT_STATE[outcome]
            else:
                self._back_off(batch, agreed)
                state = RecoveryState.MICRO_BATCHES
        return self._finish(batch, agreed)

    def _run_pending(self, loop: TrainingStepLoop, batch: RecoveringBatch) -> LocalFailure | None:
        """MICRO_BATCHES: this rank's failure in the round, if any (its own, carried, or one carried to meet)."""
        runner = self.runner
        failure, batch.carried = batch.carried, None
        if batch.pending and (runner.pending is None or runner.sync_bn):
            # a rank stopping for an earlier failure still runs its micro-batch when the others' BatchNorm layers
            # wait for its statistics
            failure = runner.train_pieces(loop, batch.kwargs, batch.pending, batch.total, batch.backward_fn, batch.done)
        if runner.pending is not None:
            failure = runner.pending
        return failure

    def _agree(self, batch: RecoveringBatch, failure: LocalFailure | None) -> Agreement:
        """AGREE: what every rank proposes, combined; raises on every rank if one failed for good."""
        failure, size = self._propose(batch, failure)
        policy = self.policy
        # whether every rank may go back to whole batches after this batch: each ran its whole batch as one piece
        # (a probe that reached it, or a batch no larger than the micro-batch), and some rank probed
        size_run = policy.probe_size if policy.probe_size is not None else policy.micro_batch_size
        params = self.runner.params
        has_grad: tuple[bool, ...] = ()
        if batch.reduce_now:
            has_grad = tuple(p.grad is not None for p in params)
            if has_grad and batch.set_aside is not None:  # the window's earlier batches' gradients, set aside
                has_grad = tuple(m or old is not None for m, old in zip(has_grad, batch.set_aside, strict=True))
        fits_whole = size_run is None or size_run >= batch.total
        agreed = self.ranks.agree(Proposal(failure, size, fits_whole, policy.probing, batch.total, has_grad))
        if agreed.fatal_kind is not FailureKind.NONE:
            description = failure.description if failure is not None else ""
            floor = functools.partial(self.reporter.floor_message, self.rank, batch.size, batch.total, description)
            self.ranks.stop(failure, agreed, floor)
        if self.runner.sync_bn and policy.micro_batch_size is not None and not agreed.same_batch_size:
            raise OOMRecoveryError(
                f"{self.owner}: the ranks' batches differ in size (rank {self.rank} has {batch.total} samples) in a"
                " model with synchronized BatchNorm: their micro-batches would differ in number, and their BatchNorm"
                " collectives could not be matched. Give every rank the same batch size (DistributedSampler"
                " does, with drop_last or a dataset that divides evenly)."
            )
        return agreed

    def _propose(self, batch: RecoveringBatch, failure: LocalFailure | None) -> tuple[LocalFailure | None, int]:
        """The size this rank proposes after ``failure``, and the failure, made fatal at the smallest size."""
        if failure is None or not failure.recoverable:
            return failure, NO_PROPOSAL
        policy = self.policy
        smaller = policy.smaller_size(batch.size) if batch.splittable else None
        if batch.size_hint is not None:  # the size that worked on this rank earlier in the window
            hint = batch.size_hint
            if not batch.notice_only:  # its slice of that size failed too: smaller than that
                hint = policy.smaller_size(min(hint, batch.size)) if batch.splittable else None
            smaller, batch.size_hint = hint, None
        if smaller is None:
            return dataclasses.replace(failure, kind=FailureKind.OOM_AT_FLOOR), NO_PROPOSAL
        return failure, smaller

    def _back_off(self, batch: RecoveringBatch, agreed: Agreement) -> None:
        """BACK_OFF: adopt the agreed size; the samples left (all of them, with synchronized BatchNorm) run again."""
        assert agreed.oom_rank is not None
        probing = self.policy.probing
        self.policy.back_off(agreed.size)
        self.reporter.report_backoff(batch.size, agreed.size, agreed.oom_rank, batch.total, probing)
        batch.size = agreed.size
        runner = self.runner
        if runner.batch_rollback is not None:
            batch.done.clear()
            for param in runner.params:
                param.grad = None
            runner.batch_rollback.restore()
        batch.pending = batch.rest() if batch.finished() < batch.total else []

    def _finish(self, batch: RecoveringBatch, agreed: Agreement) -> ClosureResult:
        """FINISH: the batch's logs replayed, its gradients averaged once across ranks; the closure's result."""
        runner = self.runner
        self._batch_succeeded(agreed.whole_everywhere)
        merge_stashed_grads(runner.params, batch.set_aside)
        replay_logs(runner.pl_module, [call for piece in batch.done for call in piece.logs], "training_step")
        ddp = runner.ddp
        if batch.reduce_now and ddp is not None:
            params, has_grad = self._reduced_by_ddp(ddp, agreed.has_grad)
            average_gradients(
                params,
                has_grad,
                self.world_size,
                group=ddp.process_group,
                bucket_bytes=getattr(ddp, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES),
            )
            # as after DDP's own synchronised backward: the next forward (a validation one included) broadcasts
            # the buffers from rank 0
            ddp.require_forward_param_sync = True
        return closure_result(batch.done)

    def _reduced_by_ddp(
        self, ddp: DistributedDataParallel, has_grad: tuple[bool, ...]
    ) -> tuple[list[Tensor], list[bool]]:
        """The parameters DDP averages, with their ``has_grad`` flags: those in its buckets.

        Not one DDP ignores, nor one frozen when DDP wrapped the model and unfrozen since: stock DDP leaves each rank
        its own, and so does the whole-batch path. The flag knows the buckets from the wrap; where no flag rides,
        only the parameters DDP ignores are left out.
        """
        runner = self.runner
        flag = runner.flag
        bucketed = flag.bucketed_param_ids() if flag is not None and runner.flag_carried() else None
        if bucketed is None:
            if not ddp.parameters_to_ignore:
                return runner.params, list(has_grad)
            bucketed = frozenset(id(param) for param in bucket_params(ddp, trainable_only=False))
        kept = [(param, needed) for param, needed in zip(runner.params, has_grad, strict=True) if id(param) in bucketed]
        return [param for param, _ in kept], [needed for _, needed in kept]

    def _batch_succeeded(self, whole_everywhere: bool = False) -> None:
        probed = self.policy.batch_succeeded(back_to_whole=whole_everywhere)
        if whole_everywhere:
            self.policy.micro_batch_size = None  # every rank at once, the ranks that did not probe too
        if probed is not None:
            self.reporter.report_probe_success(probed)

    def _broadcast_buffers(self, first_of_window: bool) -> None:
        ddp = self.runner.ddp
        assert ddp is not None
        # DDP broadcasts buffers from rank 0 in the first forward after a synchronised backward; its forwards now
        # run under no_sync, so the broadcast happens here, at the same point, on every rank at once
        ddp.require_forward_param_sync = False
        if not first_of_window or not ddp.broadcast_buffers or next(ddp.module.buffers(), None) is None:
            return
        if compat.broadcast_ddp_buffers(ddp):  # coalesced, and through the buffer comm hook if one is registered
            return
        with torch.no_grad():
            for name, buffer in ddp.module.named_buffers():
                if name not in ddp.parameters_to_ignore:
                    dist.broadcast(buffer, src=0, group=ddp.process_group)

    # ------------------------------------------------------------------------------ points where every rank meets
    def check_peers(self, where: str) -> None:
        """Raise on every rank if a rank's optimizer step ran out of memory earlier. Collective."""
        self.ranks.check_peers(self.runner.pending, where)

    def close(self) -> None:
        """Let go of the side group (a local operation)."""
        self.ranks.close()


class _MicroBatchClosure(compat.OptimizerClosure):
    """The closure the optimizer calls: one batch, as micro-batches, agreed on every rank."""

    def __init__(self, loop: "BackoffOptimization", kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int):
        super().__init__()
        self.loop, self.kwargs, self.optimizer, self.batch_idx = loop, kwargs, optimizer, batch_idx
        self.finished = False

    @override
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        with torch.enable_grad():
            result = self.loop.runner.run_batch(self.loop, self.kwargs, self.optimizer, self.batch_idx)
        self.finished = True
        return result


class BackoffOptimization(compat.AutomaticOptimization):
    """Lightning's automatic optimization with the micro-batching closure and a guarded optimizer step."""

    def __init__(self, trainer: "pl.Trainer", runner: MicroBatchTrainer, replaced: Any) -> None:
        super().__init__(trainer, replaced)
        self.runner = runner
        self.batch_runner = runner.runner  # where a failure after the gradients were complete is carried

    @override
    def make_closure(self, kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int) -> _MicroBatchClosure:
        return _MicroBatchClosure(self, kwargs, optimizer, batch_idx)

    @override
    def optimizer_step(self, batch_idx: int, closure: Any) -> None:
        train_step_and_backward_closure = closure
        try:
            super().optimizer_step(batch_idx, train_step_and_backward_closure)
        except Exception as err:
            closure = train_step_and_backward_closure
            if not (isinstance(closure, _MicroBatchClosure) and closure.finished and is_out_of_memory(err)):
                raise
            message = self.runner.reporter.optimizer_step_message(self.runner.rank, first_line(err))
            if self.runner.world_size == 1:
                raise OOMRecoveryError(message) from err
            # other ranks may have stepped already. This rank counts the step as done, so that it follows exactly
            # the control flow of the others (max_steps, checkpoint triggers, validation), and carries on until the
            # next point where every rank meets: the next batch's agreement, the start of validation, a checkpoint
            # save or the end of training. There every rank stops together, and no checkpoint is written.
            if not compat.should_accumulate(self.trainer):
                self.optim_progress.optimizer.step.increment_completed()
            earlier = self.batch_runner.pending  # a hook's failure after the backward keeps its own error
            error = earlier.error if earlier is not None else None
            self.batch_runner.pending = LocalFailure(FailureKind.OPTIMIZER_STEP_OOM, message, error)
        if self.batch_runner.pending is not None:
            release_memory()
