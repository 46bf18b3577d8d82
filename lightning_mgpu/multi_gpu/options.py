"""The options of ``MultiGPUStrategy`` alone (see :mod:`lightning_mgpu.core.options`)."""

from collections.abc import Mapping
from typing import Any

from lightning_mgpu.core.options import MGPU, Check, Option, choice
from lightning_mgpu.core.strategy_choice import MODES, ModeOrAuto
from lightning_mgpu.core.validation import check_positive

__all__ = ["MULTI_GPU_OPTIONS"]


def _check_budget(owner: str, name: str, value: Any, values: Mapping[str, Any]) -> None:
    if value is not None:
        check_positive(owner, name, value, unit="MB", hint="or None")


MULTI_GPU_OPTIONS: tuple[Option, ...] = (
    Option(
        "mode",
        ModeOrAuto,
        "auto",
        "`'auto'` chooses from the hardware and the launch context (the decision table); or force `'single'`, `'dp'`, "
        "`'ddp'`, `'ddp_spawn'`, `'ddp_fork'`, or `'fsdp'`: FSDP2 sharding of the unmodified module, one process per "
        "device (the Trainer then runs an `FSDPStrategy`).",
        (MGPU,),
        choice(MODES),
    ),
    Option(
        "memory_budget_mb",
        float | None,
        None,
        "with `mode='auto'` and several processes, plan against this many MB per device instead of the device's free "
        "memory; the memory plan then runs on CPU too.",
        (MGPU,),
        Check("number > 0, `None`", _check_budget),
    ),
)
