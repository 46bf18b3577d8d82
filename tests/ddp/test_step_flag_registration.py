"""Which DDP wraps carry a StepFlag: the strategy's hook registration, case by case, in one real gloo process."""

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.ddp.ddp import DDPStrategy
from lightning_mgpu.ddp.step_flag import StepFlag
from tests.helpers.processes import run_processes

# name: (comm_hook, timed, DDP keyword arguments, a Lightning ddp_comm_hook) -> (carried, timed)
CASES: dict[str, tuple[Any, bool, dict, bool]] = {
    "plain": (None, False, {}, False),
    "plain, timed": (None, True, {}, False),
    "fp16": ("fp16", False, {}, False),
    "bf16, timed": ("bf16", True, {}, False),
    "powersgd": ("powersgd", False, {}, False),
    "static_graph": (None, False, {"static_graph": True}, False),
    "find_unused_parameters": (None, False, {"find_unused_parameters": True}, False),
    "Lightning's ddp_comm_hook": (None, True, {}, True),
}
EXPECTED = {
    "plain": (True, False),
    "plain, timed": (True, True),
    "fp16": (True, False),
    "bf16, timed": (True, True),
    "powersgd": (False, False),
    "static_graph": (False, False),
    "find_unused_parameters": (False, False),
    "Lightning's ddp_comm_hook": (False, False),
}


class _Timer:
    """Stands in for PerformanceMonitor's CommTimer: its wrap is all the strategy uses."""

    def wrap(self, hook: Any) -> Any:
        return hook


def _lightning_hook(state: Any, bucket: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _registrations(rank: int, world_size: int) -> dict:
    found = {}
    for name, (hook, timed, ddp_kwargs, lightning_hook) in CASES.items():
        strategy = DDPStrategy(comm_hook=hook, **({"ddp_comm_hook": _lightning_hook} if lightning_hook else {}))
        strategy.step_service.carry_flag(StepFlag())
        strategy.step_service.time_reductions(_Timer() if timed else None)
        module = torch.nn.Linear(4, 4)
        strategy.model = DistributedDataParallel(module, **ddp_kwargs)
        strategy.register_own_comm_hook()
        found[name] = (strategy.step_service.flag_carried, strategy.comm_timed)
        if name == "plain":  # wrapped again: the flag's pre-hook moves, and the end of the fit removes it
            strategy.model = DistributedDataParallel(module)
            strategy.register_own_comm_hook()
            found["pre-hooks after a second wrap"] = len(module._forward_pre_hooks)
            strategy.step_service.flag.release()
            found["pre-hooks after release"] = len(module._forward_pre_hooks)
    return found


def test_the_strategy_carries_the_flag_where_it_can_and_says_where_it_cannot():
    (found,) = run_processes(_registrations, 1)
    for name, expected in EXPECTED.items():
        assert found[name] == expected, name
    assert found["pre-hooks after a second wrap"] == 1
    assert found["pre-hooks after release"] == 0
