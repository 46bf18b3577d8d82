"""The micro-batch size :class:`~lightning_mgpu.OOMBackoff` trains with: the start, the backoff, the probe up.

Plain Python: no Trainer, no process group, no device. The callback and its runner ask it for sizes and tell it
what happened; under several processes every rank holds the same policy and is told the same things (the sizes
were agreed before), so every rank's policy takes the same decisions.
"""

from typing import Any

from lightning_mgpu.core.validation import check_int

__all__ = ["MicroBatchSizePolicy"]


class MicroBatchSizePolicy:
    """Chooses the training and evaluation micro-batch sizes after out-of-memory errors.

    Training: a batch runs whole until the first out-of-memory error; each error halves the size, down to
    ``min_size``, and the size that worked is kept for the next batches. With ``probe_up_after=N``, after ``N``
    batches in a row without an error the next batch tries twice the size (at most the whole batch); a probe that
    runs out of memory goes back to the size that worked and doubles the wait before the next probe. Evaluation
    has a size of its own, which only ever goes down.

    Call :meth:`start_batch` with each training batch's size, :meth:`smaller_size` after an out-of-memory error,
    :meth:`back_off` with the size adopted (under several processes, the one every rank agreed on), and
    :meth:`batch_succeeded` once the batch is done.

    Args:
        min_size: the smallest micro-batch, in samples; an out-of-memory error at this size is not recovered.
        probe_up_after: batches without an out-of-memory error before a probe upwards; ``None`` never probes.

    Example::

        policy = MicroBatchSizePolicy(min_size=2, probe_up_after=100)
        size = policy.start_batch(64)  # 64: the whole batch until an error
        policy.back_off(policy.smaller_size(size))  # ran out of memory: 32 from now on
    """

    def __init__(self, min_size: int = 1, probe_up_after: int | None = None) -> None:
        owner = type(self).__name__
        check_int(owner, "min_size", min_size, minimum=1)
        check_int(owner, "probe_up_after", probe_up_after, minimum=1, allow_none=True)
        self.min_size = min_size
        self.probe_up_after = probe_up_after
        # None: the whole batch (no out-of-memory error yet, or a probe climbed back to the whole batch)
        self.micro_batch_size: int | None = None
        self.eval_micro_batch_size: int | None = None
        self.recoveries = 0
        self.good_batches = 0
        self.probe_wait = probe_up_after
        self.last_batch_size = 0
        self.probe_size: int | None = None  # set while the current batch is a probe upwards

    @property
    def probing(self) -> bool:
        """Whether the current batch is a probe upwards that has not run out of memory yet."""
        return self.probe_size is not None

    # ------------------------------------------------------------------------------------------------ training
    def start_batch(self, total: int) -> int:
        """The micro-batch size to start a training batch of ``total`` samples with (a probe, when one is due)."""
        self.last_batch_size = total
        self.probe_size = None
        if self.micro_batch_size is None:
            return total
        probe_due = self.probe_wait is not None and self.good_batches >= self.probe_wait
        if probe_due and self.micro_batch_size < total:
            self.probe_size = min(total, 2 * self.micro_batch_size)
            return self.probe_size
        return min(self.micro_batch_size, total)

    def smaller_size(self, size: int) -> int | None:
        """The size to propose after running out of memory at ``size``: half of it, or ``None`` at the floor.

        A probe that fails proposes the size that worked before it.
        """
        if self.probing and self.micro_batch_size is not None:
            return self.micro_batch_size
        if size <= self.min_size:
            return None
        return max(self.min_size, size // 2)

    def back_off(self, size: int) -> None:
        """Adopt ``size`` after an out-of-memory error: a recovery, or a failed probe (which doubles the wait)."""
        if self.probing:
            self.probe_wait = 2 * (self.probe_wait or 1)
            self.probe_size = None
        else:
            self.recoveries += 1
        self.good_batches = 0
        self.micro_batch_size = size

    def batch_succeeded(self, back_to_whole: bool = True) -> int | None:
        """Record a training batch that finished; returns the probe's size if it was a probe that succeeded.

        Args:
            back_to_whole: whether a probe that took the whole batch returns to whole batches; under several
                processes, only when it did so on every rank (so that every rank takes the same path next).
        """
        probe = self.probe_size
        self.probe_size = None
        if probe is not None:
            self.micro_batch_size = None if probe >= self.last_batch_size and back_to_whole else probe
            self.good_batches = 0
            return probe
        if self.micro_batch_size is not None:
            self.good_batches += 1
        return None

    # ---------------------------------------------------------------------------------------------- evaluation
    def start_eval_batch(self, total: int) -> int:
        """The micro-batch size to start an evaluation batch of ``total`` samples with."""
        return min(self.eval_micro_batch_size or total, total)

    def eval_back_off(self, size: int) -> int | None:
        """After evaluation ran out of memory at ``size``: the halved size, adopted; ``None`` at the floor."""
        if size <= self.min_size:
            return None
        self.eval_micro_batch_size = max(self.min_size, size // 2)
        return self.eval_micro_batch_size

    # -------------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain values for the checkpoint; the keys are the ones ``OOMBackoff`` has always saved."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "eval_micro_batch_size": self.eval_micro_batch_size,
            "recoveries": self.recoveries,
            "good_batches": self.good_batches,
            "probe_wait": self.probe_wait,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values; a missing key (an older checkpoint) takes its starting value."""
        self.micro_batch_size = state_dict.get("micro_batch_size")
        self.eval_micro_batch_size = state_dict.get("eval_micro_batch_size")
        self.recoveries = int(state_dict.get("recoveries", 0))
        self.good_batches = int(state_dict.get("good_batches", 0))
        self.probe_wait = state_dict.get("probe_wait", self.probe_up_after)
        self.probe_size = None
