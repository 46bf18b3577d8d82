"""Where :class:`~lightning_mgpu.OOMBackoff` runs a training batch: micro-batches, the ranks' agreement, the reduce.

Lightning's automatic optimization builds a closure (``training_step``, ``zero_grad``, ``backward``) that the
optimizer calls. An exception escaping it tears the trainer down, so the retry loop replaces that closure: the
epoch loop's ``automatic_optimization`` object is swapped for a subclass whose closure runs the batch as
micro-batches and retries what ran out of memory.

One batch, on every rank:

1. Every micro-batch runs forward and backward under DDP's ``no_sync()``: no gradient collective is in flight
   while a rank may still run out of memory (the deadlock Composer documents for an OOM in the backward).
2. The ranks agree through one small all-reduce on the host: who ran out of memory, the largest micro-batch size
   that every rank can take, who failed for good. A rank whose micro-batches all succeeded keeps them; only the
   rank that failed recomputes the samples it had not finished, in smaller micro-batches. Rounds repeat until no
   rank retries.
3. The gradients are averaged across ranks once, in buckets, as DDP would have done during the backward.

The sizes come from a :class:`~lightning_mgpu.utilities.micro_batch_policy.MicroBatchSizePolicy`, told only what
every rank agreed on; the callback prints, records and words the errors (:class:`BackoffReporter`).
"""

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
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

from lightning_mgpu import compat
from lightning_mgpu.utilities.batch_split import batch_size_of, slice_batch, split_batch
from lightning_mgpu.utilities.grad_allreduce import DEFAULT_BUCKET_BYTES, average_gradients
from lightning_mgpu.utilities.host_group import host_side_group
from lightning_mgpu.utilities.micro_batch_policy import MicroBatchSizePolicy
from lightning_mgpu.utilities.oom import is_out_of_memory, release_memory
from lightning_mgpu.utilities.step_pieces import LogCall, capture_logs, merge_outputs, replay_logs
from lightning_mgpu.utilities.step_rollback import StepRollback

