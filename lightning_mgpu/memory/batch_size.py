"""The per-process share of a global batch, for configs that state a global batch size (:mod:`lightning_mgpu.cli`).

The process count comes from :mod:`lightning_mgpu.core.devices`. Nothing here initialises CUDA.
"""

from typing import Any

from lightning_mgpu.core.devices import count_processes, is_positive_int, shown


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
    if not is_positive_int(global_batch_size):
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if not is_positive_int(accumulate_grad_batches):
        raise ValueError(f"accumulate_grad_batches must be a positive int, got {accumulate_grad_batches!r}")
    processes = count_processes(devices, num_nodes, accelerator)
    accumulate = int(accumulate_grad_batches)
    share, remainder = divmod(int(global_batch_size), processes * accumulate)
    if remainder or share == 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split evenly over {processes} processes"
            f" (devices={shown(devices)!r} x num_nodes={shown(num_nodes)!r}) x accumulate_grad_batches={accumulate}:"
            f" choose a multiple of {processes * accumulate}"
        )
    return share


__all__ = ["count_processes", "per_device_batch_size"]
