"""The whole-batch path of :class:`~lightning_mgpu.OOMBackoff`: a batch run as Lightning would, told apart after.

A batch that runs whole takes Lightning's own closure, with DDP's overlapped gradient all-reduce, and nothing held
back but the ``self.log`` calls. Under DDP the strategy carries a :class:`~lightning_mgpu.ddp.step_flag.StepFlag` in
that all-reduce: a rank whose forward or backward runs out of memory finishes the step's reduction with zeros and a
flag set (:meth:`~lightning_mgpu.ddp.step_flag.StepFlag.finish_failed_step`), so every rank learns of the failure
from the gradients' own collective. No rank steps on that batch: each one undoes the attempt (normalization
statistics, metric states, gradients), and the batch runs again in micro-batches from the ranks' agreement.

In an ``accumulate_grad_batches`` window, the batches before the last run whole under ``no_sync()``, the window's
gradients set aside meanwhile; a rank that fails there redoes the batch alone, in micro-batches (no collective is
in flight), and raises the flag at the last batch. The last batch starts from empty gradients and its reduction adds
the set-aside ones into its buckets (:attr:`~lightning_mgpu.ddp.step_flag.StepFlag.addends`), so that if it
fails every rank goes back to them and only the last batch runs again.
"""

import weakref
from collections import OrderedDict
from typing import Any

import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.core.batch_split import slice_batch, split_batch
from lightning_mgpu.core.distributed_batchnorm import replaying
from lightning_mgpu.core.step_pieces import LogCall, capture_logs, replay_logs
from lightning_mgpu.ddp.step_flag import StepFlag
from lightning_mgpu.memory.micro_batch_policy import MicroBatchSizePolicy
from lightning_mgpu.memory.oom import cuda_allocated_bytes, release_memory
from lightning_mgpu.memory.oom_agreement import BackoffReporter, FailureKind, LocalFailure, OOMRecoveryError
from lightning_mgpu.memory.oom_pieces import (
    BatchRunner,
    Piece,
    TrainingStepLoop,
    closure_result,
    merge_stashed_grads,
    stash_grads,
    step_and_backward,
    unstash_grads,
)


def raised(flag: StepFlag, reductions_before: int) -> bool:
    """Whether a rank raised the flag in this step's reduction: on the CPU a memory load, on a GPU a wait for it."""
    if flag.reductions == reductions_before:
        return False  # no synchronised backward ran (a step without a loss)
    return flag.raised_on_host()


