"""This rank's side of :class:`~lightning_mgpu.OOMBackoff`'s training: the fit's state, and its micro-batches.

:class:`BatchRunner` holds what every path of the recovery reads and writes for the fit (the model and its DDP
wrap, the rollback of an attempt's side effects, a failure carried to the next meeting point, a backoff made alone
in an accumulation window), and runs micro-batches on this rank: each under DDP's ``no_sync()``, its gradients
added to the batch's, its ``self.log`` calls held back, its side effects undone if it fails.
"""

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.core.batch_split import slice_batch
from lightning_mgpu.core.distributed_batchnorm import CollectiveLedger, ledgers_of, replaying
from lightning_mgpu.core.step_pieces import LogCall, capture_logs, merge_outputs
from lightning_mgpu.core.step_service import StepService, step_service
from lightning_mgpu.ddp.step_flag import StepFlag
from lightning_mgpu.memory.oom import cuda_allocated_bytes, release_memory
from lightning_mgpu.memory.oom_agreement import LocalFailure, OOMRecoveryError
from lightning_mgpu.memory.step_rollback import AttemptState, StepRollback


class TrainingStepLoop(Protocol):
    """The part of Lightning's automatic optimization a piece runs: its training step."""

    def training_step(self, kwargs: OrderedDict) -> ClosureResult:
        """Run the module's training step on ``kwargs``."""


class Piece:
    """What one micro-batch that succeeded left behind."""

    __slots__ = ("extra", "logs", "loss", "samples")

    def __init__(self, samples: int, loss: Tensor | None, extra: dict[str, Any], logs: list[LogCall]) -> None:
        self.samples, self.loss, self.extra, self.logs = samples, loss, extra, logs


