"""The patches of Lightning, all named here: each wraps one method of a Lightning class, class-wide, once.

Each is probed (a missing class or method leaves Lightning as it is and the installer returns ``False``, for its
caller's fallback) and reversible (:func:`remove_patch`). A wrapper holds no state of its own: it asks an object of
the pack that the trainer or the call holds, and otherwise runs Lightning's method unchanged. Our wrapper carries
(name, itself): a wrapper someone else puts around ours copies that attribute, but not the identity.
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any

# name: (module, class, method); every method was read in the 2.5.2 source, and CI runs it on 2.5.6 and 2.6.6
PATCHES: dict[str, tuple[str, str, str]] = {
    # names the closest strategy for an unknown strategy flag
    "strategy_flag_hint": (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector",
        "_check_config_and_set_final_flags",
    ),
    # lets a strategy hand the Trainer the one it chose at launch
    "strategy_replacement": (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector",
        "_lazy_init_strategy",
    ),
    # the per-batch SIGTERM broadcast, replaced where a trainer's signal connector is a SigtermSignals
    "sigterm_batch_check": (
        "lightning.pytorch.loops.training_epoch_loop",
        "_TrainingEpochLoop",
        "_broadcast_sigterm_tensor",
    ),
    # the fit loop's end, announced to a trainer's SigtermSignals before the on_train_end hooks
    "leaving_training": ("lightning.pytorch.loops.fit_loop", "_FitLoop", "on_run_end"),
    # ``self.log`` calls held back inside LogCapture
    "log_capture": ("lightning.pytorch.core.module", "LightningModule", "log"),
}


def patched_class(name: str) -> Any:
    """The Lightning class patch ``name`` wraps a method of, or ``None`` where this Lightning lacks it."""
    module, cls, _ = PATCHES[name]
    try:
        return getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None


def _method(name: str) -> Any:
    return getattr(patched_class(name), PATCHES[name][2], None)


def _is_ours(function: Any, name: str) -> bool:
    return getattr(function, "lightning_mgpu_patch", None) == (name, function)


def _in_chain(method: Any, name: str) -> bool:
    # ours, or under the wrappers others put around it since
    while method is not None:
        if _is_ours(method, name):
            return True
        method = getattr(method, "__wrapped__", None)
    return False


def install_patch(name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Wrap the method of patch ``name`` with ``make_wrapper(lightning's method)``, unless our wrapper is there.

    Returns:
        Whether the patch is in place (``False``: this Lightning lacks the class or the method).
    """
    method = _method(name)
    if method is None:
        return False
    if not _in_chain(method, name):
        wrapper = functools.wraps(method)(make_wrapper(method))
        wrapper.lightning_mgpu_patch = (name, wrapper)  # type: ignore[attr-defined]
        setattr(patched_class(name), PATCHES[name][2], wrapper)
    return True


def remove_patch(name: str) -> bool:
    """Give Lightning its own method back; returns whether the patch ``name`` was removed.

    Only an outermost wrapper is removed: one that someone else wrapped since stays (``False``), so that their
    wrapper is not lost.
    """
    method = _method(name)
    if method is None or not _is_ours(method, name):
        return False
    setattr(patched_class(name), PATCHES[name][2], method.__wrapped__)
    return True


def installed_patches() -> list[str]:
    """The names of :data:`PATCHES` in place now, under other wrappers or not."""
    return [name for name in PATCHES if _in_chain(_method(name), name)]
