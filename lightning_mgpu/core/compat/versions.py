"""Which Lightning, torch and torchmetrics releases the door was tested on, and the check of Lightning's internals."""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from packaging.version import Version

from lightning_mgpu.core.compat.step_dispatch import step_dispatch_present

# lowest tested release, first untested minor: CI runs the suite on the newest 2.6 patch and the strategies, callbacks
# and configs tests on the newest 2.5 patch; the SIGTERM names were read in the 2.5.2 source, where they appeared
TESTED_LIGHTNING_RANGE = ("2.5.2", "2.7")
TESTED_TORCH = "2.13"  # CI's torch, the only one the torch names below were run on
TESTED_TORCHMETRICS = "1.9"  # likewise
# "(2.5.2-2.6.6)" on an accessor: the name is in the 2.5.2 source and CI runs it on 2.5.6 and 2.6.6


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning lacks an internal the pack needs; raised at ``setup``, naming every missing one."""


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
    # where the Trainer keeps its strategy: replace_trainer_strategy hands it the memory plan's FSDPStrategy
    Internal("Trainer._accelerator_connector.strategy", lambda t: _has(getattr(t, "_accelerator_connector", None),
                                                                      "strategy")),
    # where the loops hand a step to the strategy: OOMBackoff routes the evaluation steps through it
    Internal("trainer.call._call_strategy_hook", step_dispatch_present),
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
