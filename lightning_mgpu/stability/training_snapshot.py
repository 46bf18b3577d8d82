"""An in-memory snapshot of a training state, copied off the device without a host sync, for in-process rollback."""

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mgpu.core import compat
from lightning_mgpu.core.sharded_tensors import local_part


@dataclass
class _OptimizerCopy:
    groups: list[dict[str, Any]]  # every param group's settings but its params
    state: list[dict[str, Any] | None]  # per parameter (param_groups order): its state, tensors as slots in `saved`


@dataclass
class _Saved:
    step: int
    layout: tuple[Any, ...]  # what the state was made of (see TrainingSnapshot._layout)
    group_sizes: tuple[Any, ...]  # the cheap part of it (see TrainingSnapshot._group_sizes)
    optimizers: list[_OptimizerCopy]
    schedulers: list[dict[str, Any]]
    scaler_slots: list[int]
    extra: list[Any] = field(default_factory=list)


class TrainingSnapshot:
    """Copies of parameters, buffers, optimizer states, LR schedulers and a GradScaler, and restores them.

    :meth:`take` copies every tensor into host buffers allocated once (pinned, on CUDA) with non-blocking copies on a
    side stream, so the training thread never waits for them: the stream that trains waits on the copies' event on
    the device, so that nothing it queues later changes a tensor before it is copied. On the CPU the copies are plain
    ``memcpy``s. Under FSDP each rank saves its own shards. The snapshot belongs to the parameters and param groups
    it was taken with: :meth:`matches` says whether they are still the same (a fine-tuning callback may add a group).
    :meth:`restore` copies them back, in stream order, again with no host sync. The memory held is one copy of the
    parameters, the buffers and the optimizer states (:attr:`nbytes`).

    Args:
        module: the module whose parameters and buffers are saved.
        optimizers: the optimizers whose states and param-group settings are saved.
        schedulers: LR schedulers (anything with ``state_dict``/``load_state_dict``), saved as plain state dicts.
        scaler: a ``GradScaler`` whose scale and growth tracker are saved, or ``None``.
        extra: called at :meth:`take`; what it returns is deep-copied and given back to ``restore_extra``.
        restore_extra: called by :meth:`restore` with the copy ``extra`` made.

    Example::

        snapshot = TrainingSnapshot(model, [optimizer])
        snapshot.take(step=20)
        ...
        step = snapshot.restore()  # the state after step 20 is back
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        schedulers: Sequence[Any] = (),
        scaler: Any = None,
        extra: Callable[[], Any] | None = None,
        restore_extra: Callable[[Any], None] | None = None,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.scaler = scaler
        self.extra = extra
        self.restore_extra = restore_extra
        self._host: list[Tensor] = []  # one buffer per saved tensor, reused while shapes match
        self._saved: _Saved | None = None
        self._stream: Any = None
        self._devices: list[torch.device] = []

    @property
    def step(self) -> int | None:
        """The step of the snapshot held, ``None`` before the first :meth:`take`."""
        return self._saved.step if self._saved is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the snapshot holds."""
        return sum(t.numel() * t.element_size() for t in self._host)

    def _layout(self) -> tuple[Any, ...]:
        """The parameters and buffers of the module, and each optimizer's param groups, by identity."""
        module = tuple(id(t) for t in (*self.module.parameters(), *self.module.buffers()))
        groups = tuple(tuple(tuple(id(p) for p in g["params"]) for g in o.param_groups) for o in self.optimizers)
        return module, groups

    def _group_sizes(self) -> tuple[Any, ...]:
        """How many parameters each param group of each optimizer has: O(groups), cheap enough for every step."""
        return tuple(tuple(len(g["params"]) for g in o.param_groups) for o in self.optimizers)

    def matches(self) -> bool:
        """Whether a snapshot is held and the optimizers' param groups still have the sizes it saved.

        Cheap enough for every step: a fine-tuning callback that adds a group changes them. :meth:`restore` checks the
        parameters' identities too.
        """
        return self._saved is not None and self._saved.group_sizes == self._group_sizes()

    def _tensors(self) -> tuple[list[Tensor], list[_OptimizerCopy], list[int]]:
        """Every tensor to save in a fixed order, the optimizers' structure (tensors as slots), the scaler's slots."""
        tensors = [local_part(t.detach()) for t in (*self.module.parameters(), *self.module.buffers())]
        copies = []
        for optimizer in self.optimizers:
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            state: list[dict[str, Any] | None] = []
            for param in _params(optimizer):
                entry = optimizer.state.get(param)
                if not entry:
                    state.append(None)
                    continue
                saved = {}
                for key, value in entry.items():
                    if isinstance(value, Tensor):
                        saved[key] = _Slot(len(tensors))
                        tensors.append(local_part(value.detach()))
                    else:
                        saved[key] = copy.deepcopy(value)
                state.append(saved)
            copies.append(_OptimizerCopy(groups, state))
        scaler = self._scaler_tensors()
        slots = list(range(len(tensors), len(tensors) + len(scaler)))
        tensors.extend(scaler)
        return tensors, copies, slots

    def _scaler_tensors(self) -> list[Tensor]:
        if self.scaler is None or not self.scaler.is_enabled():
            return []
        return compat.grad_scaler_tensors(self.scaler)

    def take(self, step: int) -> None:
        """Copy the state off the device now (asynchronously on CUDA) and remember it as the state after ``step``."""
        tensors, copies, scaler_slots = self._tensors()
        if [(t.shape, t.dtype) for t in self._host] != [(t.shape, t.dtype) for t in tensors]:
            self._host = [_host_buffer(t) for t in tensors]
        self._saved = None  # until the copies are queued
        self._copy(self._host, tensors)
        schedulers = [copy.deepcopy(s.state_dict()) for s in self.schedulers]
        extra = [copy.deepcopy(self.extra())] if self.extra is not None else []
        self._saved = _Saved(step, self._layout(), self._group_sizes(), copies, schedulers, scaler_slots, extra)
        self._devices = [t.device for t in tensors]

    def _copy(self, host: list[Tensor], tensors: list[Tensor]) -> None:
        on_cuda = [(h, t) for h, t in zip(host, tensors, strict=True) if t.is_cuda]
        for h, t in zip(host, tensors, strict=True):
            if not t.is_cuda:
                h.copy_(t)
        if not on_cuda:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for h, t in on_cuda:
                h.copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # the allocator keeps its memory until the copy is done
            copied = torch.cuda.Event()
            copied.record()
        # whatever the training stream queues from now on (a weight clamp in a later hook, the next forward's
        # BatchNorm update, the next optimizer step) runs after the copies: no torn snapshot, no host wait
        torch.cuda.current_stream().wait_event(copied)

    @torch.no_grad()
    def restore(self) -> int:
        """Put the saved state back (parameters, buffers, optimizer states, schedulers, scaler, extra); its step.

        Raises:
            RuntimeError: no snapshot was taken, or the module's parameters or the optimizers' param groups changed.
        """
        saved = self._saved
        if saved is None:
            raise RuntimeError("TrainingSnapshot.restore: no snapshot was taken")
        if saved.layout != self._layout():
            raise RuntimeError(
                f"TrainingSnapshot.restore: the module's parameters or the optimizers' param groups changed since the "
                f"snapshot of step {saved.step} (a param group added by fine-tuning, say): it cannot be put back"
            )
        host = self._host
        live = [local_part(t) for t in (*self.module.parameters(), *self.module.buffers())]
        for target, value in zip(live, host, strict=False):
            target.copy_(value, non_blocking=True)
        for optimizer, optimizer_copy in zip(self.optimizers, saved.optimizers, strict=True):
            for group, settings in zip(optimizer.param_groups, optimizer_copy.groups, strict=True):
                for key, value in settings.items():
                    if isinstance(group.get(key), Tensor) and isinstance(value, Tensor):
                        group[key].copy_(value)  # a tensor lr or betas stays the same tensor (capturable, compiled)
                    else:
                        group[key] = copy.deepcopy(value)
            for param, entry in zip(_params(optimizer), optimizer_copy.state, strict=True):
                if entry is None:
                    optimizer.state.pop(param, None)
                    continue
                current = optimizer.state[param]
                for key in [k for k in current if k not in entry]:
                    del current[key]
                for key, value in entry.items():
                    if not isinstance(value, _Slot):
                        current[key] = copy.deepcopy(value)
                        continue
                    source, device = host[value.index], self._devices[value.index]
                    existing = current.get(key)
                    if isinstance(existing, Tensor) and local_part(existing).shape == source.shape:
                        local_part(existing).copy_(source, non_blocking=True)
                    else:  # a state the step replaced or created: a plain tensor (sharded states are updated in place)
                        current[key] = source.to(device, copy=True, non_blocking=True)
        for scheduler, state in zip(self.schedulers, saved.schedulers, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
        scaler_tensors = self._scaler_tensors()
        if len(scaler_tensors) == len(saved.scaler_slots):  # a scaler that had not scaled yet keeps its state
            for target, slot in zip(scaler_tensors, saved.scaler_slots, strict=True):
                target.copy_(host[slot], non_blocking=True)
        if self.restore_extra is not None and saved.extra:
            self.restore_extra(copy.deepcopy(saved.extra[0]))
        return saved.step


@dataclass(frozen=True)
class _Slot:
    index: int


def _params(optimizer: Optimizer) -> Iterable[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _host_buffer(tensor: Tensor) -> Tensor:
    pin = tensor.is_cuda  # pinned memory lets the copies run asynchronously
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
