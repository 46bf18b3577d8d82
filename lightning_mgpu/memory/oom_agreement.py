"""What the ranks agree on after each round of micro-batches of :class:`~lightning_mgpu.OOMBackoff`, and how.

A round ends with one small all-reduce (``MAX``) on the host, through a gloo side group under NCCL: each rank puts
in why its attempt stopped (:class:`LocalFailure`), the micro-batch size it proposes and a few flags, and every rank
reads back the same :class:`Agreement`. Its :meth:`Agreement.outcome` is the recovery's next state, the same on
every rank: stop, back off, go on with the samples left, or finish the batch.
"""

import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_mgpu.memory.oom import is_out_of_memory

NO_PROPOSAL = 2**62  # a rank that needs no smaller size proposes this (the agreement takes the smallest)


class OOMRecoveryError(RuntimeError):
    """Raised by :class:`OOMBackoff`, on every rank, when an out-of-memory error cannot be recovered from."""


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


class FailureKind(enum.IntEnum):
    """Why a rank's attempt stopped.

    The fatal kinds (above ``NONE``) rise in precedence: the agreement takes the highest one any rank reports.
    """

    RECOVERABLE_OOM = -1  # an out-of-memory error a smaller micro-batch may fix
    NONE = 0
    OOM_AT_FLOOR = 1
    OPTIMIZER_STEP_OOM = 2
    AFTER_BACKWARD_FAILURE = 3
    OTHER_ERROR = 4


# how the other ranks word a fatal failure of rank r: "rank r <reason>; every rank stops."
FATAL_REASONS = {
    FailureKind.OOM_AT_FLOOR: "ran out of memory at the smallest micro-batch size",
    FailureKind.OPTIMIZER_STEP_OOM: "ran out of memory inside the optimizer step",
    FailureKind.AFTER_BACKWARD_FAILURE: "failed in a hook after the backward, its gradients reduced",
    FailureKind.OTHER_ERROR: "raised an error that is not an out-of-memory error (see that rank's traceback)",
}


@dataclass(frozen=True)
class LocalFailure:
    """Why this rank's attempt stopped: an out-of-memory error to retry, or an error to stop on.

    ``error`` is the exception to raise again on this rank (one that is not an out-of-memory error), if any.
    """

    kind: FailureKind
    description: str
    error: BaseException | None = None

    @classmethod
    def of(cls, error: BaseException) -> "LocalFailure":
        """The failure ``error`` is: an out-of-memory error to retry, or any other error, kept to be raised again.

        An out-of-memory error is not kept: its frames hold the failed attempt's activations.
        """
        if is_out_of_memory(error):
            return cls(FailureKind.RECOVERABLE_OOM, first_line(error))
        return cls(FailureKind.OTHER_ERROR, f"{type(error).__name__}: {error}", error)

    @property
    def recoverable(self) -> bool:
        """Whether a smaller micro-batch may fix it."""
        return self.kind is FailureKind.RECOVERABLE_OOM


class Outcome(enum.Enum):
    """The recovery's next state after an agreement: the same on every rank."""

    STOP = "a rank failed for good: every rank raises"
    BACK_OFF = "a rank ran out of memory: every rank adopts the agreed size and runs the samples it has left"
    RESUME = "no rank ran out of memory but samples are left (the whole-batch attempt failed): run them"
    FINISH = "every rank ran every sample: the gradients are averaged once"


@dataclass(frozen=True)
class Agreement:
    """What every rank learnt from one round's all-reduce; equal on every rank.

    Attributes:
        fatal_kind: the highest fatal :class:`FailureKind` any rank reported (``NONE`` if none).
        fatal_rank: the highest rank that failed for good (-1 if none).
        oom_rank: the highest rank that ran out of memory recoverably, or ``None``.
        size: the smallest micro-batch size any rank proposed (:data:`NO_PROPOSAL` if none did).
        whole_everywhere: every rank ran its whole batch as one piece, and some rank probed: whole batches again.
        same_batch_size: every rank's batch has the same number of samples.
        has_grad: per parameter, whether any rank has a gradient for it (empty if not asked for).
    """

    fatal_kind: FailureKind = FailureKind.NONE
    fatal_rank: int = -1
    oom_rank: int | None = None
    size: int = NO_PROPOSAL
    whole_everywhere: bool = False
    same_batch_size: bool = True
    has_grad: tuple[bool, ...] = ()

    def outcome(self, samples_left: bool) -> Outcome:
        """The next state; ``samples_left``: whether this rank has samples of the batch still to run."""
        if self.fatal_kind is not FailureKind.NONE:
            return Outcome.STOP
        if self.oom_rank is not None:
            return Outcome.BACK_OFF
        return Outcome.RESUME if samples_left else Outcome.FINISH


