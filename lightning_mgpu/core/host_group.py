"""A process group whose collectives run on the host, for small control messages between ranks."""

import contextlib
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def host_side_group(
    device: torch.device, timeout: timedelta | None = None, warn: Callable[[str], None] | None = None
) -> tuple[dist.ProcessGroup | None, torch.device]:
    """A gloo group for small control messages, and the device their tensors live on.

    Under gloo the default group already runs on the host: ``(None, cpu)``. Under another backend (NCCL) a gloo
    side group keeps the messages on the host, so exchanging them neither copies to the device nor synchronises a
    stream. Every rank must use the same group, so if any rank cannot create it they all fall back to the default
    group, with tensors on ``device``. Collective: call it on every rank, after the process group is initialised.

    Args:
        device: this rank's device, used for the fallback.
        timeout: the side group's collective timeout (the strategy's).
        warn: called with a message on a rank that could not create the side group.

    Returns:
        ``(group, tensor_device)``; ``group`` is ``None`` for the default group.

    Example::

        group, tensor_device = host_side_group(trainer.strategy.root_device)
        flag = torch.tensor([1], device=tensor_device)
        dist.all_reduce(flag, group=group)
    """
    if dist.get_backend() == "gloo":
        return None, torch.device("cpu")
    group = None
    try:
        group = dist.new_group(backend="gloo", timeout=timeout)
    except Exception as err:
        if warn is not None:
            warn(f"no gloo side group ({err!r}); control messages travel through {dist.get_backend()}")
    created = torch.tensor([1 if group is not None else 0], device=device)
    dist.all_reduce(created, op=dist.ReduceOp.MIN)
    if int(created.item()) == 1:
        return group, torch.device("cpu")
    if group is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
    return None, device
