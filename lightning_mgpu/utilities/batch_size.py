"""How many processes a Trainer's settings give, and the per-process share of a global batch.

Pure arithmetic on the Trainer's ``devices``, ``num_nodes``, ``accumulate_grad_batches`` and ``accelerator``, for
configs that state a global batch size (see :mod:`lightning_mgpu.cli`). Nothing here initialises CUDA.
"""

from typing import Any

from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.accelerators import AcceleratorRegistry, MPSAccelerator


def count_processes(devices: Any, num_nodes: Any = 1, accelerator: str = "auto") -> int:
    """The number of training processes a Trainer with these settings runs: devices per node times nodes.

    ``devices`` is counted as the Trainer counts it: ``4`` or ``"4"`` (a count), ``"0,1"`` or ``[0, 1]`` (indices),
    ``-1`` (every CUDA GPU) or ``"auto"``. Only ``-1`` and ``"auto"`` look at the hardware, so a config naming its
    devices resolves on a machine without them (a login node); whether the accelerator accepts the value (CPU takes
    a count only) is left to the Trainer. A launcher's ``WORLD_SIZE`` is not consulted: a launching process and the
    processes it starts compute the same number. DataParallel (one process over several GPUs) is not accounted
    for: there the per-process batch is the whole batch.

    Args:
        devices: the Trainer's ``devices``.
        num_nodes: the Trainer's ``num_nodes``.
        accelerator: the Trainer's ``accelerator``; ``"auto"`` means CUDA where torch sees GPUs, else CPU.

    Raises:
        ValueError: a value that is not a device count or list, a ``num_nodes`` below 1, an unknown accelerator, or
            ``-1``/``"auto"`` on CUDA with no GPU here.

    Example::

        count_processes(devices=4, num_nodes=2)  # 8
    """
    name = _accelerator_name(accelerator)
    per_node = _devices_per_node(devices, name, accelerator)
    if not _is_positive_int(num_nodes):
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    return per_node * int(num_nodes)


def per_device_batch_size(
    global_batch_size: Any,
    devices: Any,
    num_nodes: Any = 1,
    accumulate_grad_batches: Any = 1,
    accelerator: str = "auto",
) -> int:
    """The per-process batch size giving ``global_batch_size`` samples per optimizer step.

    Args:
        global_batch_size: samples per optimizer step over all processes and accumulated batches.
        devices: the Trainer's ``devices``.
        num_nodes: the Trainer's ``num_nodes``.
        accumulate_grad_batches: the Trainer's ``accumulate_grad_batches``.
        accelerator: the Trainer's ``accelerator``.

    Raises:
        ValueError: when the global batch does not split evenly, naming every number involved.

    Example::

        per_device_batch_size(256, devices=4, num_nodes=2)  # 32
    """
    if not _is_positive_int(global_batch_size):
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if not _is_positive_int(accumulate_grad_batches):
        raise ValueError(f"accumulate_grad_batches must be a positive int, got {accumulate_grad_batches!r}")
    processes = count_processes(devices, num_nodes, accelerator)
    accumulate = int(accumulate_grad_batches)
    share, remainder = divmod(int(global_batch_size), processes * accumulate)
    if remainder or share == 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split evenly over {processes} processes"
            f" (devices={_shown(devices)!r} x num_nodes={_shown(num_nodes)!r}) x accumulate_grad_batches={accumulate}:"
            f" choose a multiple of {processes * accumulate}"
        )
    return share


def _shown(value: Any) -> Any:
    # values interpolated from the command line arrive as strings: show a count as the int the Trainer takes
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and str(value).strip().isdigit() and int(value) >= 1


def _devices_per_node(devices: Any, accelerator: str, given_accelerator: Any) -> int:
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
    name_the_count = "name the number of devices per node instead (--trainer.devices=N, or devices: N in a config)"
    if text in ("auto", -1, "-1"):
        if accelerator == "cuda":
            found = num_cuda_devices()
            if found == 0:
                raise ValueError(
                    f"devices={devices!r} with accelerator='cuda': torch sees no CUDA GPU on this machine to count;"
                    f" {name_the_count}"
                )
            return found
        if text == "auto":
            return 1  # Lightning's CPU and MPS accelerators use one device by default
        if str(given_accelerator or "auto") == "auto":
            raise ValueError(
                f"devices={devices!r} counts every CUDA GPU, but accelerator='auto' found none here and chose"
                f" {accelerator!r}; {name_the_count}"
            )
    raise ValueError(
        f"devices={_shown(devices)!r} cannot be used with accelerator={accelerator!r}: give a count >= 1"
        " (--trainer.devices=N), indices such as '0,1' or [0, 1], or 'auto' (-1 too on CUDA)"
    )


def _accelerator_name(accelerator: Any) -> str:
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