@dataclass(frozen=True)
class Proposal:
    """What one rank puts into a round's agreement.

    Attributes:
        failure: why its attempt stopped, if it did.
        size: the micro-batch size it proposes (:data:`NO_PROPOSAL` if it needs no smaller one).
        fits_whole: it ran its whole batch as one piece.
        probing: its policy is probing a larger size.
        total: its batch's size.
        has_grad: per parameter, whether it has a gradient for it (empty if not asked for).
    """

    failure: LocalFailure | None
    size: int
    fits_whole: bool
    probing: bool
    total: int
    has_grad: tuple[bool, ...] = ()


class RankAgreement:
    """The ranks' small host-side all-reduces: one per round of micro-batches, and one at each meeting point.

    Args:
        rank: this process's global rank.
        world_size: the number of processes.
        group: the host-side group (``None``: the default one); unused with one process.
        device: where the all-reduced tensors live.
        owner: the callback's class name, for the errors.
    """

    def __init__(
        self, rank: int, world_size: int, group: dist.ProcessGroup | None, device: torch.device, owner: str
    ) -> None:
        self.rank, self.world_size, self.group, self.device, self.owner = rank, world_size, group, device, owner

    def agree(self, proposal: Proposal) -> Agreement:
        """Every rank's proposals combined; collective."""
        failure = proposal.failure
        oom = failure is not None and failure.recoverable
        fatal = failure is not None and not failure.recoverable
        header = [
            int(failure.kind) if fatal else 0,
            self.rank + 1 if fatal else 0,
            self.rank + 1 if oom else 0,
            -proposal.size,
            0 if proposal.fits_whole else 1,
            1 if proposal.probing else 0,
            proposal.total,
            -proposal.total,
        ]
        mask = proposal.has_grad
        if self.world_size > 1:
            vector = torch.tensor(header + [int(m) for m in mask], dtype=torch.int64, device=self.device)
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group)
            values = vector.tolist()
            header, mask = values[: len(header)], tuple(bool(v) for v in values[len(header) :])
        return Agreement(
            fatal_kind=FailureKind(header[0]),
            fatal_rank=header[1] - 1,
            oom_rank=header[2] - 1 if header[2] else None,
            size=-header[3],
            whole_everywhere=header[4] == 0 and header[5] == 1,
            same_batch_size=header[6] == -header[7],
            has_grad=mask,
        )

    def stop(self, failure: LocalFailure | None, agreed: Agreement, floor_message: Callable[[], str]) -> None:
        """Raise on this rank for a fatal agreement: its own error if it has one, else the rank that failed.

        ``floor_message``: words the error for this rank's own out-of-memory error at the smallest size.
        """
        kind = failure.kind if failure is not None else None
        if kind in (FailureKind.OTHER_ERROR, FailureKind.AFTER_BACKWARD_FAILURE) and failure.error is not None:
            # a real error of this rank's training step (or a hook after its backward): re-raise it as it is
            raise failure.error
        if kind is FailureKind.OOM_AT_FLOOR:
            raise OOMRecoveryError(floor_message())
        if kind in (FailureKind.OPTIMIZER_STEP_OOM, FailureKind.AFTER_BACKWARD_FAILURE):
            raise OOMRecoveryError(failure.description)
        reason = FATAL_REASONS[agreed.fatal_kind]
        raise OOMRecoveryError(f"{self.owner}: rank {agreed.fatal_rank} {reason}; every rank stops.")

    def check_peers(self, pending: LocalFailure | None, where: str) -> None:
        """Raise on every rank if a rank failed after its gradients were complete (``pending`` here). Collective."""
        failed = pending is not None
        if self.world_size > 1:
            flag = torch.tensor([self.rank + 1 if failed else 0], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            rank = int(flag.item()) - 1
        else:
            rank = self.rank if failed else -1
        if rank < 0:
            return
        if pending is not None:
            if pending.error is not None:
                raise pending.error
            raise OOMRecoveryError(pending.description)
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


def first_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
