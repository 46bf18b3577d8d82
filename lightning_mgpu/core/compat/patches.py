"""The patches of Lightning, all named here: each wraps a Lightning class's method class-wide, or a module's function.

Each is probed (a missing class, module or attribute leaves Lightning as it is and the installer returns ``False``, for
its caller's fallback) and reversible (:func:`remove_patch`). A class-wide wrapper holds no state of its own: it asks
an object of the pack that the trainer or the call holds, and otherwise runs Lightning's method unchanged. Our wrapper
carries (name, itself): a wrapper someone else puts around ours copies that attribute, but not the identity.

All but one are put in place when the pack first needs them and stay. ``eval_step_routing`` (``step_dispatch.py``)
wraps a function Lightning calls for every step, the training step too, so it is there only while an evaluation loop
routes its steps, and one wrapper serves one trainer.
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any

# name: (module, class or None for a function of the module, attribute); every one was read in the 2.5.2 source, and
# CI runs it on 2.5.6 and 2.6.6
PATCHES: dict[str, tuple[str, str | None, str]] = {
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
    # one trainer's evaluation steps sent to OOMBackoff while its evaluation loop runs (step_dispatch.py)
    "eval_step_routing": ("lightning.pytorch.trainer.call", None, "_call_strategy_hook"),
}
# put in place per evaluation loop, not when the pack first needs them
PER_LOOP_PATCHES = frozenset({"eval_step_routing"})


def patched_class(name: str) -> Any:
    """The Lightning class (or module) whose attribute patch ``name`` wraps; ``None`` where this Lightning lacks it."""
    module, cls, _ = PATCHES[name]
    try:
        owner = importlib.import_module(module)
    except ImportError:
        return None
    return owner if cls is None else getattr(owner, cls, None)


def mark(wrapper: Any, name: str) -> None:
    """Mark ``wrapper`` as the pack's patch ``name`` (by identity: a copy of the attribute is not ours)."""
    wrapper.lightning_mgpu_patch = (name, wrapper)


def is_ours(function: Any, name: str) -> bool:
    """Whether ``function`` is the pack's wrapper for patch ``name`` itself (not another wrapper around it)."""
    return getattr(function, "lightning_mgpu_patch", None) == (name, function)


def wrappers_in_chain(method: Any, name: str) -> int:
    """How many of the pack's wrappers for patch ``name`` are in ``method``'s chain of ``__wrapped__``."""
    count = 0
    while method is not None:
        count += is_ours(method, name)
        method = getattr(method, "__wrapped__", None)
    return count


def current(name: str) -> Any:
    """What patch ``name``'s class or module holds now, or ``None`` where this Lightning lacks it.

    That is Lightning's own, ours, or someone's wrapper around either.
    """
    return getattr(patched_class(name), PATCHES[name][2], None)


def replace(name: str, function: Any) -> None:
    """Give patch ``name``'s class or module ``function`` in place of what it holds now."""
    setattr(patched_class(name), PATCHES[name][2], function)


def install_patch(name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Wrap the method of patch ``name`` with ``make_wrapper(lightning's method)``, unless our wrapper is there.

    Returns:
        Whether the patch is in place (``False``: this Lightning lacks the class or the method).

    Raises:
        ValueError: ``name`` is put in place per evaluation loop (:data:`PER_LOOP_PATCHES`), by its own function.
    """
    if name in PER_LOOP_PATCHES:
        raise ValueError(f"the patch {name!r} is put in place per evaluation loop (route_eval_steps), not installed")
    method = current(name)
    if method is None:
        return False
    if not wrappers_in_chain(method, name):
        wrapper = functools.wraps(method)(make_wrapper(method))
        mark(wrapper, name)
        replace(name, wrapper)
    return True


def remove_patch(name: str) -> bool:
    """Give Lightning its own method back; returns whether the patch ``name`` was removed.

    Only an outermost wrapper is removed: one that someone else wrapped since stays (``False``), so that their
    wrapper is not lost. Removing ``eval_step_routing`` ends the routing of the evaluation loop running now.
    """
    method = current(name)
    if method is None or not is_ours(method, name):
        return False
    replace(name, method.__wrapped__)
    return True


def installed_patches() -> list[str]:
    """The names of :data:`PATCHES` in place now, under other wrappers or not."""
    return [name for name in PATCHES if wrappers_in_chain(current(name), name)]
