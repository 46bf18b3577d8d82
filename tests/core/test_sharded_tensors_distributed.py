"""Norms of FSDP-sharded gradients on 2 gloo processes: equal to the full tensors' norms on every rank."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_mgpu.core.sharded_tensors import global_norms, is_sharded, local_part
from tests.helpers.processes import run_processes


def _norms(rank: int, world_size: int, nan_on_rank: int | None) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)  # the same full tensors on every rank
    full = [torch.randn(6, 3), torch.randn(5)]
    tensors = [distribute_tensor(full[0], mesh, [Shard(0)]), full[1]]  # a shard and a whole (replicated) tensor
    assert is_sharded(tensors[0]) and not is_sharded(tensors[1])
    if rank == nan_on_rank:
        local_part(tensors[0]).view(-1)[0] = float("nan")
    local = torch.stack([torch.linalg.vector_norm(local_part(t).float()) for t in tensors])
    return global_norms(tensors, local)


def test_norms_of_shards_are_the_full_norms_on_every_rank():
    torch.manual_seed(0)
    expected = torch.stack([torch.linalg.vector_norm(torch.randn(6, 3)), torch.linalg.vector_norm(torch.randn(5))])
    results = run_processes(_norms, 2, args=(None,))
    for norms in results:
        torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)


def test_a_nan_in_one_shard_reaches_every_rank():
    results = run_processes(_norms, 2, args=(1,))
    for norms in results:
        assert torch.isnan(norms[0]) and torch.isfinite(norms[1])


def test_whole_tensors_need_no_collective():
    tensors = [torch.ones(3)]
    local = torch.tensor([3.0]).sqrt()
    assert global_norms(tensors, local) is local  # no process group exists here: nothing was reduced
