"""The step service: the one place where the pack's features meet during a fit.

Several features need something from another's training step: OOMBackoff a flag carried in DDP's gradient all-reduce,
PerformanceMonitor the reductions timed, NaNSkip and GradientClipping one verdict and one set of gradient norms per
optimizer step, NaNSkip the share of its batch a micro-batch holds, the monitors one all-gather per logging step. None
of them writes an attribute on the strategy or finds another callback: each asks the fit's :class:`StepService`, which
the strategy owns (the pack's strategies hold one, see :class:`HoldsStepService`) and which :func:`step_service`
returns.

What is asked before the model is wrapped (a flag to carry, reductions to time, buckets left untimed, BatchNorm left
per process) the strategy reads when it wraps; callbacks ask from their ``setup`` hook, which Lightning runs before
the strategy's ``setup``. Under a strategy that is not the pack's, those requests are not read, and the callbacks keep
their own way (OOMBackoff averages gradients itself, PerformanceMonitor leaves reductions untimed); the rest of the
service works the same under any strategy.
"""

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.host_group import host_side_group
from lightning_mgpu.core.rank_gather import RankGather
from lightning_mgpu.core.sharded_tensors import global_norms, local_part
from lightning_mgpu.core.step_timing import CommTimer

Decider = Callable[[Optimizer, list[Tensor], int], Tensor]
_Memo = tuple[int, tuple[int, ...], Tensor]  # (step, parameter ids, tensor)


class CarriedFlag(Protocol):
    """A per-step flag carried in the gradient reduction (:class:`~lightning_mgpu.ddp.step_flag.StepFlag`)."""

    process_group: Any

    def release(self) -> None:
        """Let go of the flag's buffers and hooks (at the end of a fit)."""


