"""The one door to private Lightning, torch and torchmetrics names: nothing else in the package touches one.

Every accessor below says which releases it was tested on. ``tests/test_compat.py`` checks that no other module of
the package reads, writes, imports or overrides a private name of those libraries, and exercises every accessor
on the Lightning CI installs (the newest 2.5 and 2.6 patches, ``.ci/run``).

An unsupported Lightning ends at ``setup`` in one error, :class:`UnsupportedLightningError`, raised by
:func:`check_lightning_internals` with every missing name listed, never deep inside a loop. Two uses have a documented
fallback instead: the strategy-name hint (Lightning's own message stays) and the SIGTERM agreement (Lightning's
per-step broadcast stays). A Lightning outside :data:`TESTED_LIGHTNING_RANGE` whose internals are all present gets
one warning and runs.

Two limits, chosen for one simple rule: the check is all-or-nothing (a callback that needs none of a missing name is
refused too), and the classes this module subclasses or re-exports (``_AutomaticOptimization``, ``_BatchNorm``,
``_NormBase``, ``AbstractClosure``) are imported when the package is: a release that moves one fails at
``import lightning_mgpu`` with an ``ImportError`` naming it, not at ``setup``.

To support a new Lightning release: run the suite on it; where a name moved, change the accessor here (and its probe
in :data:`LIGHTNING_INTERNALS`), not its callers.
"""

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization
from lightning.pytorch.loops.optimization.closure import AbstractClosure
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from packaging.version import Version
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from torchmetrics import Metric

# lowest tested release, first untested minor: CI runs the suite on the newest 2.6 patch and the strategies, callbacks
# and configs tests on the newest 2.5 patch; the SIGTERM names were read in the 2.5.2 source, where they appeared
TESTED_LIGHTNING_RANGE = ("2.5.2", "2.7")
TESTED_TORCH = "2.13"  # CI's torch, the only one the torch names below were run on
TESTED_TORCHMETRICS = "1.9"  # likewise
# "(2.5.2-2.6.6)" on an accessor: the name is in the 2.5.2 source and CI runs it on 2.5.6 and 2.6.6


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning lacks an internal the pack needs; raised at ``setup``, naming every missing one."""


# ---------------------------------------------------------------------------------------------- version checks
def lightning_is_tested(version: str | None = None) -> bool:
    """Whether ``version`` (the installed Lightning by default) lies in :data:`TESTED_LIGHTNING_RANGE`."""
    lowest, first_untested = TESTED_LIGHTNING_RANGE
    base = Version(Version(version or lightning.__version__).base_version)
    return Version(lowest) <= base < Version(first_untested)


@dataclass(frozen=True)
class Internal:
    """One private name of Lightning the pack relies on, and how to see whether this Lightning still has it."""

    name: str
    present: Callable[["pl.Trainer"], bool]


def _has(obj: Any, name: str) -> bool:
    return obj is not None and hasattr(obj, name)


# every name below was tested on Lightning 2.5.6 and 2.6.6 (CI); probed on the live trainer at setup, where instance
# attributes exist. The strategy-name hint and the SIGTERM agreement are probed where they are used (fallbacks).
LIGHTNING_INTERNALS: tuple[Internal, ...] = (
    Internal("_TrainingEpochLoop._batches_that_stepped",
             lambda t: _has(t.fit_loop.epoch_loop, "_batches_that_stepped")),
    Internal(
        "_LoggerConnector.should_update_logs",
        lambda t: _has(t, "_logger_connector") and _has(type(t._logger_connector), "should_update_logs"),
    ),
    Internal("_FitLoop._should_accumulate", lambda t: _has(t.fit_loop, "_should_accumulate")),
    Internal("_FitLoop._combined_loader", lambda t: _has(t.fit_loop, "_combined_loader")),
    Internal("_FitLoop._data_source", lambda t: _has(t.fit_loop, "_data_source")),
    Internal("LightningModule._current_fx_name", lambda t: _has(t.lightning_module, "_current_fx_name")),
    Internal("LightningModule._call_batch_hook", lambda t: _has(pl.LightningModule, "_call_batch_hook")),
    *(
        Internal(f"_AutomaticOptimization.{name}", lambda t, name=name: _has(_AutomaticOptimization, name))
        for name in ("_make_closure", "_optimizer_step", "_make_zero_grad_fn", "_make_backward_fn", "_training_step")
    ),
    Internal(
        "ParallelStrategy._layer_sync",
        lambda t: not isinstance(t.strategy, ParallelStrategy) or _has(t.strategy, "_layer_sync"),
    ),
    # the methods on Lightning's class: the pack's mixins define their own _register_ddp_hooks/_configure_launcher
    *(
        Internal(f"DDPStrategy.{name}", lambda t, name=name: not isinstance(t.strategy, LightningDDPStrategy)
                 or name in vars(LightningDDPStrategy))
        for name in ("_setup_model", "_register_ddp_hooks", "_configure_launcher")
    ),
    *(
        Internal(f"DDPStrategy.{name}", lambda t, name=name: not isinstance(t.strategy, LightningDDPStrategy)
                 or _has(t.strategy, name))
        for name in ("_ddp_kwargs", "_ddp_comm_hook", "_ddp_comm_state", "_model_averaging_period", "_timeout",
                     "_start_method")
    ),
    *(
        Internal(f"ModelParallelStrategy.{name}", lambda t, name=name: not isinstance(t.strategy, ModelParallelStrategy)
                 or _has(t.strategy, name))
        for name in ("_data_parallel_size", "_tensor_parallel_size", "_configure_launcher")
    ),
)  # fmt: skip


def missing_lightning_internals(trainer: "pl.Trainer") -> list[str]:
    """The names of :data:`LIGHTNING_INTERNALS` this trainer's Lightning does not have."""
    return [internal.name for internal in LIGHTNING_INTERNALS if not internal.present(trainer)]


