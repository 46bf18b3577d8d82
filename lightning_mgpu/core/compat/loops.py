"""Lightning's trainer and loops: logging steps, hooks, closures, SIGTERM and the fit's end."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization
from lightning.pytorch.loops.optimization.closure import AbstractClosure
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mgpu.core.compat.patches import install_patch, patched_class
from lightning_mgpu.core.compat.versions import TESTED_LIGHTNING_RANGE, UnsupportedLightningError, lightning_is_tested


def logger_step(trainer: "pl.Trainer") -> int:
    """The step Lightning's loggers write at: optimizer steps taken in this fit and those before it (2.5.2-2.6.6)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def is_logging_step(trainer: "pl.Trainer") -> bool:
    """Whether the optimizer step under way is one whose metrics Lightning's loggers write (2.5.2-2.6.6).

    Lightning's own decision (every ``log_every_n_steps``-th step and the step that stops training), the one
    definition the pack uses; valid from ``on_train_batch_start`` to ``on_train_batch_end``. Like Lightning's loggers,
    it says yes at every step while a fit keeps training after ``should_stop`` (``min_epochs``/``min_steps`` not yet
    reached), so the callbacks log, and read their values, every step then, as Lightning writes every step.
    """
    return trainer._logger_connector.should_update_logs


def training_logging_check(trainer: "pl.Trainer") -> Callable[[], bool]:
    """:func:`is_logging_step` for this fit's training batches, cheaply: about 1 us in the loop, not 9 (2.5.2-2.6.6).

    Lightning logs a training step when ``(batches stepped + 1) % log_every_n_steps == 0`` or training stops; where
    that fails the check answers at once, and otherwise asks Lightning, so the answer is always Lightning's. Make it
    once the fit loop exists (``on_train_start``).
    """
    epoch_loop, connector = trainer.fit_loop.epoch_loop, trainer._logger_connector

    def check() -> bool:
        every = trainer.log_every_n_steps
        if not every or ((epoch_loop._batches_that_stepped + 1) % every and not trainer.should_stop):
            return False
        return connector.should_update_logs

    return check


def should_accumulate(trainer: "pl.Trainer") -> bool:
    """Whether the training batch under way only accumulates gradients, with no optimizer step (2.5.2-2.6.6)."""
    return trainer.fit_loop._should_accumulate()


def rebuild_train_dataloader(trainer: "pl.Trainer") -> None:
    """Make the fit loop build the training dataloader again when the next epoch starts (2.5.2-2.6.6)."""
    trainer.fit_loop._combined_loader = None


@contextmanager
def running_hook(module: "pl.LightningModule", hook_name: str) -> Iterator[None]:
    """Let ``module.log`` calls be checked as if made from Lightning hook ``hook_name`` (2.5.2-2.6.6)."""
    previous = module._current_fx_name
    module._current_fx_name = hook_name
    try:
        yield
    finally:
        module._current_fx_name = previous


# the ``self.log`` captures in force in this thread (or task), innermost last: (module, record) pairs in a tuple
_LOG_CAPTURES: ContextVar[tuple[tuple[Any, Callable[..., None]], ...]] = ContextVar(
    "lightning_mgpu_log_captures", default=()
)


def _capturing_log(log: Callable[..., None]) -> Callable[..., None]:
    def log_or_capture(self: "pl.LightningModule", *args: Any, **kwargs: Any) -> None:
        for module, record in reversed(_LOG_CAPTURES.get()):
            if module is self:
                return record(*args, **kwargs)
        return log(self, *args, **kwargs)

    return log_or_capture


