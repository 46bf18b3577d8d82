"""Where :class:`~lightning_mgpu.OOMBackoff` runs a training batch: micro-batches, the ranks' agreement, the reduce.

Lightning's automatic optimization builds a closure (``training_step``, ``zero_grad``, ``backward``) that the
optimizer calls. An exception escaping it tears the trainer down, so the retry loop replaces that closure: the
epoch loop's ``automatic_optimization`` object is swapped for a subclass whose closure runs the batch as
micro-batches and retries what ran out of memory.

A batch that runs whole (no out-of-memory error yet) takes the **whole-batch path**: Lightning's own closure, with
DDP's overlapped gradient all-reduce, and nothing held back but the ``self.log`` calls. Under DDP the strategy
carries a :class:`~lightning_mgpu.ddp.step_flag.StepFlag` in that all-reduce: a rank whose forward or backward
runs out of memory finishes the step's reduction with zeros and a flag set
(:meth:`~lightning_mgpu.ddp.step_flag.StepFlag.finish_failed_step`), so every rank learns of the failure from
the gradients' own collective. No rank steps on that batch: each one undoes the attempt (normalization statistics,
metric states, gradients) and the batch is run again on the **micro-batch path** below, starting from the agreement.

In an ``accumulate_grad_batches`` window, the batches before the last run whole under ``no_sync()``, the window's
gradients set aside meanwhile; a rank that fails there redoes the batch alone, in micro-batches (no collective is
in flight), and raises the flag at the last batch. The last batch starts from empty gradients and its reduction adds
the set-aside ones into its buckets (:attr:`~lightning_mgpu.ddp.step_flag.StepFlag.addends`), so that if it
fails every rank goes back to them and only the last batch runs again.

The micro-batch path, on every rank:

1. Every micro-batch runs forward and backward under DDP's ``no_sync()``: no gradient collective is in flight
   while a rank may still run out of memory (the deadlock Composer documents for an OOM in the backward).
2. The ranks agree through one small all-reduce on the host: who ran out of memory, the largest micro-batch size
   that every rank can take, who failed for good. A rank whose micro-batches all succeeded keeps them; only the
   rank that failed recomputes the samples it had not finished, in smaller micro-batches. Rounds repeat until no
   rank retries.
3. The gradients are averaged across ranks once, in buckets, as DDP would have done during the backward.

The sizes come from a :class:`~lightning_mgpu.memory.micro_batch_policy.MicroBatchSizePolicy`, told only what
every rank agreed on; the callback prints, records and words the errors (:class:`BackoffReporter`).
"""

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

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
from lightning_mgpu.core.distributed_batchnorm import PASS_LEDGER, DistributedBatchNorm
from lightning_mgpu.core.host_group import host_side_group
from lightning_mgpu.core.step_pieces import LogCall, capture_logs, merge_outputs, piece_share, replay_logs
from lightning_mgpu.ddp.step_flag import StepFlag, bucket_params
from lightning_mgpu.memory.grad_allreduce import DEFAULT_BUCKET_BYTES, average_gradients
from lightning_mgpu.memory.micro_batch_policy import MicroBatchSizePolicy
from lightning_mgpu.memory.oom import cuda_allocated_bytes, is_out_of_memory, release_memory
from lightning_mgpu.memory.step_rollback import AttemptState, StepRollback

# a local out-of-memory error that a smaller micro-batch may fix
RECOVERABLE_OOM = -1
# fatal causes, in rising precedence (the agreement takes the maximum)
NO_FAILURE, OOM_AT_FLOOR, OPTIMIZER_STEP_OOM, AFTER_BACKWARD_FAILURE, OTHER_ERROR = 0, 1, 2, 3, 4
_NO_PROPOSAL = 2**62


class OOMRecoveryError(RuntimeError):
    """Raised by :class:`OOMBackoff`, on every rank, when an out-of-memory error cannot be recovered from."""


class _Piece:
    """What one micro-batch that succeeded left behind."""

    __slots__ = ("extra", "logs", "loss", "samples")

    def __init__(self, samples: int, loss: Tensor | None, extra: dict[str, Any], logs: list[LogCall]) -> None:
        self.samples, self.loss, self.extra, self.logs = samples, loss, extra, logs


class BackoffReporter(Protocol):
    """What the runner tells the callback that owns it (:class:`OOMBackoff`), and the messages it asks it for."""

    def report_backoff(self, old: int, new: int, oom_rank: int, total: int, probe: bool) -> None:
        """Print and record a backoff the policy adopted; called on every rank with the same arguments."""

    def report_probe_success(self, size: int) -> None:
        """Print that a probe upwards to ``size`` samples did not run out of memory."""

    def floor_message(self, rank: int, size: int, total: int, description: str) -> str:
        """The error for an out-of-memory error at the smallest micro-batch size."""

    def optimizer_step_message(self, rank: int, description: str) -> str:
        """The error for an out-of-memory error inside the optimizer step."""


