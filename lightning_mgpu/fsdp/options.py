"""The options of FSDP, declared once for ``FSDPStrategy`` and ``MultiGPUStrategy`` (see ``core/options.py``)."""

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

from lightning_mgpu.core.options import FSDP, MGPU, Check, Option, boolean, choice, class_names
from lightning_mgpu.core.validation import check_int

Sharding: TypeAlias = Literal["full", "grad_op", "hybrid"]
SHARDINGS: tuple[str, ...] = ("full", "grad_op", "hybrid")

__all__ = ["FSDP_OPTIONS", "SHARDINGS", "Sharding", "check_shard_group_size"]


def check_shard_group_size(owner: str, sharding: str, shard_group_size: int | None) -> None:
    """Check ``shard_group_size`` against ``sharding``.

    Raises:
        TypeError: not an int or ``None``.
        ValueError: below 1, or given with a ``sharding`` other than ``"hybrid"``.
    """
    check_int(owner, "shard_group_size", shard_group_size, minimum=1, allow_none=True, hint="None takes one node")
    if shard_group_size is not None and sharding != "hybrid":
        raise ValueError(
            f"{owner}: shard_group_size={shard_group_size} applies to sharding='hybrid' only, got "
            f"sharding={sharding!r}; use sharding='hybrid' or leave shard_group_size=None"
        )


def _check_group(owner: str, name: str, value: Any, values: Mapping[str, Any]) -> None:
    check_shard_group_size(owner, values["sharding"], value)


_BOTH = (FSDP, MGPU)

FSDP_OPTIONS: tuple[Option, ...] = (
    Option(
        "sharding",
        Sharding,
        "full",
        "`'full'` shards parameters, gradients and optimizer state, gathering each unit for its forward and again "
        "for its backward (ZeRO-3); `'grad_op'` keeps a unit's gathered parameters from its forward to its backward "
        "and shards gradients and optimizer state (ZeRO-2-like: less communication, more memory); `'hybrid'` shards as "
        "`'full'` within groups of `shard_group_size` processes (one node by default) and replicates across the "
        "groups (HSDP, a 2-D device mesh): only the gradient all-reduce crosses nodes.",
        _BOTH,
        choice(SHARDINGS),
    ),
    Option(
        "shard_group_size",
        int | None,
        None,
        "with `sharding='hybrid'`, the processes that share one copy of the sharded state; `None` takes one node's "
        "(the Trainer's `devices`). The world size must be a multiple of it.",
        _BOTH,
        Check("int >= 1, `None`", _check_group),
    ),
    Option(
        "shard_units",
        Literal["auto"] | list[str],
        "auto",
        "`'auto'` (the model's repeated blocks) or the class names of the modules to shard as units; a class whose "
        "modules would split a tied parameter is refused at `setup`.",
        _BOTH,
        class_names(allow_none=False),
    ),
    Option(
        "cpu_offload",
        bool,
        False,
        "keep parameter, gradient and optimizer shards in host memory, computing on the GPU (CUDA only).",
        _BOTH,
        boolean(),
    ),
    Option(
        "save_distributed_checkpoint",
        bool,
        True,
        "`False` gathers the full weights and optimizer state on rank 0 into one file instead of a folder of shards.",
        (FSDP,),
        boolean(),
    ),
)