def check_lightning_internals(trainer: "pl.Trainer", owner: str) -> None:
    """Stop at ``setup`` if this Lightning lacks an internal the pack needs; warn once if it is untested but complete.

    Args:
        trainer: the trainer being set up.
        owner: the class that asks, for the message.

    Raises:
        UnsupportedLightningError: naming every missing internal, the installed version and the tested range.
    """
    missing = missing_lightning_internals(trainer)
    lowest, first_untested = TESTED_LIGHTNING_RANGE
    if missing:
        raise UnsupportedLightningError(
            f"{owner}: Lightning {lightning.__version__} lacks internals lightning_mgpu relies on: "
            f"{', '.join(missing)}. lightning_mgpu is tested with lightning>={lowest},<{first_untested}; install a "
            "release in that range."
        )
    if not lightning_is_tested():
        _warn_untested_once(lightning.__version__)


@functools.cache
def _warn_untested_once(version: str) -> None:
    lowest, first_untested = TESTED_LIGHTNING_RANGE
    rank_zero_warn(
        f"lightning_mgpu is tested with lightning>={lowest},<{first_untested}, and Lightning {version} is installed; "
        "the internals it relies on are present, so it runs."
    )


# ------------------------------------------------------------------------------------ trainer and loops (Lightning)
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


def call_batch_hook(module: "pl.LightningModule", hook_name: str, *args: Any) -> Any:
    """Run a batch hook (``on_after_batch_transfer``...) as Lightning does: the DataModule's too (2.5.2-2.6.6)."""
    return module._call_batch_hook(hook_name, *args)


def point_device_at(module: nn.Module, device: torch.device) -> None:
    """Make ``module.device`` (and its submodules') say ``device``: a copied replica's still names the original's.

    Lightning's ``DeviceDtypeModuleMixin`` keeps the device in ``_device`` (2.5.2-2.6.6).
    """
    for submodule in module.modules():
        if "_device" in submodule.__dict__ and submodule.__dict__["_device"] != device:
            submodule.__dict__["_device"] = device


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


# ------------------------------------------------------------------------------- SIGTERM and the fit's end (Lightning)
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
    connector = getattr(trainer, "_signal_connector", None)
    if not (hasattr(connector, "_sigterm_notifier_fn") and hasattr(connector, "_slurm_sigusr_handler_fn")):
        return "this Lightning's signal connector differs"
    if not callable(getattr(getattr(trainer, "_checkpoint_connector", None), "hpc_save_path", None)):
        return "this Lightning's checkpoint connector names its SLURM checkpoints differently"
    if not hasattr(dist.distributed_c10d, "_get_default_store"):
        return "this torch has no default store"
    return None


