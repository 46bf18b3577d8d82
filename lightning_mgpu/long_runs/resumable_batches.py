"""Start a map-style loader's epoch part-way through, in the interrupted run's order, without reading the skipped data.

A ``DataLoader`` draws its order when its sampler first yields: a ``DistributedSampler`` from its seed and epoch, a
``RandomSampler`` from the global torch stream (or its own generator). :class:`ResumableBatches` takes the loader's
place of index sampler, records the random streams at the moment each epoch's order is drawn, and, given a
:class:`ResumePoint`, replays that draw and passes over the batches already trained: only their indices are
produced, no sample is read. The streams the caller sees are left as they were.
"""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu.long_runs.random_states import (
    capture_random_states,
    generator_states,
    restore_random_states,
    set_generator_states,
)


@dataclass(frozen=True)
class ResumePoint:
    """Where an interrupted epoch stopped.

    Args:
        batches: batches of the epoch already trained, to pass over.
        epoch: the epoch, for samplers that take ``set_epoch``.
        epoch_start: the streams at the moment the epoch's order was drawn (:attr:`ResumableBatches.epoch_start`),
            or ``None`` when the saved run had not drawn one.
    """

    batches: int
    epoch: int
    epoch_start: dict[str, Any] | None


class ResumableBatches:
    """A loader's index sampler that records each epoch's random draw and can resume an epoch part-way.

    Everything but iteration is the wrapped sampler's: ``len``, ``batch_size``, ``drop_last``, ``sampler``,
    ``set_epoch``.

    Args:
        inner: the loader's ``batch_sampler`` (or its ``sampler`` when it does not batch).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        # the streams when the current epoch's order was drawn; saved in checkpoints to replay the draw
        self.epoch_start: dict[str, Any] | None = None
        self._resume: ResumePoint | None = None

    def resume_at(self, point: ResumePoint | None) -> None:
        """Make the next iteration replay ``point``'s epoch and pass over its trained batches (``None``: don't)."""
        self._resume = point

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: unpickling
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _owners(self) -> tuple[Any, ...]:
        return self.inner, getattr(self.inner, "sampler", None)

    def _capture(self) -> dict[str, Any]:
        return {"random": capture_random_states(), "generators": generator_states(*self._owners())}

    def __iter__(self) -> Iterator[Any]:
        # a generator: this body runs at the first batch request, when the inner sampler would draw its order
        point, self._resume = self._resume, None
        if point is None:
            self.epoch_start = self._capture()
            yield from self.inner
            return
        outside = capture_random_states()
        if point.epoch_start is not None:
            restore_random_states(point.epoch_start["random"])
            set_generator_states(self._owners(), point.epoch_start["generators"])
            self.epoch_start = point.epoch_start
        else:
            self.epoch_start = self._capture()
        for owner in self._owners():
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(point.epoch)
        iterator = iter(self.inner)
        for _ in itertools.islice(iterator, point.batches):
            pass
        restore_random_states(outside)
        yield from iterator


def unresumable_reason(loader: Any) -> str | None:
    """Why ``loader`` cannot be resumed part-way by :func:`make_resumable`, or ``None`` when it can."""
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"its dataset is an IterableDataset ({type(loader.dataset).__name__}) whose position only the dataset "
            "knows; give the loader state_dict()/load_state_dict() (torchdata's StatefulDataLoader) to resume it"
        )
    return None


def make_resumable(loader: DataLoader) -> ResumableBatches:
    """Put a :class:`ResumableBatches` in ``loader``'s place of index sampler (once) and return it.

    Raises:
        ValueError: the loader cannot be resumed part-way (:func:`unresumable_reason` says why).
    """
    reason = unresumable_reason(loader)
    if reason is not None:
        raise ValueError(f"cannot resume this loader part-way: {reason}")
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    current = getattr(loader, name)
    if isinstance(current, ResumableBatches):
        return current
    wrapper = ResumableBatches(current)
    # DataLoader refuses to set its samplers after construction (an iterator could be running): none is, here
    object.__setattr__(loader, name, wrapper)
    return wrapper