def step_and_backward(
    loop: TrainingStepLoop,
    kwargs: OrderedDict,
    backward_fn: Any,
    weight: float,
    grad_scale: float = 1.0,
    losses: list[Tensor] | None = None,
    share: float = 1.0,
    service: StepService | None = None,
) -> tuple[ClosureResult, Tensor | None]:
    """Run Lightning's training step on ``kwargs`` and the backward of its loss times ``weight``.

    ``grad_scale`` multiplies the gradient the backward starts from, not the loss the hooks and loggers see (the
    step flag's hooks leave the division by the world size to it). ``losses`` receives the loss before the backward.
    ``share`` is the piece's share of its batch, told to the backward's hooks through the fit's ``service``
    (:meth:`~lightning_mgpu.core.step_service.StepService.in_piece`).

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
        if service is None or share == 1.0:
            backward_fn(loss)
        else:
            with service.in_piece(share):
                backward_fn(loss)
    return output, (loss.detach() if loss is not None else None)


def with_batch(kwargs: OrderedDict, batch: Any) -> OrderedDict:
    """``kwargs`` of the training step with ``batch`` in place of its batch."""
    piece_kwargs = OrderedDict(kwargs)
    piece_kwargs["batch"] = batch
    return piece_kwargs


class BatchRunner:
    """The fit's state shared by OOMBackoff's training paths, and the micro-batches this rank runs.

    Args:
        trainer: the trainer, after the strategy wrapped the model.
        loss_reduction: ``"mean"`` if the loss is a mean over the batch's samples, ``"sum"`` if it is a sum.
        owner: the callback's class name, for the errors.
    """

    def __init__(self, trainer: "pl.Trainer", loss_reduction: str, owner: str) -> None:
        self.trainer = trainer
        self.pl_module = trainer.lightning_module
        self.loss_reduction = loss_reduction
        self.owner = owner
        strategy = trainer.strategy
        self.service = step_service(trainer)
        self.ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
        self.world_size = trainer.world_size
        self.rank = trainer.global_rank
        self.whole_batches = 0  # batches that took the whole-batch path
        # callbacks whose per-step state an attempt changes (NaNSkip's loss verdicts): a dropped attempt's goes too
        participants = [callback for callback in trainer.callbacks if isinstance(callback, AttemptState)]
        self.rollback = StepRollback(self.pl_module, participants)
        # synchronised BatchNorm runs collectives in every training pass: a rank that fails part way replays the
        # rest of them, and every rank runs the same micro-batches
        # (the ledgers count the layers' collectives in a pass, for a replay to skip the ones issued already)
        self.ledgers: list[CollectiveLedger] = ledgers_of(self.pl_module)
        self.sync_bn = self.world_size > 1 and bool(self.ledgers)
        self.batch_rollback = StepRollback(self.pl_module, participants) if self.sync_bn else None
        self.params: list[Tensor] = []  # listed again at every batch that needs them
        # a failure after the gradients were complete (the optimizer step's OOM, a hook after the backward), carried
        # to the next point where every rank meets
        self.pending: LocalFailure | None = None
        # the micro-batch size this rank backed off to alone, earlier in the accumulation window under way: every rank
        # hears of it at the window's last batch
        self.window_size: int | None = None

    @property
    def flag(self) -> StepFlag | None:
        """The flag the strategy carries in the gradient all-reduce, if it carries one."""
        flag = self.service.flag
        return flag if isinstance(flag, StepFlag) else None

    def flag_carried(self) -> bool:
        """Whether a failure on this batch can reach every rank without a collective of its own."""
        if self.world_size == 1:
            return True
        return self.ddp is not None and self.flag is not None and self.service.flag_carried

    def start_pass(self) -> None:
        """A new training pass for the synchronised BatchNorm layers' ledgers: nothing issued yet."""
        for ledger in self.ledgers:
            ledger.start_pass()

    def trainable_params(self) -> list[Tensor]:
        """Listed per batch that needs them: layers a fine-tuning callback unfroze since are accumulated too."""
        return [p for p in self.pl_module.parameters() if p.requires_grad]

    def list_params(self) -> list[Tensor]:
        """List :attr:`params` again, and return them."""
        self.params = self.trainable_params()
        return self.params

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()``, if the model is wrapped in DDP."""
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    # ----------------------------------------------------------------------------------------- micro-batches
    def train_pieces(
        self,
        loop: TrainingStepLoop,
        kwargs: OrderedDict,
        pending: list[tuple[Any, int]],
        total: int,
        backward_fn: Any,
        done: list[Piece],
    ) -> LocalFailure | None:
        """Run the pending micro-batches in order, moving each that succeeds from ``pending`` to ``done``.

        Stops at the first failure (its side effects undone), and, with synchronized BatchNorm, after one micro-batch:
        the ranks agree after each, so that their collectives match.
        """
        while pending:
            allocated_before = cuda_allocated_bytes()
            failure = self._train_piece(loop, kwargs, pending[0], total, backward_fn, done)
            if failure is not None:
                if failure.recoverable:
                    # only now, outside the except block, are the failed attempt's frames and activations gone
                    release_memory(allocated_before)
                if self.sync_bn:
                    self._replay_piece(kwargs, pending[0])
                return failure
            pending.pop(0)
            if self.sync_bn:
                return None  # the ranks agree after every micro-batch: each one's collectives must be matched
        return None

    def _train_piece(
        self,
        loop: TrainingStepLoop,
        kwargs: OrderedDict,
        pending_piece: tuple[Any, int],
        total: int,
        backward_fn: Any,
        done: list[Piece],
    ) -> LocalFailure | None:
        piece, samples = pending_piece
        weight = samples / total if self.loss_reduction == "mean" else 1.0
        logs: list[LogCall] = []
        saved = stashing = False
        stashed = None
        try:
            self.rollback.save()
            saved = True
            stashed, stashing = stash_grads(self.params), True
            self.start_pass()
            with self.no_sync(), capture_logs(self.pl_module, logs, samples):
                piece_kwargs = with_batch(kwargs, piece)
                output, detached = step_and_backward(
                    loop, piece_kwargs, backward_fn, weight, share=samples / total, service=self.service
                )
        except Exception as err:
            if stashing:
                unstash_grads(self.params, stashed)
            if saved:
                self.rollback.restore()
            return LocalFailure.of(err)
        merge_stashed_grads(self.params, stashed)
        done.append(Piece(samples, detached, output.extra, logs))
        return None

    def _replay_piece(self, kwargs: OrderedDict, pending_piece: tuple[Any, int]) -> None:
        """Issue the synchronised BatchNorm collectives a failed micro-batch (under ``no_sync``) left undone."""
        piece_kwargs = with_batch(kwargs, pending_piece[0])
        stashed = stash_grads(self.params)
        try:
            with replaying(self.ledgers), self.no_sync():
                self.replay_pass(piece_kwargs)().mul(0.0).backward()
        finally:
            unstash_grads(self.params, stashed)
        self.rollback.restore()

    def replay_pass(self, kwargs: OrderedDict) -> Any:
        """A function that runs the training step again on the batch's first sample, for its collectives only.

        It calls ``training_step`` directly, not through DDP's forward (which would broadcast again what it broadcast
        before the failure), under the precision plugin's context, with the step's ``self.log`` calls dropped. Its
        metric updates and normalization statistics are undone with the failed attempt's.
        """
        piece = with_batch(kwargs, slice_batch(kwargs["batch"], 0, 1))
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


def closure_result(done: list[Piece]) -> ClosureResult:
    """What Lightning's closure would have returned for the batch the pieces in ``done`` make up."""
    losses = [piece.loss for piece in done if piece.loss is not None]
    total_loss = torch.stack(losses).sum() if len(losses) > 1 else (losses[0] if losses else None)
    if len(done) == 1:
        extra = done[0].extra
    else:
        extra = merge_outputs([piece.extra for piece in done], [piece.samples for piece in done])
    return ClosureResult(total_loss, extra=extra)


def stash_grads(params: list[Tensor]) -> list[Tensor | None] | None:
    """Set existing gradients aside so a failed backward cannot leave half of its gradients added to them."""
    if all(p.grad is None for p in params):
        return None
    stashed = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stashed


def unstash_grads(params: list[Tensor], stashed: list[Tensor | None] | None) -> None:
    """Put back the gradients :func:`stash_grads` set aside (none, if it set none aside)."""
    for index, p in enumerate(params):
        p.grad = stashed[index] if stashed is not None else None


def merge_stashed_grads(params: list[Tensor], stashed: list[Tensor | None] | None) -> None:
    """Add the gradients :func:`stash_grads` set aside to the ones computed since."""
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