# instance attributes that shadow a method of a Lightning object: (object path, attribute)
_SHADOWED = (
    ("fit_loop.epoch_loop", "_broadcast_sigterm_tensor"),
    ("_signal_connector", "_sigterm_notifier_fn"),
    ("_signal_connector", "_slurm_sigusr_handler_fn"),
)


def _resolve(trainer: "pl.Trainer", path: str) -> Any:
    obj: Any = trainer
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def replace_sigterm_handling(
    trainer: "pl.Trainer",
    at_batch_boundary: Callable[[], None],
    on_sigterm: Callable[..., None],
    on_requeue_signal: Callable[..., None],
) -> None:
    """On this trainer only: replace the per-batch SIGTERM broadcast and the SIGTERM and SLURM requeue handlers.

    Lightning's requeue handler (registered for ``SLURMEnvironment(auto_requeue=True)``, on SIGUSR1 by default) saves
    a checkpoint and requeues the job from inside the signal handler (2.5.2-2.6.6). The signal connector builds its
    handlers from these methods when the fit registers them, after ``strategy.setup``: call this from ``setup``.
    :func:`restore_sigterm_handling` undoes it.
    """
    replacements = (at_batch_boundary, on_sigterm, on_requeue_signal)
    for (path, name), replacement in zip(_SHADOWED, replacements, strict=True):
        _resolve(trainer, path).__dict__[name] = replacement


def restore_sigterm_handling(trainer: "pl.Trainer") -> None:
    """Give this trainer Lightning's SIGTERM broadcast and notifier back."""
    for path, name in _SHADOWED:
        _resolve(trainer, path).__dict__.pop(name, None)


def slurm_checkpoint_path(trainer: "pl.Trainer") -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which Lightning resumes a requeued SLURM job from.

    Lightning's ``fit(ckpt_path=None)`` under SLURM loads the highest-numbered one (2.5.2-2.6.6).
    """
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def mark_sigterm_received(trainer: "pl.Trainer") -> None:
    """Record on the trainer that a SIGTERM stopped the fit, as Lightning's own handler does (2.5.2-2.6.6)."""
    trainer._signal_connector.received_sigterm = True


