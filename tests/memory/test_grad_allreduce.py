"""average_gradients over two real gloo processes: every rank ends with the mean of the ranks' gradients."""

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mgpu.memory.grad_allreduce import average_gradients
from tests.helpers.processes import run_processes

WORLD_SIZE = 2
SHAPES = [(3, 4), (4,), (2, 3, 2), (5,)]  # float32 sizes: 48, 16, 48 and 20 bytes
FLOAT32 = [torch.float32] * len(SHAPES)
MIXED = [torch.float32, torch.float64, torch.float64, torch.float32]
NO_GRAD_ON_RANK_0 = 1  # the parameter that only rank 1 has a gradient for
NO_GRAD_ANYWHERE = 2  # the parameter that no rank has a gradient for


def _grad(rank: int, index: int, dtype: torch.dtype) -> Tensor:
    generator = torch.Generator().manual_seed(100 * rank + index)
    return torch.randn(SHAPES[index], generator=generator, dtype=torch.float64).to(dtype)


def _params(rank: int, dtypes: list[torch.dtype], missing: tuple[int, ...] = ()) -> list[nn.Parameter]:
    params = []
    for index, dtype in enumerate(dtypes):
        param = nn.Parameter(torch.zeros(SHAPES[index], dtype=dtype))
        param.grad = None if index in missing else _grad(rank, index, dtype)
        params.append(param)
    return params


def _average(
    rank: int, dtypes: list[torch.dtype], flags: list[bool], missing: tuple[int, ...] = (), **kwargs: Any
) -> dict[str, Any]:
    params = _params(rank, dtypes, missing)
    storage = [None if p.grad is None else p.grad.data_ptr() for p in params]
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        average_gradients(params, flags, dist.get_world_size(), **kwargs)
    return {
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "in_place": [ptr is None or p.grad.data_ptr() == ptr for p, ptr in zip(params, storage, strict=True)],
        "buckets": [(call.args[0].dtype, call.args[0].numel()) for call in all_reduce.call_args_list],
    }


def _cases(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    every = [True] * len(SHAPES)
    only_rank_1 = (NO_GRAD_ON_RANK_0,) if rank == 0 else ()
    nowhere_flags = [index != NO_GRAD_ANYWHERE for index in range(len(SHAPES))]
    return {
        "one_bucket": _average(rank, FLOAT32, every),
        "capped_buckets": _average(rank, FLOAT32, every, bucket_bytes=68),
        "tiny_buckets": _average(rank, FLOAT32, every, bucket_bytes=16),
        "mixed_dtypes": _average(rank, MIXED, every),
        "missing_on_rank_0": _average(rank, FLOAT32, every, missing=only_rank_1),
        "missing_everywhere": _average(rank, FLOAT32, nowhere_flags, missing=(NO_GRAD_ANYWHERE,)),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    return run_processes(_cases, WORLD_SIZE)


def _expected_mean(dtypes: list[torch.dtype]) -> list[Tensor]:
    """The single-process reference: the per-rank gradients summed and divided, in each parameter's dtype."""
    return [
        sum(_grad(rank, index, dtype) for rank in range(WORLD_SIZE)) / WORLD_SIZE for index, dtype in enumerate(dtypes)
    ]


def _assert_grads(actual: list[Tensor | None], expected: list[Tensor | None]) -> None:
    assert len(actual) == len(expected)
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        if want is None:
            assert got is None, f"parameter {index} should keep grad=None"
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, i=index: f"parameter {i}: {m}")


@pytest.mark.distributed
def test_gradients_are_the_mean_over_ranks(ranks):
    expected = _expected_mean(FLOAT32)
    for rank in ranks:
        _assert_grads(rank["one_bucket"]["grads"], expected)
        assert rank["one_bucket"]["in_place"] == [True] * len(SHAPES), "the .grad tensors must be updated in place"
        assert rank["one_bucket"]["buckets"] == [(torch.float32, sum(torch.Size(s).numel() for s in SHAPES))]


@pytest.mark.distributed
def test_the_mean_is_not_the_sum_nor_a_rank_own_gradient(ranks):
    for rank_index, rank in enumerate(ranks):
        for index, got in enumerate(rank["one_bucket"]["grads"]):
            own = _grad(rank_index, index, torch.float32)
            other = _grad(1 - rank_index, index, torch.float32)
            assert not torch.equal(got, own)
            assert not torch.equal(got, own + other)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "bucket_numels"),
    [
        ("tiny_buckets", [12, 4, 12, 5]),  # 16 bytes: every gradient in its own bucket, four in flight in turn
        # 68 bytes: 48 + 16 fit, 48 more overflow and start a new bucket, which 20 more fill exactly
        ("capped_buckets", [16, 17]),
    ],
)
def test_small_buckets_give_the_same_result_as_one_bucket(ranks, case, bucket_numels):
    for rank in ranks:
        assert [numel for _, numel in rank[case]["buckets"]] == bucket_numels
        _assert_grads(rank[case]["grads"], rank["one_bucket"]["grads"])
        _assert_grads(rank[case]["grads"], _expected_mean(FLOAT32))


@pytest.mark.distributed
def test_mixed_dtypes_are_reduced_in_separate_buckets(ranks):
    expected = _expected_mean(MIXED)
    for rank in ranks:
        # float32, then the two float64 gradients together, then float32 again: a dtype change closes a bucket
        assert rank["mixed_dtypes"]["buckets"] == [(torch.float32, 12), (torch.float64, 16), (torch.float32, 5)]
        grads = rank["mixed_dtypes"]["grads"]
        assert [g.dtype for g in grads] == MIXED
        _assert_grads(grads, expected)


@pytest.mark.distributed
def test_gradient_missing_on_one_rank_counts_as_zeros(ranks):
    expected = _expected_mean(FLOAT32)
    expected[NO_GRAD_ON_RANK_0] = _grad(1, NO_GRAD_ON_RANK_0, torch.float32) / WORLD_SIZE
    for rank in ranks:
        grads = rank["missing_on_rank_0"]["grads"]
        assert grads[NO_GRAD_ON_RANK_0] is not None
        assert grads[NO_GRAD_ON_RANK_0].dtype == torch.float32
        _assert_grads(grads, expected)


@pytest.mark.distributed
def test_gradient_missing_on_every_rank_stays_none(ranks):
    expected: list[Tensor | None] = list(_expected_mean(FLOAT32))
    expected[NO_GRAD_ANYWHERE] = None
    for rank in ranks:
        _assert_grads(rank["missing_everywhere"]["grads"], expected)
        reduced = sum(torch.Size(s).numel() for i, s in enumerate(SHAPES) if i != NO_GRAD_ANYWHERE)
        assert rank["missing_everywhere"]["buckets"] == [(torch.float32, reduced)]


def test_mismatched_lengths_raise_before_touching_any_gradient():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="got 2 parameters but 1 has-grad flags"):
        average_gradients(params, [True], world_size=2)
    assert all(p.grad is None for p in params)
    with pytest.raises(ValueError, match="got 1 parameters but 2 has-grad flags"):
        average_gradients(params[:1], [True, True], world_size=2)


def test_nothing_to_reduce_needs_no_process_group():
    if dist.is_initialized():  # a fit refused at setup earlier in this process (one-device FSDP) leaves its group
        dist.destroy_process_group()
    assert not dist.is_initialized()
    params = [nn.Parameter(torch.zeros(2))]
    average_gradients(params, [False], world_size=2)
    average_gradients([], [], world_size=2)
    assert params[0].grad is None
