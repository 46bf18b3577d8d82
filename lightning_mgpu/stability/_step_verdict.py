"""Whether the optimizer step under way is bad: decided once per step by NaNSkip, read by every callback.

NaNSkip registers a decider for each optimizer at the start of ``fit``. The first callback that asks in a step,
NaNSkip itself or GradientClipping's z-score statistics, has the decision taken (on the device); later ones get the
same tensor. So what counts as a bad step is the same for every callback, whatever their order.
"""

import weakref
from collections.abc import Callable

from torch import Tensor
from torch.optim import Optimizer

Decider = Callable[[Optimizer, list[Tensor], int], Tensor]

_DECIDERS: "weakref.WeakKeyDictionary[Optimizer, Decider]" = weakref.WeakKeyDictionary()
# optimizer -> (step, parameter ids, verdict): replaced every optimizer step
_VERDICTS: "weakref.WeakKeyDictionary[Optimizer, tuple[int, tuple[int, ...], Tensor]]" = weakref.WeakKeyDictionary()


def register_step_decider(optimizer: Optimizer, decide: Decider) -> None:
    """Make ``decide(optimizer, params, step)`` the one source of ``optimizer``'s per-step verdict."""
    _DECIDERS[optimizer] = decide
    _VERDICTS.pop(optimizer, None)


def unregister_step_decider(optimizer: Optimizer, decide: Decider) -> None:
    """Forget ``decide`` for ``optimizer`` (if it is still the registered one)."""
    if _DECIDERS.get(optimizer) == decide:
        del _DECIDERS[optimizer]
    _VERDICTS.pop(optimizer, None)


def step_is_bad(optimizer: Optimizer, params: list[Tensor], step: int) -> Tensor | None:
    """A boolean device tensor, true when the step under way will be skipped; ``None`` when nobody decides that.

    Args:
        optimizer: the optimizer about to step.
        params: its parameters that have a gradient.
        step: the trainer's global step, which names the optimizer step under way.
    """
    decide = _DECIDERS.get(optimizer)
    if decide is None:
        return None
    ids = tuple(id(p) for p in params)
    cached = _VERDICTS.get(optimizer)
    if cached is not None and cached[0] == step and cached[1] == ids:
        return cached[2]
    verdict = decide(optimizer, params, step)
    _VERDICTS[optimizer] = (step, ids, verdict)
    return verdict


def clear_step_verdicts() -> None:
    """Forget every verdict: called after each backward pass (new gradients, a new decision)."""
    _VERDICTS.clear()
