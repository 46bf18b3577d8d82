"""DistributedBatchNorm against a single-process nn.BatchNorm on the global batch, over real gloo processes."""

import pickle
import zlib
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mgpu.core.distributed_batchnorm import (
    DistributedBatchNorm,
    convert_sync_batchnorm,
    has_batchnorm,
    revert_sync_batchnorm,
)
from tests.helpers.processes import run_processes

WORLD_SIZE = 2
BATCHNORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


@dataclass(frozen=True)
class Case:
    name: str
    dim: int  # picks BatchNorm1d/2d/3d
    splits: tuple[int, ...]  # samples on each rank; the global batch is their concatenation
    feature_shape: tuple[int, ...]  # (C, *spatial)
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    input_grad: bool = True
    steps: int = 2


CASES = [
    Case("bn1d_nc", 1, (4, 4), (3,)),
    Case("bn1d_ncl", 1, (4, 4), (3, 7)),
    Case("bn2d", 2, (4, 4), (3, 5, 4)),
    Case("bn3d", 3, (3, 3), (2, 3, 4, 3)),
    Case("bn1d_uneven", 1, (5, 3), (4,)),
    Case("bn2d_uneven", 2, (5, 3), (2, 3, 3)),
    Case("bn1d_ncl_uneven", 1, (2, 6), (3, 5)),
    Case("bn1d_size1", 1, (1, 4), (3,)),
    Case("bn2d_size1", 2, (1, 4), (2, 3, 3)),
    Case("bn1d_empty_rank", 1, (0, 4), (3,)),
    Case("bn2d_empty_rank", 2, (0, 4), (2, 3, 3)),
    Case("bn1d_both_size1", 1, (1, 1), (3,)),
    Case("bn2d_momentum_none", 2, (3, 5), (2, 3, 3), {"momentum": None}, steps=3),
    Case("bn1d_no_running_stats", 1, (4, 2), (3, 5), {"track_running_stats": False}),
    Case("bn2d_no_affine", 2, (3, 3), (2, 4, 4), {"affine": False}),
    Case("bn1d_input_needs_no_grad", 1, (3, 5), (4,), input_grad=False),
]
BF16_CASE = Case("bn2d_bf16", 2, (4, 4), (3, 5, 4), dtype=torch.bfloat16)
ERROR_CASES = [Case("one_value", 1, (1, 0), (3,)), Case("no_value", 2, (0, 0), (2, 3, 3))]
EVAL_CASE = Case("eval", 2, (3, 5), (2, 3, 3), steps=1)


def _make_bn(case: Case) -> nn.Module:
    """The plain batch-norm layer of ``case``, with non-trivial affine parameters."""
    bn = BATCHNORMS[case.dim](case.feature_shape[0], **case.kwargs)
    gen = torch.Generator().manual_seed(7)
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
            bn.bias.copy_(torch.rand(bn.num_features, generator=gen) - 0.5)
    return bn


