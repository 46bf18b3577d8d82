"""Lightning's dispatch of a step to the strategy, and the pack's one reversible hook on it (2.5.2-2.6.6).

The hook is named ``eval_step_routing`` in :data:`~lightning_mgpu.core.compat.patches.PATCHES`, with the others.

Lightning's evaluation and prediction loops run each step as ``call._call_strategy_hook(trainer, "validation_step",
batch, ...)``: the function looks the method up on ``trainer.strategy`` and calls it under the profiler, with nothing
around the call that could run it again. OOMBackoff runs an evaluation step again, in smaller pieces, after an
out-of-memory error. The strategy may be Lightning's, the pack's or the user's class and the step is the user's
module's, so short of shadowing their methods in instance dicts, the one point on that path the pack can wrap is the
dispatcher. :func:`route_eval_steps` wraps it for one trainer, for as long as one evaluation loop runs, and gives
Lightning its own function back after; every other call (another trainer's, the training step's) goes through as it
came.
"""

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_mgpu.core.compat import patches

# its entry in compat.patches.PATCHES (lightning.pytorch.trainer.call._call_strategy_hook), where every patch is named
STEP_DISPATCH_PATCH = "eval_step_routing"
EVAL_STEPS = frozenset({"validation_step", "test_step", "predict_step"})

RunStep = Callable[..., Any]


def step_dispatch_present(trainer: "pl.Trainer | None" = None) -> bool:
    """Whether this Lightning dispatches its steps through ``trainer.call._call_strategy_hook`` (the probe)."""
    return callable(patches.current(STEP_DISPATCH_PATCH))


def eval_step_routes() -> int:
    """How many of the pack's routings wrap Lightning's dispatcher now, active or left inside a newer wrapper."""
    return patches.wrappers_in_chain(patches.current(STEP_DISPATCH_PATCH), STEP_DISPATCH_PATCH)


def route_eval_steps(trainer: "pl.Trainer", run_step: RunStep) -> Callable[[], None]:
    """Send ``trainer``'s evaluation steps to ``run_step`` until the function returned is called.

    ``run_step(hook_name, step, *args, **kwargs)`` is called in place of Lightning's dispatch of ``validation_step``,
    ``test_step`` or ``predict_step`` with the step's arguments (the batch first); ``step(*args, **kwargs)`` runs
    Lightning's dispatch of that step (the strategy's method, under the profiler) on arguments of its choice, as
    often as it likes. The module's ``_current_fx_name`` says the step's name around ``run_step``, as it did around
    the strategy's method. Every other call, and every other trainer's, goes to Lightning's function unchanged.

    Returns the undo: it gives Lightning its function back, or, where someone wrapped ours since, leaves ours inside
    their wrapper passing every call through (removed as soon as it is outermost again).
    """
    original = patches.current(STEP_DISPATCH_PATCH)

    def dispatch(target: "pl.Trainer", hook_name: str, *args: Any, **kwargs: Any) -> Any:
        if not (dispatch.lightning_mgpu_active and target is trainer and hook_name in EVAL_STEPS):
            return original(target, hook_name, *args, **kwargs)
        module = target.lightning_module
        previous = module._current_fx_name
        module._current_fx_name = hook_name
        output = run_step(hook_name, functools.partial(original, target, hook_name), *args, **kwargs)
        module._current_fx_name = previous  # as Lightning's dispatch: left as it is when the step raises
        return output

    functools.update_wrapper(dispatch, original)
    patches.mark(dispatch, STEP_DISPATCH_PATCH)
    dispatch.lightning_mgpu_active = True  # type: ignore[attr-defined]
    patches.replace(STEP_DISPATCH_PATCH, dispatch)

    def undo() -> None:
        dispatch.lightning_mgpu_active = False  # type: ignore[attr-defined]
        current = patches.current(STEP_DISPATCH_PATCH)
        # unwrap ours while it is outermost and done with
        while patches.is_ours(current, STEP_DISPATCH_PATCH) and not getattr(current, "lightning_mgpu_active", False):
            current = current.__wrapped__
        patches.replace(STEP_DISPATCH_PATCH, current)

    return undo
