"""Which concrete strategy ``MultiGPUStrategy`` becomes: a pure decision over the launch context."""

import sys
from dataclasses import dataclass
from typing import Literal, get_args

import torch

Mode = Literal["single", "dp", "ddp", "ddp_spawn", "ddp_fork", "fsdp"]
ModeOrAuto = Literal["auto", "single", "dp", "ddp", "ddp_spawn", "ddp_fork", "fsdp"]
MODES: tuple[str, ...] = get_args(ModeOrAuto)
DDP_MODES: tuple[str, ...] = ("ddp", "ddp_spawn", "ddp_fork")


@dataclass(frozen=True)
class LaunchContext:
    """What the decision looks at; read from the Trainer's connector and the process, never from CUDA itself.

    Args:
        accelerator: ``"cpu"``, ``"cuda"`` or another accelerator's name.
        num_devices: devices of this node given to the Trainer.
        num_nodes: the Trainer's ``num_nodes``.
        external_launcher: name of the cluster environment if processes were created outside Lightning
            (torchrun, SLURM's srun, a Lightning parent process), else ``None``.
        external_world_size: the world size that launcher reports (1 when unknown).
        interactive: a Python REPL or notebook, where Lightning cannot re-run the script.
        cuda_initialized: CUDA already initialised in this process, so forked children cannot use it.
        fork_available: the ``fork`` start method exists on this platform.
    """

    accelerator: str
    num_devices: int
    num_nodes: int = 1
    external_launcher: str | None = None
    external_world_size: int = 1
    interactive: bool = False
    cuda_initialized: bool = False
    fork_available: bool = True


@dataclass(frozen=True)
class StrategyChoice:
    """The mode chosen and a sentence saying why, readable as ``trainer.strategy.choice`` after Trainer init.

    Args:
        mode: one of ``"single"``, ``"dp"``, ``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``, ``"fsdp"``.
        reason: why this mode was chosen.
    """

    mode: Mode
    reason: str


def is_interactive() -> bool:
    """Whether this process is a REPL or notebook, checked now (Lightning caches it at import)."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def choose_strategy(context: LaunchContext) -> StrategyChoice:
    """Choose single device, DataParallel or a DDP flavour for ``context``.

    Args:
        context: the hardware and launch facts.

    Example::

        >>> choose_strategy(LaunchContext(accelerator="cpu", num_devices=2)).mode
        'ddp'
    """
    ctx = context
    devices = f"{ctx.num_devices} {ctx.accelerator} device{'s' if ctx.num_devices != 1 else ''}"
    if ctx.num_nodes > 1:
        return StrategyChoice("ddp", f"num_nodes={ctx.num_nodes}: multi-node training needs DDP")
    if ctx.external_launcher is not None and (ctx.external_world_size > 1 or ctx.num_devices > 1):
        return StrategyChoice(
            "ddp",
            f"processes were launched by {ctx.external_launcher} (world size {ctx.external_world_size}): "
            "DDP joins them",
        )
    if ctx.num_devices <= 1:
        return StrategyChoice("single", f"{devices}: nothing to parallelise")
    if not ctx.interactive:
        return StrategyChoice("ddp", f"{devices} from a script: DDP, one process per device launched by Lightning")
    if ctx.accelerator != "cuda":
        if ctx.fork_available:
            return StrategyChoice("ddp_fork", f"{devices} in an interactive session: DDP with forked processes")
        return StrategyChoice("ddp_spawn", f"{devices} in an interactive session without fork: DDP with spawn")
    if ctx.cuda_initialized:
        return StrategyChoice(
            "dp",
            f"{devices} in an interactive session where CUDA is already initialised: forked processes could not "
            "use CUDA, so DataParallel in this process",
        )
    if not ctx.fork_available:
        return StrategyChoice(
            "dp", f"{devices} in an interactive session on a platform without fork: DataParallel in this process"
        )
    return StrategyChoice(
        "ddp_fork", f"{devices} in an interactive session with CUDA not yet initialised: DDP with forked processes"
    )


def force_mode(mode: Mode, context: LaunchContext) -> StrategyChoice:
    """Validate a mode the user forced against ``context`` and explain it.

    Args:
        mode: the forced mode.
        context: the hardware and launch facts.

    Raises:
        ValueError: ``"dp"`` without CUDA devices, or ``"single"`` with several devices or nodes.
    """
    if mode == "dp" and context.accelerator != "cuda":
        raise ValueError(
            f"MultiGPUStrategy(mode='dp') needs CUDA GPUs, but the Trainer's accelerator is "
            f"{context.accelerator!r}; DataParallel splits a batch across GPUs of one process. "
            "Use mode='ddp' (or 'auto') for CPU devices."
        )
    if mode == "single" and (context.num_devices > 1 or context.num_nodes > 1):
        raise ValueError(
            f"MultiGPUStrategy(mode='single') runs on exactly one device, but the Trainer was given "
            f"{context.num_devices} device(s) on {context.num_nodes} node(s); pass devices=1 or choose another mode."
        )
    if mode == "fsdp" and context.external_launcher is None and context.interactive:
        raise ValueError(
            "MultiGPUStrategy(mode='fsdp') launches one process per device by re-running the script, which an "
            "interactive session cannot do; run it as a script (or under torchrun)."
        )
    if mode == "ddp_fork" and not context.fork_available:
        raise ValueError("MultiGPUStrategy(mode='ddp_fork') needs the 'fork' start method, which this platform lacks")
    return StrategyChoice(mode, f"mode={mode!r} was set explicitly")


def cuda_is_initialized() -> bool:
    """Whether CUDA is initialised in this process, without initialising it."""
    return torch.cuda.is_initialized()