def _make_steps(case: Case) -> list[tuple[Tensor, Tensor]]:
    """Global input batch and fixed loss weights for each step, the same in every process."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    shape = (sum(case.splits), *case.feature_shape)
    return [(torch.randn(shape, generator=gen) * 2 + 0.5, torch.randn(shape, generator=gen)) for _ in range(case.steps)]


def _run_steps(bn: nn.Module, case: Case, batches: list[tuple[Tensor, Tensor]]) -> list[dict[str, Any]]:
    """Train ``bn`` on ``batches`` with loss ``(y * w).sum()``; record outputs, grads and running stats per step."""
    records = []
    for x, w in batches:
        bn.zero_grad(set_to_none=True)
        x = x.to(case.dtype).requires_grad_(case.input_grad)
        y = bn(x)
        (y.float() * w).sum().backward()
        records.append(
            {
                "out": y.detach(),
                "grad_input": x.grad,
                "grad_weight": None if bn.weight is None else bn.weight.grad,
                "grad_bias": None if bn.bias is None else bn.bias.grad,
                "running_mean": None if bn.running_mean is None else bn.running_mean.clone(),
                "running_var": None if bn.running_var is None else bn.running_var.clone(),
                "num_batches_tracked": None if bn.num_batches_tracked is None else bn.num_batches_tracked.item(),
            }
        )
    return records


def _rank_slice(case: Case, rank: int, tensor: Tensor) -> Tensor:
    start = sum(case.splits[:rank])
    return tensor[start : start + case.splits[rank]]


def _distributed_worker(rank: int, world_size: int) -> bytes:
    results: dict[str, Any] = {}
    for case in [*CASES, BF16_CASE]:
        bn = convert_sync_batchnorm(_make_bn(case))
        batches = [(_rank_slice(case, rank, x), _rank_slice(case, rank, w)) for x, w in _make_steps(case)]
        results[case.name] = {"type": type(bn).__name__, "records": _run_steps(bn, case, batches)}

    for case in ERROR_CASES:
        bn = convert_sync_batchnorm(_make_bn(case))
        x, _ = _make_steps(case)[0]
        try:
            bn(_rank_slice(case, rank, x))
            results[case.name] = None
        except ValueError as err:
            results[case.name] = str(err)

    # eval must not communicate: rank 0 evaluates alone on a group that times out quickly, so a collective would
    # raise there instead of hanging
    short_group = dist.new_group(timeout=timedelta(seconds=30))
    rank0_group = dist.new_group([0])
    case = EVAL_CASE
    bn = convert_sync_batchnorm(_make_bn(case), process_group=short_group)
    x, w = _make_steps(case)[0]
    _run_steps(bn, case, [(_rank_slice(case, rank, x), _rank_slice(case, rank, w))])
    bn.eval()
    if rank == 0:
        results["eval"] = {"out": bn(x * 0.5 - 1).detach()}
        # a group of one rank is plain local batch norm
        single = convert_sync_batchnorm(_make_bn(case), process_group=rank0_group)
        results["rank0_group_out"] = single(x).detach()
        results["rank0_group_running_mean"] = single.running_mean.clone()
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def distributed_results() -> list[dict[str, Any]]:
    return run_processes(_distributed_worker, WORLD_SIZE)


def _reference_records(case: Case) -> list[dict[str, Any]]:
    """The same steps on one process with nn.BatchNorm, in fp32, on the whole global batch."""
    reference = replace(case, dtype=torch.float32, input_grad=True)
    steps = [(x.to(case.dtype).float(), w) for x, w in _make_steps(case)]
    return _run_steps(_make_bn(case), reference, steps)


def _assert_matches_reference(case: Case, ranks: list[dict[str, Any]], atol: float, rtol: float) -> None:
    for step, ref in enumerate(_reference_records(case)):
        records = [r[case.name]["records"][step] for r in ranks]
        close = {"atol": atol, "rtol": rtol, "msg": lambda m, s=step: f"step {s}: {m}"}
        out = torch.cat([r["out"] for r in records])
        assert out.dtype == case.dtype
        torch.testing.assert_close(out.float(), ref["out"], **close)
        if case.input_grad:
            grad_input = torch.cat([r["grad_input"] for r in records])
            assert grad_input.dtype == case.dtype
            torch.testing.assert_close(grad_input.float(), ref["grad_input"], **close)
        else:
            assert all(r["grad_input"] is None for r in records)
        for key in ("grad_weight", "grad_bias"):
            if ref[key] is None:
                assert all(r[key] is None for r in records)
            else:
                # DDP averages parameter grads later, so each rank holds the grad of its own slice
                torch.testing.assert_close(sum(r[key] for r in records), ref[key], **close)
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            if ref[key] is None:
                assert all(r[key] is None for r in records)
                continue
            torch.testing.assert_close(records[0][key], ref[key], **close)
            for other in records[1:]:
                assert torch.equal(torch.as_tensor(other[key]), torch.as_tensor(records[0][key]))


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_batchnorm_on_global_batch(distributed_results: list[dict[str, Any]], case: Case) -> None:
    assert all(r[case.name]["type"] == DistributedBatchNorm.__name__ for r in distributed_results)
    _assert_matches_reference(case, distributed_results, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_bf16_input_close_to_fp32_reference(distributed_results: list[dict[str, Any]]) -> None:
    _assert_matches_reference(BF16_CASE, distributed_results, atol=5e-2, rtol=2e-2)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c.name for c in ERROR_CASES])
def test_single_value_per_channel_raises_on_every_rank(distributed_results: list[dict[str, Any]], case: Case) -> None:
    for result in distributed_results:
        assert result[case.name] is not None, "no ValueError"
        assert "Expected more than 1 value per channel when training" in result[case.name]


@pytest.mark.distributed
def test_eval_uses_running_stats_without_communication(distributed_results: list[dict[str, Any]]) -> None:
    bn = _make_bn(EVAL_CASE)
    x, w = _make_steps(EVAL_CASE)[0]
    _run_steps(bn, EVAL_CASE, [(x, w)])
    bn.eval()
    torch.testing.assert_close(distributed_results[0]["eval"]["out"], bn(x * 0.5 - 1).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_group_of_one_rank_is_local_batchnorm(distributed_results: list[dict[str, Any]]) -> None:
    bn = _make_bn(EVAL_CASE)
    x, _ = _make_steps(EVAL_CASE)[0]
    assert torch.equal(distributed_results[0]["rank0_group_out"], bn(x).detach())
    assert torch.equal(distributed_results[0]["rank0_group_running_mean"], bn.running_mean)


LOCAL_CASES = [
    Case("local_bn1d", 1, (6,), (3,), steps=3),
    Case("local_bn1d_ncl", 1, (5,), (3, 4)),
    Case("local_bn2d_momentum_none", 2, (4,), (3, 4, 5), {"momentum": None}, steps=3),
    Case("local_bn3d_no_running_stats", 3, (3,), (2, 3, 2, 4), {"track_running_stats": False}),
    Case("local_bn2d_no_affine", 2, (4,), (3, 2, 2), {"affine": False}),
]


@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c.name for c in LOCAL_CASES])
def test_without_process_group_equals_batchnorm_exactly(case: Case) -> None:
    assert not dist.is_initialized(), "a test left a default process group in the pytest process"
    batches = _make_steps(case)
    bn = convert_sync_batchnorm(_make_bn(case))
    assert isinstance(bn, DistributedBatchNorm)
    for ours, ref in zip(_run_steps(bn, case, batches), _run_steps(_make_bn(case), case, batches), strict=True):
        for key, value in ref.items():
            same = ours[key] == value if value is None or isinstance(value, int) else torch.equal(ours[key], value)
            assert same, key
    reference = _make_bn(case)
    _run_steps(reference, case, batches)
    bn.eval()
    reference.eval()
    x = batches[0][0] - 1
    assert torch.equal(bn(x), reference(x))


def test_bf16_without_process_group() -> None:
    x = torch.randn(6, 3, 4, 4) * 3 + 1
    bn = DistributedBatchNorm(3)
    out = bn(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), nn.BatchNorm2d(3)(x.bfloat16().float()), atol=5e-2, rtol=2e-2)


def test_single_value_in_training_raises_without_process_group() -> None:
    bn = DistributedBatchNorm(3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn(torch.randn(1, 3))
    bn.eval()
    assert bn(torch.randn(1, 3)).shape == (1, 3)


@pytest.mark.parametrize("shape", [(3,), (4, 2), (4, 5, 6)])
def test_bad_input_shape_raises(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="DistributedBatchNorm expected"):
        DistributedBatchNorm(3)(torch.randn(shape))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.inner = nn.ModuleDict({"seq": nn.Sequential(nn.Conv3d(4, 2, 1), nn.BatchNorm3d(2, momentum=None))})
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 5), nn.BatchNorm1d(5, affine=False))
        self.already_synced = nn.SyncBatchNorm(5)  # not called: it refuses CPU input in training

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.inner["seq"](x.unsqueeze(2))
        return self.head(x)


def _batchnorm_layers(module: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def test_convert_and_revert_keep_parameters_and_buffers() -> None:
    net = _Net()
    net.features[1].eval()
    with torch.no_grad():
        net.features[1].running_mean.add_(3)
    net.inner["seq"][1].num_batches_tracked.fill_(5)
    before = _batchnorm_layers(net)
    tensors = {name: [*m.parameters(recurse=False), *m.buffers(recurse=False)] for name, m in before.items()}
    state = {k: v.clone() for k, v in net.state_dict().items()}

    converted = convert_sync_batchnorm(net, process_group="group")
    assert converted is net
    after = _batchnorm_layers(net)
    assert after.keys() == before.keys()
    for name, layer in after.items():
        if name == "already_synced":
            assert layer is before[name]
            continue
        assert type(layer) is DistributedBatchNorm
        assert layer.process_group == "group"
        assert layer.training == before[name].training
        assert layer.momentum == before[name].momentum and layer.affine == before[name].affine
        new_tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        assert len(new_tensors) == len(tensors[name])
        assert all(a is b for a, b in zip(new_tensors, tensors[name], strict=True))
    assert net.features[1].weight is before["features.1"].weight
    assert not net.features[1].training
    assert net.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    net(torch.randn(2, 3, 4, 4))  # still runs, locally

    reverted = revert_sync_batchnorm(net)
    assert reverted is net
    restored = _batchnorm_layers(net)
    for name, layer in restored.items():
        assert type(layer) is type(before[name])
        assert layer.training == before[name].training
        new_tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        assert all(a is b for a, b in zip(new_tensors, tensors[name], strict=True))
    assert net.inner["seq"][1].num_batches_tracked.item() == 6


def test_convert_bare_layer_and_optimizer_stays_valid() -> None:
    bn = nn.BatchNorm1d(3)
    optimizer = torch.optim.SGD(bn.parameters(), lr=0.1)
    converted = convert_sync_batchnorm(bn)
    assert isinstance(converted, DistributedBatchNorm)
    assert converted.weight is bn.weight and converted.running_var is bn.running_var
    converted(torch.randn(4, 3)).sum().backward()
    bias = bn.bias.detach().clone()
    optimizer.step()
    assert not torch.equal(converted.bias, bias)  # the optimizer updated the parameter the new layer uses
    assert type(revert_sync_batchnorm(converted)) is nn.BatchNorm1d
    assert revert_sync_batchnorm(nn.SyncBatchNorm(3)).__class__ is nn.SyncBatchNorm
    assert convert_sync_batchnorm(nn.SyncBatchNorm(3)).__class__ is nn.SyncBatchNorm


def test_revert_layer_built_directly_accepts_any_dim() -> None:
    layer = DistributedBatchNorm(2)
    reverted = revert_sync_batchnorm(layer)
    assert not isinstance(reverted, DistributedBatchNorm)
    assert reverted.weight is layer.weight
    for shape in [(4, 2), (4, 2, 3), (4, 2, 3, 3)]:
        assert reverted(torch.randn(shape)).shape == shape


def test_converted_module_pickles() -> None:
    net = convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    restored = revert_sync_batchnorm(pickle.loads(pickle.dumps(net)))
    assert type(restored[1]) is nn.BatchNorm1d


def test_has_batchnorm() -> None:
    assert has_batchnorm(_Net())
    assert has_batchnorm(nn.BatchNorm3d(2))
    assert has_batchnorm(convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(2))))
    assert has_batchnorm(nn.Sequential(nn.Sequential(nn.SyncBatchNorm(2))))
    assert not has_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.GroupNorm(1, 2)))