class WholeBatchPath:
    """Runs a batch whole, with DDP's reduction overlapped, and tells a failure on any rank from a success.

    Args:
        runner: the fit's state and this rank's micro-batches.
        policy: the micro-batch sizes, for a rank that backs off alone in an accumulation window.
        reporter: the callback, which words the error of an out-of-memory error at the smallest size.
    """

    def __init__(self, runner: BatchRunner, policy: MicroBatchSizePolicy, reporter: BackoffReporter) -> None:
        self.runner = runner
        self.policy = policy
        self.reporter = reporter
        # the DDP wrap whose parameters were last checked for float16, held weakly (bucket tuning frees old wraps)
        self._half_params_of: weakref.ref | None = None
        self._half_params = False

    def runs_windows(self) -> bool:
        """Whether the batches of an accumulation window can run whole, its last one with DDP's reduction.

        Each batch before the last runs under DDP's ``no_sync()``, so no collective is in flight: a failure there is
        recovered on its rank alone, which tells the others at the window's last batch (through the flag). The last
        batch starts from empty gradients, the earlier ones set aside: the flag's hook adds them into the buckets
        it reduces, so a step that fails can go back to them on every rank (those of parameters DDP ignores, in no
        bucket, are added back on their rank, as DDP accumulates them; with ``gradient_as_bucket_view``, those kept
        as views of the buckets are copied out first, since the last backward writes there). Not with synchronized
        BatchNorm: a rank recovering alone would leave the others' BatchNorm collectives unmatched.
        """
        runner = self.runner
        return runner.world_size > 1 and runner.ddp is not None and not runner.sync_bn

    # ------------------------------------------------------------------------------- the optimizer step's batch
    def run(
        self,
        loop: TrainingStepLoop,
        kwargs: OrderedDict,
        total: int,
        backward_fn: Any,
        window_grads: list[Tensor | None] | None = None,
    ) -> tuple[ClosureResult | None, LocalFailure | None]:
        """Run the batch as Lightning would, DDP's reduction overlapped with the backward.

        ``window_grads``: at the last batch of an accumulation window, the gradients of its earlier batches, set
        aside (one per parameter in the runner's ``params``): the flag's hook adds them into the buckets it reduces,
        and they are put back if the step fails.

        Returns the closure's result, or ``None`` and this rank's failure (``None`` if another rank failed) when the
        batch must run again in micro-batches, on every rank.
        """
        runner = self.runner
        ddp, flag = runner.ddp, runner.flag
        if flag is not None:
            flag.issued, flag.in_pass = 0, False  # set again once DDP's forward starts: what a failure reached
        if ddp is not None and flag is not None and (runner.pending is not None or runner.window_size is not None):
            # an optimizer step that failed earlier on this rank, or a backoff of its own earlier in the window:
            # every rank hears of it in this step's reduction
            flag.set(0, 1)
        reductions = flag.reductions if flag is not None else 0
        grad_scale = 1.0
        checked = self._half_params_of() if self._half_params_of is not None else None
        if ddp is not None and ddp is not checked:  # checked again when bucket tuning wraps anew
            self._half_params_of = weakref.ref(ddp)
            self._half_params = any(p.dtype == torch.float16 for p in ddp.parameters())
        if (
            ddp is not None
            and flag is not None
            and not self._half_params
            and window_grads is None
            and flag.reduces_every_trainable()
        ):
            # this backward's loss gradient is scaled, so the hook need not divide (any other backward through the
            # model, a learning-rate finder's say, keeps the hook's division); not for float16 parameters, whose
            # gradients would underflow sooner divided first, nor for a window's gradients set aside, not scaled,
            # nor while a parameter outside DDP's buckets (ignored, or unfrozen since the wrap) takes a gradient
            flag.divide = False
            grad_scale = flag.loss_scale
        if flag is not None and window_grads is not None:
            flag.addends = {p: g for p, g in zip(runner.params, window_grads, strict=True) if g is not None}
        if runner.window_size is not None:
            # this rank backed off alone earlier in the window, and raises the flag: every rank drops this attempt,
            # so it runs only a slice that fits, to take part in the step's collectives
            kwargs = OrderedDict(kwargs)
            kwargs["batch"] = slice_batch(kwargs["batch"], 0, min(runner.window_size, total))
        try:
            return self._attempt(loop, kwargs, total, backward_fn, flag, reductions, grad_scale, window_grads)
        finally:
            if flag is not None:
                flag.divide, flag.addends = True, None

    def _attempt(
        self,
        loop: TrainingStepLoop,
        kwargs: OrderedDict,
        total: int,
        backward_fn: Any,
        flag: StepFlag | None,
        reductions: int,
        grad_scale: float,
        window_grads: list[Tensor | None] | None,
    ) -> tuple[ClosureResult | None, LocalFailure | None]:
        runner = self.runner
        runner.rollback.save()  # a few small copies (normalization statistics, metric states) a failure would need
        runner.start_pass()
        allocated_before = cuda_allocated_bytes()
        logs: list[LogCall] = []
        failure = None
        losses: list[Tensor] = []
        try:
            with capture_logs(runner.pl_module, logs, total):  # a synchronised self.log is a collective: held back
                result, _ = step_and_backward(loop, kwargs, backward_fn, 1.0, grad_scale, losses)
        except Exception as err:
            failure = LocalFailure.of(err)
        if failure is None:
            # read only where there is another rank to hear from (on a GPU the read waits for the reduction)
            others = runner.world_size > 1 and runner.ddp is not None and flag is not None
            failed_elsewhere = others and raised(flag, reductions)
            if not failed_elsewhere:
                if runner.window_size is not None:
                    # the slice run to raise the flag ran no synchronised backward (its step returned no loss): the
                    # flag did not go out, and this rank cannot finish the batch the others reduced
                    raise OOMRecoveryError(
                        f"{runner.owner}: rank {runner.rank} backed off alone earlier in an accumulation window, and"
                        " its training_step returned no loss at the window's last batch, so the other ranks cannot"
                        " be told."
                    )
                if window_grads is not None:
                    restore_unbucketed(flag)
                replay_logs(runner.pl_module, logs, "training_step")
                return result, None  # Lightning's own: its loss copied once, as without the callback
        if window_grads is None:
            runner.params = runner.trainable_params()  # listed only for a step that failed: the undo needs them
        if failure is not None:
            stepped = self._after_failure(
                kwargs, failure, flag, reductions, losses, logs, allocated_before, window_grads
            )
            if stepped is not None:
                return stepped, None
        # the step failed on some rank: no rank steps on it. Undo what the attempt changed, on every rank (in a
        # window, its earlier batches' gradients come back)
        runner.rollback.restore()
        unstash_grads(runner.params, window_grads)
        return None, failure

    def _after_failure(
        self,
        kwargs: OrderedDict,
        failure: LocalFailure,
        flag: StepFlag | None,
        reductions: int,
        losses: list[Tensor],
        logs: list[LogCall],
        allocated_before: int,
        window_grads: list[Tensor | None] | None,
    ) -> ClosureResult | None:
        """Handle this rank's failure: its result if every rank steps on the reduced gradients, else ``None``."""
        runner = self.runner
        ddp = runner.ddp
        # after the step's reduction finished (in an on_after_backward hook, say): the gradients are every rank's
        # average, and the others read the flag
        reduced = (
            runner.world_size > 1
            and ddp is not None
            and flag is not None
            and bool(losses)
            and not flag.in_pass
            and flag.issued > 0
            and flag.reductions > reductions
        )
        # no rank raised the flag in that reduction: every rank steps with the averaged gradients (this one too, so
        # that a 16-mixed scaler finds its inf checks), and the next step's flag stops them all. Otherwise no rank
        # steps on it, and this failure is handled with the others' in the agreement
        stepping = reduced and not raised(flag, reductions)
        if failure.recoverable:
            if not stepping:
                for param in runner.params:  # the partial gradients go too (zero_grad had set them aside)
                    param.grad = None
                # nor what the attempt logged or returned: held, its loss looks like memory a cycle holds
                losses.clear()
                logs.clear()
            # outside the except block: the failed attempt's frames are gone; a full garbage collection (about
            # 200 ms) only if CUDA still holds more than before the attempt
            release_memory(allocated_before)
        if stepping:
            if window_grads is not None:
                restore_unbucketed(flag)
            runner.pending = LocalFailure(
                FailureKind.AFTER_BACKWARD_FAILURE,
                f"{runner.owner}: rank {runner.rank} failed after its gradients were reduced, in a hook after the"
                f" backward: {failure.description}",
                failure.error,
            )
            replay_logs(runner.pl_module, logs, "training_step")  # the others log (and sync) theirs
            return ClosureResult(losses[0], extra={})
        if not reduced and ddp is not None and flag is not None:
            self._tell_others(ddp, flag, failure, kwargs, reductions)
        return None

    def _tell_others(
        self, ddp: DistributedDataParallel, flag: StepFlag, failure: LocalFailure, kwargs: OrderedDict, reductions: int
    ) -> None:
        """Finish the step's reduction with zeros and the flag raised, so that every rank drops the step."""
        runner = self.runner
        if self._finish_failed_step(ddp, flag, failure, kwargs):
            if runner.world_size > 1:
                raised(flag, reductions)  # as the others read the flag (they ask every rank on a NaN)
        elif runner.world_size > 1:
            # before DDP's forward started: the other ranks cannot be told in this step. They stop at their next
            # collective (the strategy's hang watchdog, or the process group's timeout)
            if failure.error is not None:
                raise failure.error
            raise OOMRecoveryError(
                f"{runner.owner}: rank {runner.rank} ran out of memory before the model's forward started, where the"
                f" other ranks cannot be told within the step: {failure.description}"
            )

    def _finish_failed_step(
        self, ddp: DistributedDataParallel, flag: StepFlag, failure: LocalFailure, kwargs: OrderedDict
    ) -> bool:
        replay = self.runner.replay_pass(kwargs) if self.runner.sync_bn else None
        try:
            with replaying(self.runner.ledgers):
                return flag.finish_failed_step(ddp, replay=replay)
        except Exception:
            # the replay of training_step failed too (the same error again, most likely): the other ranks are left
            # in their BatchNorm collectives, and stop at the strategy's hang watchdog or the group's timeout
            if failure.error is not None:
                raise failure.error from None
            raise

    # ------------------------------------------------------------------------ a window's batches before its last
    def run_window_batch(
        self, loop: TrainingStepLoop, kwargs: OrderedDict, total: int, splittable: bool, backward_fn: Any
    ) -> ClosureResult:
        """A batch of an accumulation window before its last, whole, under DDP's ``no_sync()``: no collective.

        The window's gradients so far are set aside during the backward (a backward failing half-way has added
        some of its gradients already) and added back after it. If the batch runs out of memory, this rank alone
        runs it again in micro-batches; the others hear of it at the window's last batch. What cannot be recovered
        is raised at once, on this rank.
        """
        runner = self.runner
        params = runner.list_params()
        if runner.window_size is not None:
            return self._recover_in_window(loop, kwargs, total, splittable, backward_fn, None)
        stashed = stash_grads(params)
        allocated_before = cuda_allocated_bytes()
        runner.rollback.save()
        runner.start_pass()
        flag = runner.flag
        assert flag is not None and runner.ddp is not None
        flag.in_pass = False  # set once DDP's forward has run its own collectives and reached the module
        logs: list[LogCall] = []
        failure = None
        try:
            with capture_logs(runner.pl_module, logs, total):  # held back: a failed attempt's calls are dropped
                result, _ = step_and_backward(loop, kwargs, backward_fn, 1.0)
        except Exception as err:
            failure = LocalFailure.of(err)
        if failure is None:
            merge_stashed_grads(runner.params, stashed)
            replay_logs(runner.pl_module, logs, "training_step")
            runner.whole_batches += 1
            return result
        unstash_grads(runner.params, stashed)  # this batch's partial gradients go
        runner.rollback.restore()
        self._check_window_failure(flag, failure)
        flag.in_pass = False
        # DDP's forward broadcast the buffers before the failure, on every rank; left set by the failed forward, this
        # would make the next forward broadcast them again on this rank alone
        runner.ddp.require_forward_param_sync = False
        logs.clear()
        release_memory(allocated_before)
        return self._recover_in_window(loop, kwargs, total, splittable, backward_fn, failure)

    def _check_window_failure(self, flag: StepFlag, failure: LocalFailure) -> None:
        """Raise on this rank for a failure in a window's batch that it cannot recover from alone."""
        if not failure.recoverable and failure.error is not None:
            raise failure.error  # not an OOM (a CUDA context it may have broken included): this rank stops now
        if not flag.in_pass:
            # in DDP's forward, before the module ran: its buffer broadcast or bucket rebuild (collectives) may be
            # unfinished here, so this rank cannot go on alone
            runner = self.runner
            raise OOMRecoveryError(
                f"{runner.owner}: rank {runner.rank} ran out of memory in DDP's forward before the model's forward"
                f" started, in an accumulation window, where the other ranks cannot be told: {failure.description}"
            )

    def _recover_in_window(
        self,
        loop: TrainingStepLoop,
        kwargs: OrderedDict,
        total: int,
        splittable: bool,
        backward_fn: Any,
        failure: LocalFailure | None,
    ) -> ClosureResult:
        """Run a window batch in micro-batches on this rank alone, smaller after each out-of-memory error.

        The size reached is kept for the window's later batches and proposed to the other ranks at its last one.
        An OOM at the smallest size, or any other error, is raised at once on this rank: it cannot wait for the
        window's last batch, since the others' batches may issue collectives meanwhile (``self.log`` with
        ``sync_dist=True``) that it could not match. The others stop at their next collective: at once on gloo,
        where the peer's socket closes, or through the strategy's hang watchdog or the process group's timeout.
        """
        runner = self.runner
        done: list[Piece] = []
        size = runner.window_size  # None: the whole batch was tried, and failed
        while True:
            if failure is not None:
                if not failure.recoverable:
                    if failure.error is not None:
                        raise failure.error
                    raise OOMRecoveryError(failure.description)
                smaller = self.policy.smaller_size(size or total) if splittable else None
                if smaller is None:
                    raise OOMRecoveryError(
                        self.reporter.floor_message(runner.rank, size or total, total, failure.description)
                    )
                size = smaller
            finished = sum(piece.samples for piece in done)
            if finished == total:
                break
            pending = split_batch(slice_batch(kwargs["batch"], finished, total), size or total)
            failure = runner.train_pieces(loop, kwargs, pending, total, backward_fn, done)
            if failure is None:
                break
        runner.window_size = size
        replay_logs(runner.pl_module, [call for piece in done for call in piece.logs], "training_step")
        return closure_result(done)


def restore_unbucketed(flag: StepFlag) -> None:
    """Add back the set-aside gradients the reduction did not take.

    Those of parameters in no DDP bucket (ignored by DDP, or unfrozen after the model was wrapped), which DDP
    leaves to each rank as stock accumulation does, or all of them when no synchronised backward ran (a step
    without a loss).
    """
    left = flag.addends
    if not left:
        return
    with torch.no_grad():
        for param, kept in left.items():
            param.grad = kept if param.grad is None else kept.add_(param.grad)
