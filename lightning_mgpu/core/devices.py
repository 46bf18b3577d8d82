"""Device and accelerator arithmetic, in one place: which accelerator a Trainer flag means, how many devices it counts.

Pure functions of the Trainer's ``accelerator``, ``devices`` and ``num_nodes``, used by the batch-size arithmetic of
the configs, the ``env`` command and :class:`~lightning_mgpu.MultiGPUStrategy`. Nothing here initialises CUDA: GPUs are
counted through NVML, as Lightning counts them.
"""

from typing import Any

from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.accelerators import (
    Accelerator,
    AcceleratorRegistry,
    CPUAccelerator,
    CUDAAccelerator,
    MPSAccelerator,
)

__all__ = ["accelerator_name", "count_processes", "devices_per_node"]

_NAME_THE_COUNT = "name the number of devices per node instead (--trainer.devices=N, or devices: N in a config)"


def accelerator_name(accelerator: str | Accelerator | None) -> str:
    """The accelerator a Trainer flag or object stands for: ``"cuda"``, ``"cpu"``, ``"mps"``...

    ``"auto"`` (or ``None``) is CUDA where torch sees a GPU, else CPU; ``"gpu"`` is CUDA, or MPS on a Mac without CUDA.

    Raises:
        ValueError: a name that is not in Lightning's ``AcceleratorRegistry``.

    Example::

        accelerator_name("auto")  # "cpu" on a machine without GPUs
        accelerator_name(trainer.accelerator)  # "cuda"
    """
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    if isinstance(accelerator, CPUAccelerator):
        return "cpu"
    if isinstance(accelerator, Accelerator):
        return type(accelerator).__name__.replace("Accelerator", "").lower() or "unknown"
    name = str(accelerator or "auto")
    if name in ("auto", "gpu"):
        if num_cuda_devices() > 0:
            return "cuda"
        if name == "gpu" and MPSAccelerator.is_available():
            return "mps"
        return "cpu" if name == "auto" else "cuda"
    if name not in AcceleratorRegistry:
        raise ValueError(f"accelerator={accelerator!r} is not one of {sorted(AcceleratorRegistry)}")
    return name


def devices_per_node(devices: Any, accelerator: str = "auto") -> int:
    """The number of devices per node a Trainer's ``devices`` gives, counted as the Trainer counts them.

    ``4`` or ``"4"`` (a count), ``"0,1"`` or ``[0, 1]`` (indices), ``-1`` (every CUDA GPU) or ``"auto"`` (every CUDA
    GPU, one CPU or MPS device). Only ``-1`` and ``"auto"`` look at the hardware, so a config naming its devices
    resolves on a machine without them (a login node).

    Args:
        devices: the Trainer's ``devices``.
        accelerator: the Trainer's ``accelerator`` flag (resolved with :func:`accelerator_name`).

    Raises:
        ValueError: a value that is not a count or a list of indices, or ``-1``/``"auto"`` on CUDA with no GPU here.
    """
    name = accelerator_name(accelerator)
    text = devices.strip() if isinstance(devices, str) else devices
    if isinstance(text, (list, tuple)) and text and all(isinstance(i, int) and not isinstance(i, bool) for i in text):
        return len(text)
    if isinstance(text, str) and "," in text:
        indices = [i for i in text.split(",") if i.strip()]
        if indices and all(i.strip().isdigit() for i in indices):
            return len(indices)
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool) and text >= 1:
        return text
    if text in ("auto", -1, "-1"):
        if name == "cuda":
            found = num_cuda_devices()
            if found == 0:
                raise ValueError(
                    f"devices={devices!r} with accelerator='cuda': torch sees no CUDA GPU on this machine to count;"
                    f" {_NAME_THE_COUNT}"
                )
            return found
        if text == "auto":
            return 1  # Lightning's CPU and MPS accelerators use one device by default
        if str(accelerator or "auto") == "auto":
            raise ValueError(
                f"devices={devices!r} counts every CUDA GPU, but accelerator='auto' found none here and chose"
                f" {name!r}; {_NAME_THE_COUNT}"
            )
    raise ValueError(
        f"devices={shown(devices)!r} cannot be used with accelerator={name!r}: give a count >= 1"
        " (--trainer.devices=N), indices such as '0,1' or [0, 1], or 'auto' (-1 too on CUDA)"
    )


def count_processes(devices: Any, num_nodes: Any = 1, accelerator: str = "auto") -> int:
    """The number of training processes a Trainer with these settings runs: devices per node times nodes.

    Whether the accelerator accepts the value (CPU takes a count only) is left to the Trainer. A launcher's
    ``WORLD_SIZE`` is not consulted: a launching process and the processes it starts compute the same number.
    DataParallel (one process over several GPUs) is not accounted for.

    Raises:
        ValueError: as :func:`devices_per_node`, or a ``num_nodes`` below 1.

    Example::

        count_processes(devices=4, num_nodes=2)  # 8
    """
    per_node = devices_per_node(devices, accelerator)
    if not is_positive_int(num_nodes):
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    return per_node * int(num_nodes)


def shown(value: Any) -> Any:
    """A value as the Trainer takes it: a count interpolated from the command line arrives as a string."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def is_positive_int(value: Any) -> bool:
    """Whether ``value`` is an int >= 1, or a string of one (a command-line value)."""
    return not isinstance(value, bool) and str(value).strip().isdigit() and int(value) >= 1
