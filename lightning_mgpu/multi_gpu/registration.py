"""The strategy names the pack registers with Lightning's ``StrategyRegistry``, and the hint for a mistyped one."""

import difflib
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu.core import compat
from lightning_mgpu.multi_gpu.multi_gpu import MultiGPUStrategy

# name -> (MultiGPUStrategy arguments, description)
REGISTERED_STRATEGIES: dict[str, tuple[dict, str]] = {
    "mgpu": ({"mode": "auto"}, "single device, DataParallel or DDP, chosen from the hardware and launch context"),
    "mgpu_ddp": ({"mode": "ddp"}, "DDP, processes launched by re-running the script (or by torchrun/SLURM)"),
    "mgpu_ddp_spawn": ({"mode": "ddp_spawn"}, "DDP with processes started by spawn"),
    "mgpu_ddp_fork": ({"mode": "ddp_fork"}, "DDP with forked processes (notebooks)"),
    "mgpu_dp": ({"mode": "dp"}, "DataParallel over the GPUs of one process"),
    "mgpu_fsdp": ({"mode": "fsdp"}, "FSDP2 sharding of the unmodified module over one process per device"),
    "mgpu_ddp_fp16": ({"mode": "ddp", "comm_hook": "fp16"}, "DDP with fp16 gradient compression"),
    "mgpu_ddp_bf16": ({"mode": "ddp", "comm_hook": "bf16"}, "DDP with bf16 gradient compression"),
    # gradients as bucket views: no copy in and out of the 2 x model-size buckets each step (+5% measured)
    "mgpu_ddp_powersgd": (
        {"mode": "ddp", "comm_hook": "powersgd", "gradient_as_bucket_view": True},
        "DDP with PowerSGD gradient compression",
    ),
}


def register_strategies() -> None:
    """Register every name of ``REGISTERED_STRATEGIES``; safe to call more than once.

    Also adds :func:`unknown_strategy_message` to the error a ``Trainer`` raises for an unknown strategy name (see
    :func:`install_strategy_name_hint`).
    """
    for name, (init_params, description) in REGISTERED_STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, MultiGPUStrategy, description=description, **init_params)
    install_strategy_name_hint()


def unknown_strategy_message(name: str) -> str | None:
    """What to tell a user who named a strategy that is not registered; ``None`` when ``name`` is fine.

    Lists the names this package registers and suggests the closest registered name (Lightning's included).

    Args:
        name: a ``Trainer(strategy=...)`` string; compared in lower case, as the Trainer does.

    Example::

        unknown_strategy_message("mgpu_dpp")  # "... did you mean 'mgpu_dp' or 'mgpu_ddp'?"
    """
    lowered = name.lower()
    if lowered == "auto" or lowered in StrategyRegistry:
        return None
    ours = ", ".join(REGISTERED_STRATEGIES)
    message = f"strategy={name!r} is not a registered strategy name. lightning_mgpu registers: {ours}"
    close = difflib.get_close_matches(lowered, StrategyRegistry.available_strategies(), n=2)
    if close:
        message += f"; did you mean {' or '.join(map(repr, close))}?"
    else:
        message += " (and Lightning its own: lightning.pytorch.strategies.StrategyRegistry.available_strategies())."
    return message


def install_strategy_name_hint() -> bool:
    """Make ``Trainer(strategy="mgpu_dpp")`` say what is registered and which name is closest; idempotent.

    Lightning refuses an unknown name with a fixed list of examples that names none of ours. The same ``ValueError``
    gets :func:`unknown_strategy_message` appended, and nothing else changes. Where this Lightning checks the flag
    elsewhere (see :func:`lightning_mgpu.core.compat.install_strategy_flag_hint`), its own message stays as it is.

    Returns:
        Whether the hint is in place.
    """

    def add_hint(strategy: Any, err: ValueError) -> None:
        hint = unknown_strategy_message(strategy) if isinstance(strategy, str) else None
        if hint is not None and "strategy name" in str(err):
            err.args = (f"{err}\n{hint}", *err.args[1:])  # Lightning's error, once, with the hint added

    return compat.install_strategy_flag_hint(add_hint)


__all__ = ["REGISTERED_STRATEGIES", "install_strategy_name_hint", "register_strategies", "unknown_strategy_message"]