class LogCapture:
    """Inside the ``with`` block, in this thread, ``module.log(*args, **kwargs)`` calls ``record(*args, **kwargs)``.

    ``self.log_dict`` calls ``self.log``, so it is captured too. The patch ``"log_capture"`` wraps
    ``LightningModule.log`` once (2.5.2-2.6.6); outside a capture, and for any other module, Lightning's ``log`` runs
    unchanged. A subclass's own ``log`` override runs first and is captured when it calls ``super().log``. The module
    and its class are untouched; a capture ends with the block, an exception included. A class rather than a
    generator: OOMBackoff enters one for every micro-batch.

    Raises:
        UnsupportedLightningError: on entering, where ``LightningModule.log`` is missing.
    """

    __slots__ = ("_entry", "_token")

    def __init__(self, module: "pl.LightningModule", record: Callable[..., None]) -> None:
        self._entry = (module, record)

    def __enter__(self) -> None:
        # ours, or another wrapper around it that copied its marker: installed; otherwise install (once)
        if getattr(pl.LightningModule.log, "lightning_mgpu_patch", None) is None and not install_patch(
            "log_capture", _capturing_log
        ):
            raise UnsupportedLightningError(f"Lightning {lightning.__version__} has no LightningModule.log to capture")
        self._token = _LOG_CAPTURES.set((*_LOG_CAPTURES.get(), self._entry))

    def __exit__(self, *exc_info: object) -> None:
        _LOG_CAPTURES.reset(self._token)


def call_batch_hook(module: "pl.LightningModule", hook_name: str, *args: Any) -> Any:
    """Run a batch hook (``on_after_batch_transfer``...) as Lightning does: the DataModule's too (2.5.2-2.6.6)."""
    return module._call_batch_hook(hook_name, *args)


def point_device_at(module: nn.Module, device: torch.device) -> None:
    """Make ``module.device`` (and its submodules') say ``device``: a copied replica's still names the original's.

    Lightning's ``DeviceDtypeModuleMixin`` keeps the device in ``_device`` (2.5.2-2.6.6).
    """
    for submodule in module.modules():
        if getattr(submodule, "_device", device) != device:
            submodule._device = device


