"""Undo what a failed step did to a model as a side effect: normalization running statistics and metric states."""

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_mgpu.core import compat


@runtime_checkable
class AttemptState(Protocol):
    """State an object (a callback) keeps per optimizer step that a dropped attempt must not leave behind.

    :meth:`save_attempt` is called before each attempt at a batch or micro-batch and must be cheap (references, no
    copies, where the state is replaced rather than changed in place); :meth:`restore_attempt` gets its result back
    when the attempt is dropped. Saves nest (a batch's, then each of its micro-batches'), and one save may be
    restored more than once: a restore must put the state back to what it was at that save, whatever was restored
    since, not undo a difference.
    """

    def save_attempt(self) -> Any:
        """What :meth:`restore_attempt` needs to undo the attempt about to run."""
        ...

    def restore_attempt(self, saved: Any) -> None:
        """Undo what the dropped attempt changed, from :meth:`save_attempt`'s result."""
        ...


class StepRollback:
    """Save the state a forward pass changes as a side effect, and put it back after a failed attempt.

    Covers the running statistics of every BatchNorm / InstanceNorm layer that tracks them, the states of every
    ``torchmetrics.Metric`` that is a submodule (so ``update`` calls of an attempt that ran out of memory do not
    count), and the per-step state of ``participants`` (:class:`AttemptState`: ``NaNSkip``'s loss verdicts, say).
    State held anywhere else (a Python counter, a list on the module) cannot be seen and is not restored.

    Saving copies a few small tensors per layer into buffers allocated once (one ``_foreach_copy_`` launch on a
    GPU); restoring copies them back.

    Args:
        module: the model whose side-effect state is saved.
        participants: other holders of per-step state, saved and restored with it.

    Example::

        rollback = StepRollback(model)
        rollback.save()
        try:
            loss = model(batch).mean()
        except torch.OutOfMemoryError:
            rollback.restore()
    """

    def __init__(self, module: nn.Module, participants: Sequence[AttemptState] = ()) -> None:
        self._participants = list(participants)
        self._participant_states: list[Any] = []
        self._norms = [m for m in module.modules() if isinstance(m, compat.NormBase) and m.track_running_stats]
        self._buffers: list[Tensor] = []
        self._copies: list[Tensor] | None = None
        self._metrics: list[Metric] = [m for m in module.modules() if isinstance(m, Metric)]
        self._metric_states: list[dict[str, Any]] = []

    def save(self) -> None:
        """Remember the current statistics and metric states."""
        # read the buffers again each time: moving the model to a device or a dtype replaces them
        self._buffers = [
            buffer
            for norm in self._norms
            for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
            if buffer is not None
        ]
        if self._buffers:
            copies = self._copies
            if copies is None or len(copies) != len(self._buffers) or _moved(copies, self._buffers):
                self._copies = [torch.empty_like(b) for b in self._buffers]
            with torch.no_grad():
                compat.foreach_copy_(self._copies, self._buffers)
        self._metric_states = [_metric_state(metric) for metric in self._metrics]
        self._participant_states = [participant.save_attempt() for participant in self._participants]

    def restore(self) -> None:
        """Put back what :meth:`save` remembered."""
        for participant, saved in zip(self._participants, self._participant_states, strict=False):
            participant.restore_attempt(saved)
        if self._buffers and self._copies is not None:
            with torch.no_grad():
                compat.foreach_copy_(self._buffers, self._copies)
        for metric, state in zip(self._metrics, self._metric_states, strict=False):
            for name, value in state["states"].items():
                # a copy: the metric updates its states in place, and the snapshot may be restored again
                setattr(metric, name, list(value) if isinstance(value, list) else value.clone())
            compat.set_metric_progress(metric, state["progress"])


def _moved(copies: list[Tensor], buffers: list[Tensor]) -> bool:
    return any(c.device != b.device or c.dtype != b.dtype for c, b in zip(copies, buffers, strict=True))


def _metric_state(metric: Metric) -> dict[str, Any]:
    states: dict[str, Any] = {}
    for name, value in metric.metric_state.items():
        # list states ("cat" reduction) only grow by appends: a shallow copy of the list is enough
        states[name] = list(value) if isinstance(value, list) else value.detach().clone()
    return {"states": states, "progress": compat.metric_progress(metric)}