class StepService:
    """What the features of one fit share, asked for by type, never by a duck-typed attribute.

    Reduction requests (read when :attr:`reads_requests`, by the pack's DDP strategies when they wrap the model):

    - :meth:`carry_flag`: a flag to carry in the gradient all-reduce; :attr:`flag_carried` says whether the current
      wrap carries it (some DDP settings cannot, see :class:`~lightning_mgpu.DDPStrategy`).
    - :meth:`time_reductions`: time each gradient bucket's reduction with a :class:`CommTimer`.
    - :meth:`keep_buckets_untimed`: no bucket-size tuning this fit (gradients are reduced outside DDP's buckets).
    - :meth:`keep_batchnorm_local`: ``sync_batchnorm="auto"`` leaves BatchNorm per process this fit.

    Per optimizer step, shared whatever the callbacks' order:

    - :meth:`decide_steps` / :meth:`step_is_bad`: one verdict on the step under way, taken once.
    - :meth:`gradient_norms`: the per-gradient norms, computed once.
    - :meth:`in_piece` / :attr:`piece_share`: the share of its batch the micro-batch whose backward runs holds.

    Per logging step: :meth:`join_rank_gather`, one all-gather for every monitor.
    """

    def __init__(self, reads_requests: bool = False) -> None:
        self.reads_requests = reads_requests  # whether the strategy reads the reduction requests (the pack's DDP)
        self.comm_timer: CommTimer | None = None
        self.flag: CarriedFlag | None = None
        # set by the strategy at each wrap: whether it carries :attr:`flag`, whether its reductions are timed
        self.flag_carried = False
        self.reductions_timed = False
        # set by the strategy: whether the registered hook is a plain average (DDP's own reduction timed, or carrying
        # the flag), no compression of the pack's or Lightning's
        self.plain_reduction = False
        self.untimed_buckets: str | None = None  # why bucket tuning is off this fit, if a callback asked
        self.local_batchnorm: str | None = None  # why sync_batchnorm="auto" stays off this fit, if asked
        self.piece_share = 1.0
        # held weakly: a service kept for a strategy of Lightning's outlives its fit's optimizers
        self._deciders: weakref.WeakKeyDictionary[Optimizer, Decider] = weakref.WeakKeyDictionary()
        # optimizer -> (step, parameter ids, tensor): replaced every optimizer step, forgotten after each backward
        self._verdicts: weakref.WeakKeyDictionary[Optimizer, _Memo] = weakref.WeakKeyDictionary()
        self._norms: weakref.WeakKeyDictionary[Optimizer, _Memo] = weakref.WeakKeyDictionary()
        self._gather: RankGather | None = None

    # -- requests read when the model is wrapped --------------------------------------------------------------------

    def carry_flag(self, flag: CarriedFlag) -> None:
        """Have the gradient all-reduce carry ``flag`` from the next wrap on; it is released at the end of the fit."""
        self.flag, self.flag_carried = flag, False

    def drop_flag(self) -> None:
        """Release the carried flag and stop carrying it."""
        if self.flag is not None:
            self.flag.release()
        self.flag, self.flag_carried = None, False

    def time_reductions(self, timer: CommTimer | None) -> None:
        """Time the gradient reductions of the next wrap with ``timer`` (``None``: stop timing)."""
        self.comm_timer = timer

    def keep_buckets_untimed(self, reason: str) -> None:
        """Keep the configured (or torch's) bucket size and hook untimed this fit; ``reason`` goes to the log."""
        self.untimed_buckets = reason

    def keep_batchnorm_local(self, reason: str) -> None:
        """Leave BatchNorm per process this fit under ``sync_batchnorm="auto"``; an explicit ``True`` is kept."""
        self.local_batchnorm = reason

    # -- per optimizer step ----------------------------------------------------------------------------------------

    def decide_steps(self, optimizer: Optimizer, decide: Decider) -> None:
        """Make ``decide(optimizer, params, step)`` the one source of ``optimizer``'s per-step verdict."""
        self._deciders[optimizer] = decide
        self._verdicts.pop(optimizer, None)

    def stop_deciding(self, optimizer: Optimizer, decide: Decider) -> None:
        """Forget ``decide`` for ``optimizer`` (if it is still the registered one)."""
        if self._deciders.get(optimizer) == decide:
            del self._deciders[optimizer]
        self._verdicts.pop(optimizer, None)

    def step_is_bad(self, optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor | None:
        """A boolean device tensor, true when the step under way will be skipped; ``None`` when nobody decides that.

        Args:
            optimizer: the optimizer about to step.
            params: its parameters that have a gradient.
            step: the trainer's global step, which names the optimizer step under way.
        """
        decide = self._deciders.get(optimizer)
        if decide is None:
            return None
        ids = tuple(id(p) for p in params)
        cached = self._verdicts.get(optimizer)
        if cached is not None and cached[0] == step and cached[1] == ids:
            return cached[2]
        verdict = decide(optimizer, params, step)
        self._verdicts[optimizer] = (step, ids, verdict)
        return verdict

    def gradient_norms(self, optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor:
        """The fp32 2-norm of each ``param.grad``, one vectorised pass per optimizer step.

        Under FSDP the norms are those of the full gradients, equal on every rank (one all-reduce of the per-shard
        squares, see :func:`~lightning_mgpu.core.sharded_tensors.global_norms`). A second caller in the same step
        gets the same tensor: scaling the gradients in between by a finite factor, as clipping does, leaves which
        norms are finite unchanged, and clipping reads them before it scales.
        """
        ids = tuple(id(p) for p in params)
        cached = self._norms.get(optimizer)
        if cached is not None and cached[0] == step and cached[1] == ids:
            return cached[2]
        grads = [p.grad for p in params]
        local_norms = torch.stack(compat.foreach_norm([local_part(g) for g in grads], 2, dtype=torch.float32))
        norms = global_norms(grads, local_norms)  # one all-reduce when the gradients are FSDP shards, else none
        self._norms[optimizer] = (step, ids, norms)
        return norms

    def new_gradients(self) -> None:
        """Forget every verdict and norm: called after each backward pass (new gradients, a new decision)."""
        self._verdicts.clear()
        self._norms.clear()

    @contextlib.contextmanager
    def in_piece(self, share: float) -> Iterator[None]:
        """The backward run inside is a micro-batch holding ``share`` of its batch (read as :attr:`piece_share`).

        The loss a backward hook sees for such a piece is about this share of the whole batch's (weighted for a mean
        loss, a partial sum for a sum): a hook that compares losses across steps divides by it.
        """
        outer, self.piece_share = self.piece_share, share
        try:
            yield
        finally:
            self.piece_share = outer

    # -- per logging step -------------------------------------------------------------------------------------------

    def join_rank_gather(
        self,
        trainer: Any,
        owner: object,
        provide: Callable[[], Tensor],
        timeout: Any = None,
        warn: Callable[[str], None] | None = None,
    ) -> RankGather | None:
        """The fit's shared gather, made on first use (a collective: every rank's monitors join in the same order).

        ``None`` with a single process or without an initialised process group.
        """
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        if self._gather is None:
            group, device = host_side_group(trainer.strategy.root_device, timeout, warn)
            self._gather = RankGather(trainer.world_size, group, device)
        self._gather.register(owner, provide)
        return self._gather

    def leave_rank_gather(self, owner: object) -> None:
        """Unregister ``owner``; the last to leave destroys the side group."""
        gather = self._gather
        if gather is None or not gather.unregister(owner):
            return
        self._gather = None
        if gather.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(gather.group)


class HoldsStepService(ABC):
    """The role of a strategy that owns its fits' :class:`StepService` (every strategy of the pack)."""

    @property
    @abstractmethod
    def step_service(self) -> StepService:
        """The service of the fit under way (or of the next one, before it starts)."""


class OwnStepService(HoldsStepService):
    """A strategy's own :class:`StepService`: one per fit, made on first use and ended by the strategy's ``teardown``.

    A strategy class lists it first among its bases, calls :meth:`end_step_service` in its ``teardown``, and sets
    :attr:`reads_step_requests` when it reads the reduction requests.
    """

    reads_step_requests: ClassVar[bool] = False
    _service_of_fit: StepService | None = None

    @property
    @override
    def step_service(self) -> StepService:
        service = self._service_of_fit
        if service is None:
            service = self._service_of_fit = StepService(self.reads_step_requests)
        return service

    @property
    def step_service_started(self) -> bool:
        """Whether this fit's service exists (reading :attr:`step_service` makes one)."""
        return self._service_of_fit is not None

    def end_step_service(self) -> None:
        """End this fit's service (a carried flag is released): the next fit gets a new one."""
        service, self._service_of_fit = self._service_of_fit, None
        if service is not None:
            service.drop_flag()

    def hand_step_service_to(self, other: "OwnStepService") -> StepService:
        """Let ``other`` serve this fit's service from now on (a strategy taking over the fit); this one forgets it."""
        service = self.step_service
        other._service_of_fit, self._service_of_fit = service, None
        return service

    def __getstate__(self) -> dict[str, Any]:
        # a fit's service holds weak maps and process groups: a strategy pickled into spawned workers goes without it
        state = dict(super().__getstate__() or {})  # type: ignore[misc]
        state.pop("_service_of_fit", None)
        return state


# a strategy that is not the pack's has nowhere to hold a service: one per such strategy object, held weakly
_FOR_OTHER_STRATEGIES: "weakref.WeakKeyDictionary[Any, StepService]" = weakref.WeakKeyDictionary()


def step_service(trainer: Any) -> StepService:
    """The :class:`StepService` of ``trainer``'s strategy: its own for the pack's strategies, else one kept for it."""
    strategy = trainer.strategy
    if isinstance(strategy, HoldsStepService):
        return strategy.step_service
    service = _FOR_OTHER_STRATEGIES.get(strategy)
    if service is None:
        service = _FOR_OTHER_STRATEGIES[strategy] = StepService()
    return service