class AutomaticOptimization(_AutomaticOptimization):
    """Lightning's automatic optimization loop, with its private steps reached by public names (2.5.2-2.6.6).

    Built to replace ``trainer.fit_loop.epoch_loop.automatic_optimization`` (``replaced``): it shares the replaced
    loop's progress counters, so checkpoints and resumption see no difference. Subclasses override
    :meth:`make_closure` and :meth:`optimizer_step`.
    """

    def __init__(self, trainer: "pl.Trainer", replaced: _AutomaticOptimization) -> None:
        super().__init__(trainer)
        self.optim_progress = replaced.optim_progress
        self._skip_backward = replaced._skip_backward
        # in a tuple: a loop's state_dict walks its attributes and would save the replaced loop a second time
        self._replaced = (replaced,)

    @property
    def replaced(self) -> _AutomaticOptimization:
        """The loop this one replaced, to put back when the fit ends."""
        return self._replaced[0]

    def make_closure(self, kwargs: Any, optimizer: Optimizer, batch_idx: int) -> Any:
        """Build the closure the optimizer calls: Lightning's by default."""
        return super()._make_closure(kwargs, optimizer, batch_idx)

    def optimizer_step(self, batch_idx: int, closure: Any) -> None:
        """Run the optimizer step with ``closure``: Lightning's by default."""
        super()._optimizer_step(batch_idx, closure)

    def zero_grad_fn(self, batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
        """Lightning's ``zero_grad`` for this batch, or ``None`` when accumulating."""
        return self._make_zero_grad_fn(batch_idx, optimizer)

    def backward_fn(self, optimizer: Optimizer) -> Callable[[Tensor], None] | None:
        """Lightning's backward (through the precision plugin), or ``None`` when the backward is skipped."""
        return self._make_backward_fn(optimizer)

    def training_step(self, kwargs: Any) -> Any:
        """Run the module's ``training_step`` through the strategy; returns Lightning's ``ClosureResult``."""
        return self._training_step(kwargs)

    def _make_closure(self, kwargs: Any, optimizer: Optimizer, batch_idx: int) -> Any:
        return self.make_closure(kwargs, optimizer, batch_idx)

    def _optimizer_step(self, batch_idx: int, train_step_and_backward_closure: Any) -> None:
        self.optimizer_step(batch_idx, train_step_and_backward_closure)


class OptimizerClosure(AbstractClosure[ClosureResult]):
    """A closure for :class:`AutomaticOptimization`: calling it runs :meth:`closure` and returns the loss.

    Lightning reads the result back from the private ``_result`` (2.5.2-2.6.6); subclasses implement ``closure``.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor | None:
        """Run the closure; Lightning's optimizer step consumes the result afterwards."""
        self._result = self.closure(*args, **kwargs)
        return self._result.loss


def callback_state_key(callback: "pl.Callback", **kwargs: Any) -> str:
    """A callback's ``state_key`` that tells instances with different ``kwargs`` apart.

    Lightning's own callbacks build theirs with the protected ``Callback._generate_state_key`` (2.5.2-2.6.6).
    """
    return callback._generate_state_key(**kwargs)


def sigterm_internals_missing(trainer: "pl.Trainer") -> str | None:
    """Why :class:`~lightning_mgpu.long_runs.preemption.SigtermAgreement` cannot replace this trainer's, or ``None``.

    The fallback, where a name is missing, is Lightning's own per-step broadcast. Names appeared in 2.5.2; tested on
    2.5.6 and 2.6.6.
    """
    if not lightning_is_tested():
        lowest, first_untested = TESTED_LIGHTNING_RANGE
        return f"Lightning {lightning.__version__} is outside the tested range >={lowest},<{first_untested}"
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return "this Lightning's training loop has no per-step SIGTERM broadcast"
    progress = getattr(epoch_loop, "batch_progress", None)
    if not (hasattr(progress, "is_last_batch") and hasattr(getattr(progress, "current", None), "ready")):
        return "this Lightning's training loop keeps its batch progress differently"
    if not callable(getattr(type(trainer.fit_loop), "on_run_end", None)):
        return "this Lightning's fit loop has no on_run_end"
    loops = {"sigterm_batch_check": epoch_loop, "leaving_training": trainer.fit_loop}
    if not all(isinstance(loop, patched_class(name) or ()) for name, loop in loops.items()):
        return "this Lightning's loop classes are not where the patches expect them"
    connector = getattr(trainer, "_signal_connector", None)
    if not (
        isinstance(connector, _SignalConnector)
        and all(hasattr(connector, name) for name in ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn"))
        and isinstance(getattr(connector, "_original_handlers", None), dict)
    ):
        return "this Lightning's signal connector differs"
    if not callable(getattr(getattr(trainer, "_checkpoint_connector", None), "hpc_save_path", None)):
        return "this Lightning's checkpoint connector names its SLURM checkpoints differently"
    if not hasattr(dist.distributed_c10d, "_get_default_store"):
        return "this torch has no default store"
    return None


class SigtermSignalConnector(_SignalConnector):
    """Lightning's signal connector for one fit, with SIGTERM and SLURM's requeue signal handled by the pack.

    :func:`replace_sigterm_handling` makes it the trainer's ``_signal_connector`` (2.5.2-2.6.6) for the fit, and
    :func:`restore_sigterm_handling` hands Lightning's back. Lightning registers the signal handlers from its
    ``_sigterm_notifier_fn`` and ``_slurm_sigusr_handler_fn``, overridden here, and restores the previous handlers at
    the end of the fit, as for its own. Two patches of Lightning's loops ask the trainer's connector, and act only
    where it is one of these: ``"sigterm_batch_check"`` runs :attr:`at_batch_boundary` in place of the per-batch
    broadcast, and ``"leaving_training"`` runs :attr:`before_leaving_training` before the ``on_train_end`` hooks.
    """

    def __init__(
        self,
        trainer: "pl.Trainer",
        at_batch_boundary: Callable[[], None],
        on_sigterm: Callable[..., None],
        on_requeue_signal: Callable[..., None],
        before_leaving_training: Callable[[], None],
    ) -> None:
        super().__init__(trainer)
        self.replaced = trainer._signal_connector
        self.received_sigterm = self.replaced.received_sigterm
        self._original_handlers = self.replaced._original_handlers
        self.at_batch_boundary = at_batch_boundary
        self.on_sigterm = on_sigterm
        self.on_requeue_signal = on_requeue_signal
        self.before_leaving_training = before_leaving_training

    def _sigterm_notifier_fn(self, signum: int, frame: Any) -> None:
        self.on_sigterm(signum, frame)

    def _slurm_sigusr_handler_fn(self, signum: int, frame: Any) -> None:
        self.on_requeue_signal(signum, frame)


def _agreed_batch_check(broadcast: Callable[[Any], None]) -> Callable[[Any], None]:
    def check_or_broadcast(self: Any) -> None:
        signals = self.trainer._signal_connector
        if isinstance(signals, SigtermSignalConnector):
            return signals.at_batch_boundary()
        return broadcast(self)

    return check_or_broadcast


def _announced_run_end(on_run_end: Callable[[Any], None]) -> Callable[[Any], None]:
    def announce_then_end(self: Any) -> None:
        signals = self.trainer._signal_connector
        if isinstance(signals, SigtermSignalConnector):
            signals.before_leaving_training()
        return on_run_end(self)

    return announce_then_end


_SIGTERM_PATCHES = (("sigterm_batch_check", _agreed_batch_check), ("leaving_training", _announced_run_end))


def replace_sigterm_handling(
    trainer: "pl.Trainer",
    at_batch_boundary: Callable[[], None],
    on_sigterm: Callable[..., None],
    on_requeue_signal: Callable[..., None],
    before_leaving_training: Callable[[], None],
) -> None:
    """On this trainer only: replace the per-batch SIGTERM broadcast, the SIGTERM and SLURM requeue handlers.

    Lightning's requeue handler (registered for ``SLURMEnvironment(auto_requeue=True)``, on SIGUSR1 by default) saves
    a checkpoint and requeues the job from inside the signal handler (2.5.2-2.6.6). ``before_leaving_training`` runs
    whenever the fit loop leaves training, however it ended (the data, ``max_steps``, a Timer, ``should_stop``), before
    the callbacks' ``on_train_end`` hooks. The trainer gets a :class:`SigtermSignalConnector`, and the patches
    ``"sigterm_batch_check"`` and ``"leaving_training"`` are installed once. Lightning registers the handlers after
    ``strategy.setup``: call this from ``setup`` (after :func:`sigterm_internals_missing` said yes);
    :func:`restore_sigterm_handling` undoes it.
    """
    restore_sigterm_handling(trainer)
    installed = [install_patch(name, wrap) for name, wrap in _SIGTERM_PATCHES]
    if not all(installed):  # the probe said they could be: a half-installed agreement would hang at the end of the fit
        missing = [name for (name, _), done in zip(_SIGTERM_PATCHES, installed, strict=True) if not done]
        raise RuntimeError(f"lightning_mgpu could not install the patches {missing} of this Lightning")
    trainer._signal_connector = SigtermSignalConnector(
        trainer, at_batch_boundary, on_sigterm, on_requeue_signal, before_leaving_training
    )


def restore_sigterm_handling(trainer: "pl.Trainer") -> None:
    """Give this trainer Lightning's SIGTERM broadcast and signal connector back, with what the fit's one recorded.

    Handlers already registered keep calling the pack's until Lightning's teardown restores the previous ones.
    """
    signals = trainer._signal_connector
    if isinstance(signals, SigtermSignalConnector):
        signals.replaced.received_sigterm = signals.received_sigterm
        signals.replaced._original_handlers = signals._original_handlers
        trainer._signal_connector = signals.replaced


def slurm_checkpoint_path(trainer: "pl.Trainer") -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which Lightning resumes a requeued SLURM job from.

    Lightning's ``fit(ckpt_path=None)`` under SLURM loads the highest-numbered one (2.5.2-2.6.6).
    """
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def mark_sigterm_received(trainer: "pl.Trainer") -> None:
    """Record on the trainer that a SIGTERM stopped the fit, as Lightning's own handler does (2.5.2-2.6.6)."""
    trainer._signal_connector.received_sigterm = True


def default_store() -> dist.Store:
    """The default process group's key-value store (torch 2.13)."""
    return dist.distributed_c10d._get_default_store()