# a local out-of-memory error that a smaller micro-batch may fix
RECOVERABLE_OOM = -1
# fatal causes, in rising precedence (the agreement takes the maximum)
NO_FAILURE, OOM_AT_FLOOR, OPTIMIZER_STEP_OOM, OTHER_ERROR = 0, 1, 2, 3
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
        self.world_size = trainer.world_size
        self.rank = trainer.global_rank
        self.rollback = StepRollback(self.pl_module)
        self.params: list[Tensor] = []  # listed again at every batch
        self.pending_failure: str | None = None
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
        # listed per batch: layers a fine-tuning callback unfroze since the last batch are averaged too
        self.params = [p for p in self.pl_module.parameters() if p.requires_grad]
        zero_grad_fn = loop.zero_grad_fn(batch_idx, optimizer)
        backward_fn = loop.backward_fn(optimizer)
        accumulating = not self.trainer.strategy.handles_gradient_accumulation and compat.should_accumulate(
            self.trainer
        )
        reduce_now = self.ddp is not None and not accumulating
        if self.ddp is not None:
            self._broadcast_buffers(first_of_window=zero_grad_fn is not None)
        if zero_grad_fn is not None:
            zero_grad_fn()

        size = self.policy.start_batch(total)
        pending = split_batch(batch, size) if splittable else [(batch, 1)]
        done: list[_Piece] = []
        while True:
            failure = None
            if self.pending_failure is not None:
                failure = _LocalFailure(OPTIMIZER_STEP_OOM, self.pending_failure)
            elif pending:
                failure = self._train_pieces(loop, kwargs, pending, total, backward_fn, done)
            proposal = _NO_PROPOSAL
            if failure is not None and failure.kind == RECOVERABLE_OOM:
                smaller = self.policy.smaller_size(size) if splittable else None
                if smaller is None:
                    failure.kind = OOM_AT_FLOOR
                else:
                    proposal = smaller
            agreed = self._agree(failure, proposal, reduce_now)
            if agreed["fatal_kind"] != NO_FAILURE:
                self._fail(failure, agreed, size, total)
            if agreed["oom_rank"] is None:
                break
            probing = self.policy.probing
            self.policy.back_off(agreed["size"])
            self.reporter.report_backoff(size, agreed["size"], agreed["oom_rank"], total, probing)
            size = agreed["size"]
            finished = sum(piece.samples for piece in done)
            pending = split_batch(slice_batch(batch, finished, total), size) if finished < total else []

        probed = self.policy.batch_succeeded()
        if probed is not None:
            self.reporter.report_probe_success(probed)
        logs = [call for piece in done for call in piece.logs]
        replay_logs(self.pl_module, logs, "training_step")
        if reduce_now:
            average_gradients(
                self.params,
                agreed["has_grad"],
                self.world_size,
                group=self.ddp.process_group,
                bucket_bytes=getattr(self.ddp, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES),
            )
            # as after DDP's own synchronised backward: the next forward (a validation one included) broadcasts
            # the buffers from rank 0
            self.ddp.require_forward_param_sync = True
        return self._closure_result(done)

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
            allocated_before = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
            failure = self._train_piece(loop, kwargs, pending[0], total, backward_fn, done)
            if failure is not None:
                if failure.kind == RECOVERABLE_OOM:
                    # only now, outside the except block, are the failed attempt's frames and activations gone
                    release_memory(allocated_before)
                return failure
            pending.pop(0)
        return None

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
            with self._no_sync(), capture_logs(self.pl_module, logs, samples):
                piece_kwargs = OrderedDict(kwargs)
                piece_kwargs["batch"] = piece
                output = loop.training_step(piece_kwargs)
                loss = output.closure_loss
                if loss is not None and weight != 1.0:
                    loss = loss * weight
                if loss is not None and backward_fn is not None:
                    backward_fn(loss)
                detached = loss.detach() if loss is not None else None
                extra = output.extra
            del output, loss
        except Exception as err:
            if stashing:
                _unstash_grads(self.params, stashed)
            if saved:
                self.rollback.restore()
            if not is_out_of_memory(err):
                return _LocalFailure(OTHER_ERROR, f"{type(err).__name__}: {err}", err)
            return _LocalFailure(RECOVERABLE_OOM, _first_line(err))
        _merge_stashed_grads(self.params, stashed)
        done.append(_Piece(samples, detached, extra, logs))
        return None

    # ------------------------------------------------------------------------------------------ agreement
    def _agree(self, failure: _LocalFailure | None, proposal: int, with_grad_mask: bool) -> dict[str, Any]:
        oom = failure is not None and failure.kind == RECOVERABLE_OOM
        fatal = failure is not None and failure.kind != RECOVERABLE_OOM
        header = [
            failure.kind if fatal else NO_FAILURE,
            self.rank + 1 if fatal else 0,
            self.rank + 1 if oom else 0,
            -proposal,
        ]
        mask = [p.grad is not None for p in self.params] if with_grad_mask else []
        if self.world_size > 1:
            vector = torch.tensor(header + [int(m) for m in mask], dtype=torch.int64, device=self.flag_device)
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group)
            values = vector.tolist()
            header, mask = values[:4], [bool(v) for v in values[4:]]
        return {
            "fatal_kind": header[0],
            "fatal_rank": header[1] - 1,
            "oom_rank": header[2] - 1 if header[2] else None,
            "size": -header[3],
            "has_grad": mask,
        }

    def _fail(self, failure: _LocalFailure | None, agreed: dict[str, Any], size: int, total: int) -> None:
        if failure is not None and failure.kind == OTHER_ERROR and failure.error is not None:
            # a real error of this rank's training step: re-raise it as it is
            raise failure.error
        if failure is not None and failure.kind == OOM_AT_FLOOR:
            raise OOMRecoveryError(self.reporter.floor_message(self.rank, size, total, failure.description))
        if failure is not None and failure.kind == OPTIMIZER_STEP_OOM:
            raise OOMRecoveryError(failure.description)
        rank, kind = agreed["fatal_rank"], agreed["fatal_kind"]
        reason = {
            OOM_AT_FLOOR: "ran out of memory at the smallest micro-batch size",
            OPTIMIZER_STEP_OOM: "ran out of memory inside the optimizer step",
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
            raise OOMRecoveryError(self.pending_failure)
        raise OOMRecoveryError(
            f"{self.owner}: rank {rank} ran out of memory inside the optimizer step; every rank stops {where}."
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
            for buffer in ddp.module.buffers():
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
            self.runner.pending_failure = message
        if self.runner.pending_failure is not None:
            release_memory()