class _LocalFailure:
    """Why this rank's attempt stopped: an out-of-memory error to retry, or an error to stop on."""

    def __init__(self, kind: int, description: str, error: BaseException | None = None) -> None:
        self.kind, self.description, self.error = kind, description, error

    @classmethod
    def of(cls, error: BaseException) -> "_LocalFailure":
        """The failure ``error`` is: an out-of-memory error to retry, or any other error, kept to be raised again.

        An out-of-memory error is not kept: its frames hold the failed attempt's activations.
        """
        if is_out_of_memory(error):
            return cls(RECOVERABLE_OOM, _first_line(error))
        return cls(OTHER_ERROR, f"{type(error).__name__}: {error}", error)


def _step_and_backward(
    loop: "BackoffOptimization",
    kwargs: OrderedDict,
    backward_fn: Any,
    weight: float,
    grad_scale: float = 1.0,
    losses: list[Tensor] | None = None,
    share: float = 1.0,
) -> tuple[ClosureResult, Tensor | None]:
    """Run Lightning's training step on ``kwargs`` and the backward of its loss times ``weight``.

    ``grad_scale`` multiplies the gradient the backward starts from, not the loss the hooks and loggers see (the
    step flag's hooks leave the division by the world size to it). ``losses`` receives the loss before the backward.
    ``share`` is the piece's share of its batch, told to the backward's hooks (:func:`current_piece_share`).

    Returns Lightning's result of the training step (its loss not weighted) and the weighted loss, detached.
    """
    output = loop.training_step(kwargs)
    loss = output.closure_loss
    if loss is not None and weight != 1.0:
        loss = loss * weight
    if loss is not None and grad_scale != 1.0 and loss.requires_grad:
        loss.register_hook(lambda grad: grad * grad_scale)
    if loss is not None and losses is not None:
        losses.append(loss.detach())  # known before the backward, which may fail
    if loss is not None and backward_fn is not None:
        with piece_share(share):
            backward_fn(loss)
    return output, (loss.detach() if loss is not None else None)


