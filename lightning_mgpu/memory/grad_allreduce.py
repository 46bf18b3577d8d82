"""Average gradients across ranks after the local backward passes, the way DDP would have during them."""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def average_gradients(
    params: Sequence[nn.Parameter],
    has_grad_on_any_rank: Sequence[bool],
    world_size: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """All-reduce the ``.grad`` of ``params`` in flat buckets and divide by ``world_size``, in place.

    Every rank must pass the same parameters in the same order and the same ``has_grad_on_any_rank`` (agreed
    beforehand), so the buckets match: a parameter without a gradient on this rank but with one elsewhere
    contributes zeros, and one without a gradient anywhere keeps ``grad=None``, as DDP leaves it. At most two
    buckets are in flight, which bounds the extra memory to two bucket copies.

    Args:
        params: the parameters whose gradients are averaged.
        has_grad_on_any_rank: for each parameter, whether any rank has a gradient for it.
        world_size: the number of ranks in ``group``.
        group: the process group (the DDP module's); ``None`` for the default group.
        bucket_bytes: the size of one flat bucket in bytes (DDP's ``bucket_cap_mb`` in bytes).

    Example::

        average_gradients(list(model.parameters()), [True] * n_params, dist.get_world_size())
    """
    if len(params) != len(has_grad_on_any_rank):
        raise ValueError(f"got {len(params)} parameters but {len(has_grad_on_any_rank)} has-grad flags")
    grads: list[Tensor] = []
    for param, needed in zip(params, has_grad_on_any_rank, strict=True):
        if not needed:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    in_flight: list[tuple[Tensor, list[Tensor], dist.Work]] = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket]).div_(world_size)
        in_flight.append((flat, bucket, dist.all_reduce(flat, group=group, async_op=True)))
        if len(in_flight) == 2:
            _finish(*in_flight.pop(0))
    for pending in in_flight:
        _finish(*pending)


def _buckets(grads: list[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    buckets: list[list[Tensor]] = []
    current: list[Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        # a bucket holds one dtype on one device, and stops growing once it reaches the cap
        other_kind = current and (grad.dtype != current[0].dtype or grad.device != current[0].device)
        if current and (size + nbytes > bucket_bytes or other_kind):
            buckets.append(current)
            current, size = [], 0
        current.append(grad)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _finish(flat: Tensor, bucket: list[Tensor], work: dist.Work) -> None:
    work.wait()
    offset = 0
    for grad in bucket:
        numel = grad.numel()
        grad.copy_(flat[offset : offset + numel].view_as(grad))
        offset += numel