def run_before_leaving_training(trainer: "pl.Trainer", callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` whenever this trainer's fit loop leaves training, however it ended; returns the undo.

    Lightning's fit loop calls its ``on_run_end`` once training stops (data exhausted, ``max_steps``, a Timer,
    ``should_stop``), before the callbacks' ``on_train_end`` hooks (2.5.2-2.6.6). The undo restores what was there
    before, even if something else wrapped it since.
    """
    fit_loop = trainer.fit_loop
    had_own = "on_run_end" in fit_loop.__dict__
    previous = fit_loop.__dict__.get("on_run_end")
    run_end = fit_loop.on_run_end
    active = [True]

    def leave_training() -> Any:
        if active[0]:
            callback()
        return run_end()

    fit_loop.on_run_end = leave_training

    def undo() -> None:
        active[0] = False  # a newer wrapper that calls this one keeps working, without the callback
        if fit_loop.__dict__.get("on_run_end") is not leave_training:
            return
        if had_own:
            fit_loop.on_run_end = previous
        else:
            del fit_loop.on_run_end

    return undo


def default_store() -> dist.Store:
    """The default process group's key-value store (torch 2.13)."""
    return dist.distributed_c10d._get_default_store()


# ------------------------------------------------------------------------------ strategies (Lightning and torch)
def install_strategy_flag_hint(add_hint: Callable[[Any, ValueError], None]) -> bool:
    """Let ``add_hint(strategy_flag, error)`` amend Lightning's error for a strategy flag it does not know.

    Lightning checks the flag in the private ``_AcceleratorConnector._check_config_and_set_final_flags`` (2.5.2-2.6.6,
    probed): this wraps it once. Fallback, where it is missing: Lightning's message as it is.

    Returns:
        Whether the hint is in place.
    """
    from lightning.pytorch.trainer.connectors import accelerator_connector

    connector = getattr(accelerator_connector, "_AcceleratorConnector", None)
    check = getattr(connector, "_check_config_and_set_final_flags", None)
    if check is None:
        return False
    if getattr(check, "lightning_mgpu_hint", False):
        return True

    @functools.wraps(check)
    def check_with_hint(self: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return check(self, strategy, *args, **kwargs)
        except ValueError as err:
            add_hint(strategy, err)
            raise

    check_with_hint.lightning_mgpu_hint = True  # type: ignore[attr-defined]
    connector._check_config_and_set_final_flags = check_with_hint  # type: ignore[union-attr]
    return True


class DDPStrategyBase(LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with two private hooks reached by public names (2.5.2-2.6.6).

    - :meth:`before_launch` runs where Lightning's accelerator connector calls the private ``_configure_launcher``:
      last, once the accelerator, devices, cluster environment and number of nodes are set.
    - :meth:`register_own_comm_hook` runs where Lightning calls the private ``_register_ddp_hooks``, after wrapping
      the model.

    A base class, not a mixin: the strategy may turn into another class in place (:func:`become`), which needs one
    line of bases down to Lightning's ``Strategy``.
    """

    def before_launch(self) -> bool:
        """Decide what to launch; return ``False`` to skip configuring DDP's launcher."""
        return True

    def register_own_comm_hook(self) -> bool:
        """Register a hook of the subclass's own; return ``False`` to let Lightning register its ``ddp_comm_hook``."""
        return False

    def _configure_launcher(self) -> None:
        if self.before_launch():
            super()._configure_launcher()

    def _register_ddp_hooks(self) -> None:
        if not self.register_own_comm_hook():
            super()._register_ddp_hooks()


def check_launch_hook(strategy: LightningDDPStrategy) -> None:
    """Stop at construction if Lightning would not call :meth:`DDPStrategyBase.before_launch` (no choice made).

    Raises:
        UnsupportedLightningError: where ``DDPStrategy._configure_launcher`` or ``_start_method`` is missing.
    """
    missing = [name for name in ("_configure_launcher",) if name not in vars(LightningDDPStrategy)]
    missing += [name for name in ("_start_method",) if not hasattr(strategy, name)]
    if missing:
        lowest, first_untested = TESTED_LIGHTNING_RANGE
        raise UnsupportedLightningError(
            f"{type(strategy).__name__}: Lightning {lightning.__version__} lacks DDPStrategy internals lightning_mgpu "
            f"relies on: {', '.join(missing)}. lightning_mgpu is tested with lightning>={lowest},<{first_untested}."
        )


def set_start_method(strategy: LightningDDPStrategy, start_method: str) -> None:
    """The process start method Lightning's DDP launcher uses ("popen", "spawn", "fork"...) (2.5.2-2.6.6)."""
    strategy._start_method = start_method


def strategy_plugins(strategy: "pl.strategies.Strategy") -> dict[str, Any]:
    """What the Trainer's connector gave a strategy before its launch: accelerator, checkpoint IO, precision."""
    accelerator: Accelerator | None = strategy.accelerator
    return {
        "accelerator": accelerator,
        "checkpoint_io": strategy._checkpoint_io,
        "precision_plugin": strategy._precision_plugin,
    }


def become(obj: Any, cls: type, *args: Any, **kwargs: Any) -> None:
    """Turn ``obj`` into a fresh ``cls(*args, **kwargs)`` in place, for holders that keep a reference to it."""
    obj.__dict__.clear()
    obj.__class__ = cls
    cls.__init__(obj, *args, **kwargs)


def process_group_timeout(strategy: "pl.strategies.Strategy") -> timedelta | None:
    """The process-group timeout a Lightning strategy was built with, or ``None`` (2.5.2-2.6.6)."""
    return getattr(strategy, "_timeout", None)


def ddp_kwargs(strategy: LightningDDPStrategy) -> dict[str, Any]:
    """The live dict of keyword arguments Lightning builds ``DistributedDataParallel`` with (2.5.2-2.6.6)."""
    return strategy._ddp_kwargs


def set_ddp_kwargs(strategy: LightningDDPStrategy, kwargs: dict[str, Any]) -> None:
    """Replace the keyword arguments Lightning builds ``DistributedDataParallel`` with."""
    strategy._ddp_kwargs = kwargs


def layer_sync(strategy: ParallelStrategy) -> Any:
    """The strategy's ``LayerSync`` plugin (sync-BN), ``None`` if none (2.5.2-2.6.6)."""
    return strategy._layer_sync


def set_layer_sync(strategy: ParallelStrategy, plugin: Any) -> None:
    """Set the ``LayerSync`` plugin the strategy applies when it sets the model up."""
    strategy._layer_sync = plugin


def lightning_comm_state(strategy: LightningDDPStrategy) -> bool:
    """Whether a ``ddp_comm_hook``, ``ddp_comm_state`` or model averaging was set through Lightning (2.5.2-2.6.6)."""
    return bool(
        strategy._ddp_comm_hook is not None or strategy._ddp_comm_state is not None or strategy._model_averaging_period
    )


def wrap_in_ddp(strategy: LightningDDPStrategy, module: nn.Module) -> nn.Module:
    """Wrap ``module`` in ``DistributedDataParallel`` as Lightning's strategy does, with its ``ddp_kwargs``.

    For a re-wrap during a fit (2.5.2-2.6.6). Lightning 2.6 flushes a static graph's first all-reduce once per wrapper
    under manual optimization, so that flag (``_pl_static_graph_delay_done``) is reset too; 2.5.2 has no such flag,
    and setting it there changes nothing.
    """
    model = strategy._setup_model(module)
    strategy._pl_static_graph_delay_done = False
    return model


def register_ddp_hooks(strategy: LightningDDPStrategy) -> None:
    """Register the strategy's DDP communication hooks on its current wrapper (2.5.2-2.6.6)."""
    strategy._register_ddp_hooks()


def ddp_has_comm_hook(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether a communication hook is registered on a ``DistributedDataParallel`` wrapper (torch 2.13)."""
    return bool(getattr(ddp, "_comm_hooks", None))


def broadcast_ddp_buffers(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Broadcast the module's buffers from rank 0 as DDP's forward does: coalesced, through a buffer comm hook.

    Returns ``False`` (nothing done) where this torch has no ``_sync_buffers`` (tested on torch 2.13).
    """
    if not hasattr(ddp, "_sync_buffers"):
        return False
    ddp._sync_buffers()
    return True


def ddp_delayed_params(ddp: nn.parallel.DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters DDP averages by a hook of its own, outside its buckets (``delay_all_reduce_named_params``).

    torch 2.13's ``_delay_all_reduce_params``: that hook issues an all-reduce on every backward that reaches
    ``param_to_hook_all_reduce``, under ``no_sync()`` too. Empty where a torch lacks it.
    """
    return list(getattr(ddp, "_delay_all_reduce_params", ()))


def ddp_buckets_rebuilt(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP has rebuilt its buckets in the order gradients arrived, as it does once after the first backward.

    torch 2.13's ``_has_rebuilt_buckets``; ``True`` where a torch lacks it (no rebuild to wait for).
    """
    return bool(getattr(ddp, "_has_rebuilt_buckets", True))


def reset_ddp_reduction(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Forget the gradients a failed backward marked ready, before DDP's bucket rebuild.

    torch 2.13's reducer ``_reset_state``. After the rebuild a replay works without it, and with it the ranks'
    reductions part ways.
    """
    ddp.reducer._reset_state()


def expect_ddp_backward(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Tell DDP's reducer that a backward pass comes in which every parameter gets a gradient.

    What DDP's forward does after the module returned (``reducer.prepare_for_backward``, torch 2.13), for a rank
    whose forward raised before it got there, or whose backward raised part way.
    """
    ddp.reducer.prepare_for_backward([])


# ------------------------------------------------------------------------------------------------ torch names
BatchNormBase = _BatchNorm  # every BatchNorm1d/2d/3d and SyncBatchNorm (torch 2.13)


class BatchNormLayer(_BatchNorm):
    """Base for the pack's own BatchNorm layers; subclasses implement :meth:`check_input_dim`.

    torch's private ``_BatchNorm`` checks the input through the private ``_check_input_dim`` hook (torch 2.13).
    """

    def check_input_dim(self, input: Tensor) -> None:
        """Raise ``ValueError`` for an input this layer cannot normalise."""
        raise NotImplementedError(f"{type(self).__name__} must implement check_input_dim")

    def _check_input_dim(self, input: Tensor) -> None:
        self.check_input_dim(input)


NormBase = _NormBase  # BatchNorm and InstanceNorm layers with running statistics (torch 2.13)


def foreach_norm(tensors: list[Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[Tensor]:
    """One norm per tensor, in one multi-tensor kernel (torch's ``_foreach_norm``, 2.13)."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_mul_(tensors: list[Tensor], scalar: Tensor | float) -> None:
    """Multiply every tensor in place, in one multi-tensor kernel (torch's ``_foreach_mul_``, 2.13)."""
    torch._foreach_mul_(tensors, scalar)


def foreach_add_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """Add ``sources`` into ``targets`` in one multi-tensor kernel (torch's ``_foreach_add_``, 2.13)."""
    torch._foreach_add_(targets, sources)


def foreach_copy_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """Copy ``sources`` into ``targets`` in one multi-tensor kernel (torch's ``_foreach_copy_``, 2.13)."""
    torch._foreach_copy_(targets, sources)


def foreach_lerp_(targets: list[Tensor], ends: list[Tensor], weight: float) -> None:
    """``target += weight * (end - target)`` for every pair, in one multi-tensor kernel (``_foreach_lerp_``, 2.13)."""
    torch._foreach_lerp_(targets, ends, weight)


def fused_kernel_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on (``_get_fused_kernels_supported_devices``, 2.13)."""
    return _get_fused_kernels_supported_devices()


def supports_amp_scaling(optimizer: Optimizer) -> bool:
    """Whether the optimizer's step reads ``found_inf``/``grad_scale`` itself (fused kernels; torch 2.13)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def grad_scaler_scale(scaler: Any) -> Tensor | None:
    """A ``GradScaler``'s loss scale as its device tensor, or ``None`` before its first ``scale()``.

    ``get_scale()`` would read it on the host (torch 2.13's ``_scale``).
    """
    return getattr(scaler, "_scale", None)


def grad_scaler_tensors(scaler: Any) -> list[Tensor]:
    """The device tensors a ``GradScaler``'s state lives in: its scale and growth tracker, once it has scaled.

    torch 2.13's ``_scale`` and ``_growth_tracker``, ``None`` until the first ``scale()``.
    """
    found = [getattr(scaler, name, None) for name in ("_scale", "_growth_tracker")]
    return [t for t in found if isinstance(t, Tensor)]


# --------------------------------------------------------------------------------------------- torchmetrics names
def metric_progress(metric: Metric) -> tuple[int, Any]:
    """A metric's update count and cached ``compute()`` result (torchmetrics 1.9)."""
    return metric._update_count, metric._computed


def set_metric_progress(metric: Metric, progress: tuple[int, Any]) -> None:
    """Put back what :func:`metric_progress` returned."""
    metric._update_count, metric._computed = progress


# ------------------------------------------------------------------------------------------- FSDP2 (sharded) names
def set_mesh_sizes(strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int) -> None:
    """The device-mesh shape Lightning's ``ModelParallelStrategy`` builds at ``setup_environment`` (2.5.2-2.6.6)."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def release_mesh_process_groups(mesh: Any) -> None:
    """Drop the process groups a device mesh (and the mesh it was sliced from) holds: torch 2.13's ``_pg_registry``.

    For after ``destroy_process_group``: DTensor's caches keep the meshes, so the groups and their gloo threads, alive
    until the interpreter tears down. A mesh without the registry (an older torch) is left as it is.
    """
    for holder in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(holder, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def configure_launcher(strategy: "pl.strategies.Strategy") -> None:
    """Let a strategy build its launcher, as the Trainer's connector does once (2.5.2-2.6.6)."""
    strategy._configure_launcher()


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Give meta-device parameters real memory and initialise them (Lightning's, 2.5.2-2.6.6)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: list[Optimizer], device: torch.device) -> None:
    """Move optimizer state to ``device`` (Lightning's, 2.5.2-2.6.6)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def train_dataloader(trainer: "pl.Trainer") -> Any:
    """The training dataloader(s) the fit will use, built afresh on every call (2.5.2-2.6.6).

    From ``fit``'s argument, the datamodule or the module's ``train_dataloader`` hook: Lightning's fit-loop data source.
    """
    return trainer.fit_loop._data_source.dataloader()


def set_launcher(strategy: "pl.strategies.Strategy", launcher: Any) -> None:
    """Give a strategy the launcher another one built (Lightning's ``Strategy._launcher``, 2.5.2-2.6.6)."""
    strategy._launcher = launcher


def sharded_checkpoint_metadata(path: "str | os.PathLike") -> dict[str, Any]:
    """What a sharded checkpoint folder holds besides the shards: loops, callbacks, hyperparameters (2.5.2-2.6.6).

    Lightning's ``ModelParallelStrategy`` writes it with ``torch.save`` under ``_METADATA_FILENAME`` (``meta.pt``).
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return torch.load(os.path.join(path, _METADATA_FILENAME), map_location="cpu", weights_only=False)