class MicroBatchTrainer:
    """Runs one training batch as micro-batches for :class:`OOMBackoff`, agreeing with the other ranks.

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
        self.loss_reduction = loss_reduction
        self.owner = type(reporter).__name__
        self.trainer = trainer
        self.pl_module = trainer.lightning_module
        strategy = trainer.strategy
        self.ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
        self.whole_batches = 0  # batches that took the whole-batch path
        self.world_size = trainer.world_size
        self.rank = trainer.global_rank
        # callbacks whose per-step state an attempt changes (NaNSkip's loss verdicts): a dropped attempt's goes too
        participants = [callback for callback in trainer.callbacks if isinstance(callback, AttemptState)]
        self.rollback = StepRollback(self.pl_module, participants)
        # synchronised BatchNorm runs collectives in every training pass: a rank that fails part way replays the
        # rest of them, and every rank runs the same micro-batches
        modules = self.pl_module.modules()
        self.sync_bn = self.world_size > 1 and any(isinstance(m, DistributedBatchNorm) for m in modules)
        self.batch_rollback = StepRollback(self.pl_module, participants) if self.sync_bn else None
        self.params: list[Tensor] = []  # listed again at every batch that needs them
        # the DDP wrap whose parameters were last checked for float16, held weakly (bucket tuning frees old wraps)
        self._half_params_of: weakref.ref | None = None
        self._half_params = False
        self.pending_failure: str | None = None
        self.pending_kind = OPTIMIZER_STEP_OOM  # what pending_failure is
        self.pending_error: BaseException | None = None  # an error that is not an OOM, raised again at the stop
        # the micro-batch size this rank backed off to alone, earlier in the accumulation window under way: every rank
        # hears of it at the window's last batch
        self.window_size: int | None = None
        self.group: dist.ProcessGroup | None = None
        self.flag_device = torch.device("cpu")
        if self.world_size > 1:
            self.group, self.flag_device = host_side_group(strategy.root_device, compat.process_group_timeout(strategy))

    # ---------------------------------------------------------------------------------------------- one batch
    def run_batch(
        self, loop: "BackoffOptimization", kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int
    ) -> ClosureResult:
        """Train on the batch in ``kwargs``; return what Lightning's closure would have returned."""
        batch = kwargs["batch"]
        try:
            total = batch_size_of(batch)
            splittable = True
        except ValueError:
            # no tensor with a batch dimension: the batch runs whole, and an OOM on it cannot be recovered
            total, splittable = 1, False
        model = self.trainer.strategy.model
        self.ddp = model if isinstance(model, DistributedDataParallel) else None  # bucket tuning wraps anew
        zero_grad_fn = loop.zero_grad_fn(batch_idx, optimizer)
        backward_fn = loop.backward_fn(optimizer)
        accumulating = not self.trainer.strategy.handles_gradient_accumulation and compat.should_accumulate(
            self.trainer
        )
        reduce_now = self.ddp is not None and not accumulating
        size = self.policy.start_batch(total)
        first_failure: _LocalFailure | None = None
        size_hint: int | None = None  # a size this rank backed off to alone, earlier in the window
        notice_only = False  # whether that backoff is all this rank has to tell (its attempt at this batch was small)
        if zero_grad_fn is not None:
            self.window_size = None  # a new window (or none): nothing left from the last one
        # the path is chosen from the policy, which every rank holds alike (not from this rank's batch size)
        whole = self.policy.micro_batch_size is None
        single = zero_grad_fn is not None and not accumulating  # the batch is the whole optimizer step
        window = backward_fn is not None and self._window_on_whole_path()
        if whole and (single or window) and self._flag_carried():
            if zero_grad_fn is not None:
                zero_grad_fn()
            if accumulating:
                return self._run_window_batch(loop, kwargs, total, splittable, backward_fn)
            window_grads = None if single else _stash_grads(self._list_params())
            if window_grads is not None and getattr(self.ddp, "gradient_as_bucket_view", False):
                assert self.flag is not None
                window_grads = self.flag.out_of_buckets(window_grads)  # kept views of DDP's buckets: copies
            result, first_failure = self._run_whole(loop, kwargs, total, backward_fn, window_grads)
            if result is not None:
                self.whole_batches += 1
                self._batch_succeeded(whole_everywhere=True)
                return result
            # it failed on some rank: every rank runs the batch again from the agreement, in micro-batches
            pending: list[tuple[Any, int]] = []
            if self.window_size is not None:
                # this rank backed off alone earlier in the window and raised the flag for it: it proposes that size
                size_hint, self.window_size = self.window_size, None
                if first_failure is None:
                    notice_only = True  # its own attempt at this batch was a slice that fits: the size is enough
                    first_failure = _LocalFailure(RECOVERABLE_OOM, "ran out of memory earlier in the window")
            if self.ddp is not None:
                # the statistics were put back to the step's start; in a window DDP broadcast them at its first batch
                self._broadcast_buffers(first_of_window=single)
        else:
            self.params = self._trainable_params()
            if self.ddp is not None:
                self._broadcast_buffers(first_of_window=zero_grad_fn is not None)
            if zero_grad_fn is not None:
                zero_grad_fn()
            pending = split_batch(batch, size) if splittable else [(batch, 1)]
        done: list[_Piece] = []
        batch_grads = None
        if self.batch_rollback is not None:
            # synchronised BatchNorm: a failed micro-batch changed the statistics every rank normalised with, so
            # every rank starts the batch over; the gradients of earlier batches of the window wait aside
            self.batch_rollback.save()
            batch_grads = _stash_grads(self.params)
        while True:
            failure, first_failure = first_failure, None
            if pending and (self.pending_failure is None or self.sync_bn):
                # a rank stopping for an earlier failure still runs its micro-batch when the others' BatchNorm
                # layers wait for its statistics
                failure = self._train_pieces(loop, kwargs, pending, total, backward_fn, done)
            if self.pending_failure is not None:
                failure = _LocalFailure(self.pending_kind, self.pending_failure, self.pending_error)
            proposal = _NO_PROPOSAL
            if failure is not None and failure.kind == RECOVERABLE_OOM:
                smaller = self.policy.smaller_size(size) if splittable else None
                if size_hint is not None:  # the size that worked on this rank earlier in the window
                    if not notice_only:  # its slice of that size failed too: smaller than that
                        size_hint = self.policy.smaller_size(min(size_hint, size)) if splittable else None
                    smaller = size_hint
                    size_hint = None
                if smaller is None:
                    failure.kind = OOM_AT_FLOOR
                else:
                    proposal = smaller
            agreed = self._agree(failure, proposal, reduce_now, total, batch_grads)
            if agreed["fatal_kind"] != NO_FAILURE:
                self._fail(failure, agreed, size, total)
            if self.sync_bn and self.policy.micro_batch_size is not None and not agreed["same_batch_size"]:
                raise OOMRecoveryError(
                    f"{self.owner}: the ranks' batches differ in size (rank {self.rank} has {total} samples) in a model"
                    " with synchronized BatchNorm: their micro-batches would differ in number, and their BatchNorm"
                    " collectives could not be matched. Give every rank the same batch size (DistributedSampler"
                    " does, with drop_last or a dataset that divides evenly)."
                )
            finished = sum(piece.samples for piece in done)
            if agreed["oom_rank"] is None:
                if finished < total:  # the whole-batch attempt failed for a reason every rank has put behind it
                    pending = split_batch(slice_batch(batch, finished, total), size) if splittable else [(batch, 1)]
                    continue
                break
            probing = self.policy.probing
            self.policy.back_off(agreed["size"])
            self.reporter.report_backoff(size, agreed["size"], agreed["oom_rank"], total, probing)
            size = agreed["size"]
            if self.batch_rollback is not None:
                done.clear()
                for param in self.params:
                    param.grad = None
                self.batch_rollback.restore()
                finished = 0
            pending = split_batch(slice_batch(batch, finished, total), size) if finished < total else []

        self._batch_succeeded(agreed["whole_everywhere"])
        _merge_stashed_grads(self.params, batch_grads)
        logs = [call for piece in done for call in piece.logs]
        replay_logs(self.pl_module, logs, "training_step")
        if reduce_now:
            params, has_grad = self._reduced_by_ddp(agreed["has_grad"])
            average_gradients(
                params,
                has_grad,
                self.world_size,
                group=self.ddp.process_group,
                bucket_bytes=getattr(self.ddp, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES),
            )
            # as after DDP's own synchronised backward: the next forward (a validation one included) broadcasts
            # the buffers from rank 0
            self.ddp.require_forward_param_sync = True
        return self._closure_result(done)

    def _trainable_params(self) -> list[Tensor]:
        """Listed per batch that needs them: layers a fine-tuning callback unfroze since are accumulated too."""
        return [p for p in self.pl_module.parameters() if p.requires_grad]

    def _reduced_by_ddp(self, has_grad: list[bool]) -> tuple[list[Tensor], list[bool]]:
        """The parameters DDP averages, with their ``has_grad`` flags: those in its buckets.

        Not one DDP ignores, nor one frozen when DDP wrapped the model and unfrozen since: stock DDP leaves each rank
        its own, and so does the whole-batch path. The flag knows the buckets from the wrap; where no flag rides,
        only the parameters DDP ignores are left out.
        """
        ddp, flag = self.ddp, self.flag
        assert ddp is not None
        bucketed = flag.bucketed_param_ids() if flag is not None and self._flag_carried() else None
        if bucketed is None:
            if not ddp.parameters_to_ignore:
                return self.params, has_grad
            bucketed = frozenset(id(param) for param in bucket_params(ddp, trainable_only=False))
        kept = [(param, needed) for param, needed in zip(self.params, has_grad, strict=True) if id(param) in bucketed]
        return [param for param, _ in kept], [needed for _, needed in kept]

    def _list_params(self) -> list[Tensor]:
        self.params = self._trainable_params()
        return self.params

    def _batch_succeeded(self, whole_everywhere: bool = False) -> None:
        probed = self.policy.batch_succeeded(back_to_whole=whole_everywhere)
        if whole_everywhere:
            self.policy.micro_batch_size = None  # every rank at once, the ranks that did not probe too
        if probed is not None:
            self.reporter.report_probe_success(probed)

    # ------------------------------------------------------------------------------------ the whole-batch path
    def _flag_carried(self) -> bool:
        """Whether a failure on this batch can reach every rank without a collective of its own."""
        if self.world_size == 1:
            return True
        registered = getattr(self.trainer.strategy, "step_flag_registered", False)
        return self.ddp is not None and isinstance(self.flag, StepFlag) and registered

    def _window_on_whole_path(self) -> bool:
        """Whether the batches of an accumulation window can run whole, its last one with DDP's reduction.

        Each batch before the last runs under DDP's ``no_sync()``, so no collective is in flight: a failure there is
        recovered on its rank alone, which tells the others at the window's last batch (through the flag). The last
        batch starts from empty gradients, the earlier ones set aside: the flag's hook adds them into the buckets
        it reduces, so a step that fails can go back to them on every rank (those of parameters DDP ignores, in no
        bucket, are added back on their rank, as DDP accumulates them; with ``gradient_as_bucket_view``, those kept
        as views of the buckets are copied out first, since the last backward writes there). Not with synchronized
        BatchNorm: a rank recovering alone would leave the others' BatchNorm collectives unmatched.
        """
        return self.world_size > 1 and self.ddp is not None and not self.sync_bn

    def _run_window_batch(
        self, loop: "BackoffOptimization", kwargs: OrderedDict, total: int, splittable: bool, backward_fn: Any
    ) -> ClosureResult:
        """A batch of an accumulation window before its last, whole, under DDP's ``no_sync()``: no collective.

        The window's gradients so far are set aside during the backward (a backward failing half-way has added
        some of its gradients already) and added back after it. If the batch runs out of memory, this rank alone
        runs it again in micro-batches; the others hear of it at the window's last batch. What cannot be recovered
        is raised at once, on this rank.
        """
        params = self._list_params()
        if self.window_size is not None:
            return self._recover_in_window(loop, kwargs, total, splittable, backward_fn, None)
        stashed = _stash_grads(params)
        allocated_before = cuda_allocated_bytes()
        self.rollback.save()
        PASS_LEDGER.start_pass()
        flag = self.flag
        assert flag is not None and self.ddp is not None
        flag.in_pass = False  # set once DDP's forward has run its own collectives and reached the module
        logs: list[LogCall] = []
        failure = None
        try:
            with capture_logs(self.pl_module, logs, total):  # held back: a failed attempt's calls are dropped
                result, _ = _step_and_backward(loop, kwargs, backward_fn, 1.0)
        except Exception as err:
            failure = _LocalFailure.of(err)
        if failure is None:
            _merge_stashed_grads(self.params, stashed)
            replay_logs(self.pl_module, logs, "training_step")
            self.whole_batches += 1
            return result
        _unstash_grads(self.params, stashed)  # this batch's partial gradients go
        self.rollback.restore()
        if failure.kind != RECOVERABLE_OOM and failure.error is not None:
            raise failure.error  # not an OOM (a CUDA context it may have broken included): this rank stops now
        if not flag.in_pass:
            # in DDP's forward, before the module ran: its buffer broadcast or bucket rebuild (collectives) may be
            # unfinished here, so this rank cannot go on alone
            raise OOMRecoveryError(
                f"{self.owner}: rank {self.rank} ran out of memory in DDP's forward before the model's forward"
                f" started, in an accumulation window, where the other ranks cannot be told: {failure.description}"
            )
        flag.in_pass = False
        # DDP's forward broadcast the buffers before the failure, on every rank; left set by the failed forward, this
        # would make the next forward broadcast them again on this rank alone
        self.ddp.require_forward_param_sync = False
        logs.clear()
        release_memory(allocated_before)
        return self._recover_in_window(loop, kwargs, total, splittable, backward_fn, failure)

    def _recover_in_window(
        self,
        loop: "BackoffOptimization",
        kwargs: OrderedDict,
        total: int,
        splittable: bool,
        backward_fn: Any,
        failure: _LocalFailure | None,
    ) -> ClosureResult:
        """Run a window batch in micro-batches on this rank alone, smaller after each out-of-memory error.

        The size reached is kept for the window's later batches and proposed to the other ranks at its last one.
        An OOM at the smallest size, or any other error, is raised at once on this rank: it cannot wait for the
        window's last batch, since the others' batches may issue collectives meanwhile (``self.log`` with
        ``sync_dist=True``) that it could not match. The others stop at their next collective: at once on gloo,
        where the peer's socket closes, or through the strategy's hang watchdog or the process group's timeout.
        """
        done: list[_Piece] = []
        size = self.window_size  # None: the whole batch was tried, and failed
        while True:
            if failure is not None:
                if failure.kind != RECOVERABLE_OOM:
                    if failure.error is not None:
                        raise failure.error
                    raise OOMRecoveryError(failure.description)
                smaller = self.policy.smaller_size(size or total) if splittable else None
                if smaller is None:
                    raise OOMRecoveryError(
                        self.reporter.floor_message(self.rank, size or total, total, failure.description)
                    )
                size = smaller
            finished = sum(piece.samples for piece in done)
            if finished == total:
                break
            pending = split_batch(slice_batch(kwargs["batch"], finished, total), size or total)
            failure = self._train_pieces(loop, kwargs, pending, total, backward_fn, done)
            if failure is None:
                break
        self.window_size = size
        replay_logs(self.pl_module, [call for piece in done for call in piece.logs], "training_step")
        return self._closure_result(done)

    def _restore_unbucketed(self, flag: StepFlag) -> None:
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

    @property
    def flag(self) -> StepFlag | None:
        """The flag the strategy carries in the gradient all-reduce, if it carries one."""
        return getattr(self.trainer.strategy, "step_flag", None)

    def _run_whole(
        self,
        loop: "BackoffOptimization",
        kwargs: OrderedDict,
        total: int,
        backward_fn: Any,
        window_grads: list[Tensor | None] | None = None,
    ) -> tuple[ClosureResult | None, _LocalFailure | None]:
        """Run the batch as Lightning would, DDP's reduction overlapped with the backward.

        ``window_grads``: at the last batch of an accumulation window, the gradients of its earlier batches, set
        aside (one per parameter in :attr:`params`): the flag's hook adds them into the buckets it reduces, and they
        are put back if the step fails.

        Returns the closure's result, or ``None`` and this rank's failure (``None`` if another rank failed) when the
        batch must run again in micro-batches, on every rank.
        """
        ddp, flag = self.ddp, self.flag
        if flag is not None:
            flag.issued, flag.in_pass = 0, False  # set again once DDP's forward starts: what a failure reached
        if ddp is not None and flag is not None and (self.pending_failure is not None or self.window_size is not None):
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
            flag.addends = {p: g for p, g in zip(self.params, window_grads, strict=True) if g is not None}
        if self.window_size is not None:
            # this rank backed off alone earlier in the window, and raises the flag: every rank drops this attempt,
            # so it runs only a slice that fits, to take part in the step's collectives
            kwargs = OrderedDict(kwargs)
            kwargs["batch"] = slice_batch(kwargs["batch"], 0, min(self.window_size, total))
        try:
            return self._run_whole_scaled(loop, kwargs, total, backward_fn, reductions, grad_scale, window_grads)
        finally:
            if flag is not None:
                flag.divide, flag.addends = True, None

    def _run_whole_scaled(
        self,
        loop: "BackoffOptimization",
        kwargs: OrderedDict,
        total: int,
        backward_fn: Any,
        reductions: int,
        grad_scale: float,
        window_grads: list[Tensor | None] | None,
    ) -> tuple[ClosureResult | None, _LocalFailure | None]:
        ddp, flag = self.ddp, self.flag
        self.rollback.save()  # a few small copies (normalization statistics, metric states) a failure would need
        PASS_LEDGER.start_pass()
        allocated_before = cuda_allocated_bytes()
        logs: list[LogCall] = []
        failure = None
        losses: list[Tensor] = []
        try:
            with capture_logs(self.pl_module, logs, total):  # a synchronised self.log is a collective: held back
                result, _ = _step_and_backward(loop, kwargs, backward_fn, 1.0, grad_scale, losses)
        except Exception as err:
            failure = _LocalFailure.of(err)
        if failure is None:
            # read only where there is another rank to hear from (on a GPU the read waits for the reduction)
            others = self.world_size > 1 and ddp is not None and flag is not None
            failed_elsewhere = others and _raised(flag, reductions)
            if not failed_elsewhere:
                if self.window_size is not None:
                    # the slice run to raise the flag ran no synchronised backward (its step returned no loss): the
                    # flag did not go out, and this rank cannot finish the batch the others reduced
                    raise OOMRecoveryError(
                        f"{self.owner}: rank {self.rank} backed off alone earlier in an accumulation window, and its"
                        " training_step returned no loss at the window's last batch, so the other ranks cannot be told."
                    )
                if window_grads is not None:
                    self._restore_unbucketed(flag)
                replay_logs(self.pl_module, logs, "training_step")
                return result, None  # Lightning's own: its loss copied once, as without the callback
        if window_grads is None:
            self.params = self._trainable_params()  # listed only for a step that failed: the undo needs them
        if failure is not None:
            # after the step's reduction finished (in an on_after_backward hook, say): the gradients are every
            # rank's average, and the others read the flag
            reduced = (
                self.world_size > 1
                and ddp is not None
                and flag is not None
                and bool(losses)
                and not flag.in_pass
                and flag.issued > 0
                and flag.reductions > reductions
            )
            # no rank raised the flag in that reduction: every rank steps with the averaged gradients (this one
            # too, so that a 16-mixed scaler finds its inf checks), and the next step's flag stops them all.
            # Otherwise no rank steps on it, and this failure is handled with the others' in the agreement
            stepping = reduced and not _raised(flag, reductions)
            if failure.kind == RECOVERABLE_OOM:
                if not stepping:
                    for param in self.params:  # the partial gradients go too (zero_grad had set them aside)
                        param.grad = None
                    # nor what the attempt logged or returned: held, its loss looks like memory a cycle holds
                    losses.clear()
                    logs.clear()
                # outside the except block: the failed attempt's frames are gone; a full garbage collection (about
                # 200 ms) only if CUDA still holds more than before the attempt
                release_memory(allocated_before)
            if stepping:
                if window_grads is not None:
                    self._restore_unbucketed(flag)
                self.pending_kind, self.pending_error = AFTER_BACKWARD_FAILURE, failure.error
                self.pending_failure = (
                    f"{self.owner}: rank {self.rank} failed after its gradients were reduced, in a hook after"
                    f" the backward: {failure.description}"
                )
                replay_logs(self.pl_module, logs, "training_step")  # the others log (and sync) theirs
                return ClosureResult(losses[0], extra={}), None
            if not reduced and ddp is not None and flag is not None:
                if self._finish_failed_step(ddp, flag, failure, kwargs):
                    if self.world_size > 1:
                        _raised(flag, reductions)  # as the others read the flag (they ask every rank on a NaN)
                elif self.world_size > 1:
                    # before DDP's forward started: the other ranks cannot be told in this step. They stop at their
                    # next collective (the strategy's hang watchdog, or the process group's timeout)
                    if failure.error is not None:
                        raise failure.error
                    raise OOMRecoveryError(
                        f"{self.owner}: rank {self.rank} ran out of memory before the model's forward started, where"
                        f" the other ranks cannot be told within the step: {failure.description}"
                    )
        # the step failed on some rank: no rank steps on it. Undo what the attempt changed, on every rank (in a
        # window, its earlier batches' gradients come back)
        self.rollback.restore()
        _unstash_grads(self.params, window_grads)
        return None, failure

    def _finish_failed_step(
        self, ddp: DistributedDataParallel, flag: StepFlag, failure: _LocalFailure, kwargs: OrderedDict
    ) -> bool:
        replay = self._replay_pass(kwargs) if self.sync_bn else None
        try:
            with PASS_LEDGER.replaying():
                return flag.finish_failed_step(ddp, replay=replay)
        except Exception:
            # the replay of training_step failed too (the same error again, most likely): the other ranks are left
            # in their BatchNorm collectives, and stop at the strategy's hang watchdog or the group's timeout
            if failure.error is not None:
                raise failure.error from None
            raise

    def _replay_pass(self, kwargs: OrderedDict) -> Any:
        """A function that runs the training step again on the batch's first sample, for its collectives only.

        It calls ``training_step`` directly, not through DDP's forward (which would broadcast again what it broadcast
        before the failure), under the precision plugin's context, with the step's ``self.log`` calls dropped. Its
        metric updates and normalization statistics are undone with the failed attempt's.
        """
        piece = OrderedDict(kwargs)
        piece["batch"] = slice_batch(kwargs["batch"], 0, 1)
        module = self.pl_module

        def replay() -> Tensor:
            with self.trainer.strategy.precision_plugin.train_step_context(), capture_logs(module, [], 1):
                output = module.training_step(*piece.values())
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, Tensor):
                raise OOMRecoveryError(
                    f"{self.owner}: rank {self.rank} ran out of memory in a model with synchronized BatchNorm, and"
                    " its training_step returned no loss when run again on one sample, so the collectives the other"
                    " ranks wait in cannot be finished."
                )
            return loss.float().sum()

        return replay

    def _train_pieces(
        self,
        loop: "BackoffOptimization",
        kwargs: OrderedDict,
        pending: list[tuple[Any, int]],
        total: int,
        backward_fn: Any,
        done: list[_Piece],
    ) -> _LocalFailure | None:
        while pending:
            allocated_before = cuda_allocated_bytes()
            failure = self._train_piece(loop, kwargs, pending[0], total, backward_fn, done)
            if failure is not None:
                if failure.kind == RECOVERABLE_OOM:
                    # only now, outside the except block, are the failed attempt's frames and activations gone
                    release_memory(allocated_before)
                if self.sync_bn:
                    self._replay_piece(kwargs, pending[0])
                return failure
            pending.pop(0)
            if self.sync_bn:
                return None  # the ranks agree after every micro-batch: each one's collectives must be matched
        return None

    def _replay_piece(self, kwargs: OrderedDict, pending_piece: tuple[Any, int]) -> None:
        """Issue the synchronised BatchNorm collectives a failed micro-batch (under ``no_sync``) left undone."""
        piece_kwargs = OrderedDict(kwargs)
        piece_kwargs["batch"] = pending_piece[0]
        stashed = _stash_grads(self.params)
        try:
            with PASS_LEDGER.replaying(), self._no_sync():
                self._replay_pass(piece_kwargs)().mul(0.0).backward()
        finally:
            _unstash_grads(self.params, stashed)
        self.rollback.restore()

    def _train_piece(
        self,
        loop: "BackoffOptimization",
        kwargs: OrderedDict,
        pending_piece: tuple[Any, int],
        total: int,
        backward_fn: Any,
        done: list[_Piece],
    ) -> _LocalFailure | None:
        piece, samples = pending_piece
        weight = samples / total if self.loss_reduction == "mean" else 1.0
        logs: list[LogCall] = []
        saved = stashing = False
        stashed = None
        try:
            self.rollback.save()
            saved = True
            stashed, stashing = _stash_grads(self.params), True
            PASS_LEDGER.start_pass()
            with self._no_sync(), capture_logs(self.pl_module, logs, samples):
                piece_kwargs = OrderedDict(kwargs)
                piece_kwargs["batch"] = piece
                output, detached = _step_and_backward(loop, piece_kwargs, backward_fn, weight, share=samples / total)
        except Exception as err:
            if stashing:
                _unstash_grads(self.params, stashed)
            if saved:
                self.rollback.restore()
            return _LocalFailure.of(err)
        _merge_stashed_grads(self.params, stashed)
        done.append(_Piece(samples, detached, output.extra, logs))
        return None

    # ------------------------------------------------------------------------------------------ agreement
    def _agree(
        self,
        failure: _LocalFailure | None,
        proposal: int,
        with_grad_mask: bool,
        total: int,
        stashed: list[Tensor | None] | None = None,
    ) -> dict[str, Any]:
        oom = failure is not None and failure.kind == RECOVERABLE_OOM
        fatal = failure is not None and failure.kind != RECOVERABLE_OOM
        policy = self.policy
        # whether every rank may go back to whole batches after this batch: each ran its whole batch as one piece
        # (a probe that reached it, or a batch no larger than the micro-batch), and some rank probed
        size_run = policy.probe_size if policy.probe_size is not None else policy.micro_batch_size
        fits_whole = size_run is None or size_run >= total
        header = [
            failure.kind if fatal else NO_FAILURE,
            self.rank + 1 if fatal else 0,
            self.rank + 1 if oom else 0,
            -proposal,
            0 if fits_whole else 1,
            1 if policy.probing else 0,
            total,
            -total,
        ]
        mask = [p.grad is not None for p in self.params] if with_grad_mask else []
        if mask and stashed is not None:  # the window's earlier batches' gradients, set aside meanwhile
            mask = [m or old is not None for m, old in zip(mask, stashed, strict=True)]
        if self.world_size > 1:
            vector = torch.tensor(header + [int(m) for m in mask], dtype=torch.int64, device=self.flag_device)
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group)
            values = vector.tolist()
            header, mask = values[: len(header)], [bool(v) for v in values[len(header) :]]
        return {
            "fatal_kind": header[0],
            "fatal_rank": header[1] - 1,
            "oom_rank": header[2] - 1 if header[2] else None,
            "size": -header[3],
            "whole_everywhere": header[4] == 0 and header[5] == 1,
            "same_batch_size": header[6] == -header[7],
            "has_grad": mask,
        }

    def _fail(self, failure: _LocalFailure | None, agreed: dict[str, Any], size: int, total: int) -> None:
        if failure is not None and failure.kind in (OTHER_ERROR, AFTER_BACKWARD_FAILURE) and failure.error is not None:
            # a real error of this rank's training step (or a hook after its backward): re-raise it as it is
            raise failure.error
        if failure is not None and failure.kind == OOM_AT_FLOOR:
            raise OOMRecoveryError(self.reporter.floor_message(self.rank, size, total, failure.description))
        if failure is not None and failure.kind in (OPTIMIZER_STEP_OOM, AFTER_BACKWARD_FAILURE):
            raise OOMRecoveryError(failure.description)
        rank, kind = agreed["fatal_rank"], agreed["fatal_kind"]
        reason = {
            OOM_AT_FLOOR: "ran out of memory at the smallest micro-batch size",
            OPTIMIZER_STEP_OOM: "ran out of memory inside the optimizer step",
            AFTER_BACKWARD_FAILURE: "failed in a hook after the backward, its gradients reduced",
            OTHER_ERROR: "raised an error that is not an out-of-memory error (see that rank's traceback)",
        }[kind]
        raise OOMRecoveryError(f"{self.owner}: rank {rank} {reason}; every rank stops.")

    def check_peers(self, where: str) -> None:
        """Raise on every rank if a rank's optimizer step ran out of memory earlier. Collective."""
        failed = self.pending_failure is not None
        if self.world_size > 1:
            flag = torch.tensor([self.rank + 1 if failed else 0], dtype=torch.int64, device=self.flag_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            rank = int(flag.item()) - 1
        else:
            rank = self.rank if failed else -1
        if rank < 0:
            return
        if failed:
            if self.pending_error is not None:
                raise self.pending_error
            raise OOMRecoveryError(self.pending_failure)
        raise OOMRecoveryError(
            f"{self.owner}: rank {rank} failed after its gradients were complete (an out-of-memory error inside the"
            f" optimizer step, or an error in a hook after the backward); every rank stops {where}."
        )

    def close(self) -> None:
        """Let go of the side group (a local operation)."""
        if self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = None

    # ------------------------------------------------------------------------------------------ DDP details
    @contextmanager
    def _no_sync(self) -> Iterator[None]:
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    def _broadcast_buffers(self, first_of_window: bool) -> None:
        ddp = self.ddp
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

    def _closure_result(self, done: list[_Piece]) -> ClosureResult:
        losses = [piece.loss for piece in done if piece.loss is not None]
        total_loss = torch.stack(losses).sum() if len(losses) > 1 else (losses[0] if losses else None)
        if len(done) == 1:
            extra = done[0].extra
        else:
            extra = merge_outputs([piece.extra for piece in done], [piece.samples for piece in done])
        return ClosureResult(total_loss, extra=extra)


def _stash_grads(params: list[Tensor]) -> list[Tensor | None] | None:
    """Set existing gradients aside so a failed backward cannot leave half of its gradients added to them."""
    if all(p.grad is None for p in params):
        return None
    stashed = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stashed


def _unstash_grads(params: list[Tensor], stashed: list[Tensor | None] | None) -> None:
    for index, p in enumerate(params):
        p.grad = stashed[index] if stashed is not None else None


def _merge_stashed_grads(params: list[Tensor], stashed: list[Tensor | None] | None) -> None:
    if stashed is None:
        return
    with torch.no_grad():
        for p, old in zip(params, stashed, strict=True):
            if old is None:
                continue
            if p.grad is not None:
                old.add_(p.grad)
            # accumulate into the original tensors: DDP may hold them as bucket views
            p.grad = old


def _raised(flag: StepFlag, reductions_before: int) -> bool:
    """Whether a rank raised the flag in this step's reduction: on the CPU a memory load, on a GPU a wait for it."""
    if flag.reductions == reductions_before:
        return False  # no synchronised backward ran (a step without a loss)
    return flag.raised_on_host()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


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
            message = self.runner.reporter.optimizer_step_message(self.runner.rank, _first_line(err))
            if self.runner.world_size == 1:
                raise OOMRecoveryError(message) from err
            # other ranks may have stepped already. This rank counts the step as done, so that it follows exactly
            # the control flow of the others (max_steps, checkpoint triggers, validation), and carries on until the
            # next point where every rank meets: the next batch's agreement, the start of validation, a checkpoint
            # save or the end of training. There every rank stops together, and no checkpoint is written.
            if not compat.should_accumulate(self.trainer):
                self.optim_progress.optimizer.step.increment_completed()
            self.runner.pending_kind, self.runner.pending_failure = OPTIMIZER_STEP_OOM, message
        if self.runner.pending_failure is not None:
            release_memory()
