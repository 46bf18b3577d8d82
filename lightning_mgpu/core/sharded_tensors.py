"""Per-parameter gradient norms over FSDP shards: one all-reduce gives every rank the norms of the full gradients.

Under FSDP2 each gradient is a ``DTensor`` whose local part is this rank's shard. A norm taken on the local part
sees only the shard, so a NaN in another rank's shard, or the part of a norm it holds, would be missed and the ranks
would decide differently (skip or not, clip by different factors) and drift apart.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def local_part(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds (the shard of a ``DTensor``; the tensor itself otherwise).

    In-place changes to it change the ``DTensor``.
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` split across ranks (``Shard`` on some mesh dimension)."""
    return isinstance(tensor, DTensor) and any(placement.is_shard() for placement in tensor.placements)


def global_norms(tensors: list[Tensor], local_norms: Tensor) -> Tensor:
    """Turn the 2-norms of each tensor's local part into the 2-norms of the whole tensors; one all-reduce if sharded.

    Tensors that are not sharded are whole on every rank, so their norms pass unchanged. The all-reduce runs over the
    mesh dimension the first sharded tensor is split on: FSDP's one data-parallel dimension, or, under hybrid
    sharding (a 2-D mesh whose other dimension replicates), the shard dimension only, so no rank sums a replica's
    shard twice. Tensors split over several mesh dimensions (tensor parallelism) are refused.

    Args:
        tensors: the tensors (gradients), some possibly sharded ``DTensor``.
        local_norms: a 1-dim fp32 tensor, the 2-norm of each ``local_part``.

    Raises:
        NotImplementedError: a tensor split over more than one mesh dimension, or tensors split differently.
    """
    sharded = [is_sharded(tensor) for tensor in tensors]
    if not any(sharded):
        return local_norms
    dims = {_shard_dim(tensor) for tensor, flag in zip(tensors, sharded, strict=True) if flag}
    first = next(tensor for tensor, flag in zip(tensors, sharded, strict=True) if flag)
    if len(dims) != 1 or None in dims:
        raise NotImplementedError(
            "gradient norms of tensors split over different device-mesh dimensions are not supported; "
            "lightning_mgpu's callbacks handle FSDP's data-parallel sharding, replicated or not (hybrid sharding)"
        )
    (dim,) = dims
    group = first.device_mesh.get_group(dim)
    mask = torch.tensor(sharded, device=local_norms.device)
    # a whole tensor's square counts once: each of the ranks adds its 1/size share
    squares = torch.where(mask, local_norms.square(), local_norms.square() / dist.get_world_size(group))
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def _shard_dim(tensor: DTensor) -> int | None:
    # the one mesh dimension a DTensor is split on; None where it is split on several
    dims = [dim for dim, placement in enumerate(tensor.placements) if placement.is_shard()]
    return dims[0] if len(dims) == 1 else None
