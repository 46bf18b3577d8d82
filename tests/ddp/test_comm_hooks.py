"""Communication hooks on plain torch DDP over real gloo processes: ranks stay identical, averages are right."""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.ddp.comm_hooks import COMM_HOOK_NAMES, PowerSGDState, powersgd_hook, register_comm_hook
from tests.helpers.processes import run_processes

WORLD_SIZE = 2
TINY_BUCKETS_MB = 0.001  # about one parameter a bucket: several hook calls per backward
POWERSGD_STEPS = 50


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(rank: int, step: int, size: int = 8) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(size, 32, generator=generator), torch.randn(size, 4, generator=generator)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(x), y)


def _exact_mean_grads(module: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    """What plain all-reduce would give: this rank's gradients from a copy, summed over ranks, divided."""
    reference = copy.deepcopy(module)
    reference.zero_grad(set_to_none=True)
    _loss(reference, x, y).backward()
    grads = [p.grad.div_(dist.get_world_size()) for p in reference.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
    return grads


def _mean_over_ranks(tensor: Tensor) -> Tensor:
    total = tensor.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _grads(module: nn.Module) -> list[Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def _params(module: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _train_with_hook(rank: int, name: str) -> dict[str, Any]:
    """Three SGD steps with the named hook and tiny buckets; the first step's grads next to the exact mean."""
    module = _mlp()
    model = DistributedDataParallel(module, bucket_cap_mb=TINY_BUCKETS_MB)
    register_comm_hook(model, name, powersgd_warmup_steps=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict[str, Any] = {}
    for step in range(3):
        x, y = _batch(rank, step)
        if step == 0:
            result["exact"] = _exact_mean_grads(module, x, y)
        optimizer.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        if step == 0:
            result["hooked"] = _grads(module)
        optimizer.step()
    result["params"] = _params(module)
    return result


def _linear_step(model: DistributedDataParallel, x: Tensor, y: Tensor, scale: float = 1.0) -> Tensor:
    model.zero_grad(set_to_none=True)
    (scale * _loss(model, x, y)).backward()
    return model.module.weight.grad.detach().clone()


def _powersgd_linear(rank: int = 1) -> tuple[DistributedDataParallel, PowerSGDState]:
    """A bias-free 8 x 16 linear layer under PowerSGD from the first step: one bucket, one compressed matrix."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(16, 8, bias=False))
    state = PowerSGDState(rank=rank, warmup_steps=0)
    model.register_comm_hook(state, powersgd_hook)
    return model, state


def _rank_one_case(rank: int) -> dict[str, Tensor]:
    # batch size 1 and the same x everywhere: each rank's gradient is g_r x^T, so their mean is rank 1
    model, _ = _powersgd_linear()
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(7))
    y = torch.randn(1, 8, generator=torch.Generator().manual_seed(100 + rank))
    exact = _exact_mean_grads(model.module, x, y)[0]
    return {"hooked": _linear_step(model, x, y), "exact": exact}


def _zero_gradient_case(rank: int) -> dict[str, Tensor]:
    # an all-zero gradient first, then the rank-1 case: a Q warm-started from that zero step would be zero
    model, _ = _powersgd_linear()
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(7))
    y = torch.randn(1, 8, generator=torch.Generator().manual_seed(100 + rank))
    zero = _linear_step(model, x, y, scale=0.0)
    exact = _exact_mean_grads(model.module, x, y)[0]
    return {"zero": zero, "hooked": _linear_step(model, x, y), "exact": exact}


def _error_feedback_case(rank: int) -> dict[str, Tensor]:
    # four different samples a rank: the mean gradient has rank > 1, so rank 1 leaves an error behind
    model, state = _powersgd_linear()
    x, y = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)), torch.randn(4, 8)
    exact = _exact_mean_grads(model.module, x, y)[0]
    applied_1 = _linear_step(model, x, y)
    error_1 = _mean_over_ranks(state.error_buffers[0].view_as(applied_1))
    applied_2 = _linear_step(model, x, y, scale=0.0)  # a zero gradient: only the error is left to send
    error_2 = _mean_over_ranks(state.error_buffers[0].view_as(applied_2))
    return {
        "exact": exact,
        "applied_1": applied_1,
        "error_1": error_1,
        "applied_2": applied_2,
        "error_2": error_2,
        "steps": torch.tensor(state.step),
    }


def _hook_cases(rank: int, world_size: int) -> bytes:
    results: dict[str, Any] = {name: _train_with_hook(rank, name) for name in COMM_HOOK_NAMES}
    results["rank_one"] = _rank_one_case(rank)
    results["zero_gradient"] = _zero_gradient_case(rank)
    results["error_feedback"] = _error_feedback_case(rank)
    return results


def _layout_checking_hook(layouts_ok: list[bool], indices: set[int]) -> Callable:
    """powersgd_hook, after checking that DDP's gradient views sit in the buffer where the hook slices it."""

    def checking_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        buffer, offset = bucket.buffer(), 0
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            at = buffer.data_ptr() + offset * buffer.element_size()
            layouts_ok.append(grad.data_ptr() == at and grad.shape == param.shape)
            offset += param.numel()
        layouts_ok.append(offset == buffer.numel())
        indices.add(bucket.index())
        return powersgd_hook(state, bucket)

    return checking_hook


def _powersgd_training(rank: int, world_size: int) -> bytes:
    """50 SGD steps under PowerSGD with tiny buckets, with and without gradient_as_bucket_view."""
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    results = {}
    for as_view in (False, True):
        module = _mlp()
        model = DistributedDataParallel(module, bucket_cap_mb=TINY_BUCKETS_MB, gradient_as_bucket_view=as_view)
        state = PowerSGDState(rank=1, warmup_steps=5)
        layouts_ok: list[bool] = []
        indices: set[int] = set()
        model.register_comm_hook(state, _layout_checking_hook(layouts_ok, indices))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(POWERSGD_STEPS):
            x = _batch(rank, step, size=16)[0]
            with torch.no_grad():
                y = teacher(x)
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(model, x, y)
            loss.backward()
            optimizer.step()
            losses.append(_mean_over_ranks(loss.detach()).item())
        results[as_view] = {
            "params": _params(module),
            "losses": losses,
            "layouts_ok": all(layouts_ok),
            "buckets": len(indices),
            "steps": state.step,
            "compressed": sum(len(layout.compressed) for layout in state.layouts.values()),
            "error_norm": sum(error.norm().item() for error in state.error_buffers.values()),
        }
    return results


@pytest.fixture(scope="module")
def hook_cases() -> list[dict[str, Any]]:
    return run_processes(_hook_cases, WORLD_SIZE)


@pytest.fixture(scope="module")
def powersgd_training() -> list[dict[bool, Any]]:
    return run_processes(_powersgd_training, WORLD_SIZE)


@pytest.mark.distributed
@pytest.mark.parametrize("name", COMM_HOOK_NAMES)
def test_hook_trains_with_identical_parameters_on_every_rank(hook_cases, name):
    first, second = (ranks[name]["params"] for ranks in hook_cases)
    initial = _params(_mlp())
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, initial, strict=True)), "the parameters did not move"


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "dtype", "rtol"), [("fp16", torch.float16, 2e-3), ("bf16", torch.bfloat16, 2e-2)])
def test_half_precision_hook_averages_close_to_exact_mean(hook_cases, name, dtype, rtol):
    for ranks in hook_cases:
        for hooked, exact in zip(ranks[name]["hooked"], ranks[name]["exact"], strict=True):
            assert torch.allclose(hooked, exact, rtol=rtol, atol=rtol * exact.abs().max().item())
            # the sum travelled in the low-precision dtype: every averaged value is representable in it
            assert torch.equal(hooked, hooked.to(dtype).float())


@pytest.mark.distributed
def test_powersgd_warmup_is_the_exact_mean(hook_cases):
    for ranks in hook_cases:
        for hooked, exact in zip(ranks["powersgd"]["hooked"], ranks["powersgd"]["exact"], strict=True):
            assert torch.allclose(hooked, exact, rtol=1e-6, atol=1e-9)


@pytest.mark.distributed
def test_powersgd_rank_one_approximation_of_a_rank_one_mean_is_exact(hook_cases):
    for ranks in hook_cases:
        case = ranks["rank_one"]
        assert torch.allclose(case["hooked"], case["exact"], rtol=0, atol=1e-5)
        assert case["exact"].abs().max() > 1e-2


@pytest.mark.distributed
def test_powersgd_recovers_after_an_all_zero_gradient(hook_cases):
    for ranks in hook_cases:
        case = ranks["zero_gradient"]
        assert torch.count_nonzero(case["zero"]) == 0
        assert torch.allclose(case["hooked"], case["exact"], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_powersgd_error_feedback_keeps_what_compression_dropped_and_sends_it_next_step(hook_cases):
    for ranks in hook_cases:
        case = ranks["error_feedback"]
        exact, applied_1, error_1 = case["exact"], case["applied_1"], case["error_1"]
        # rank 1 cannot carry a rank-2+ mean: part of it is applied now, the rest is kept as error
        assert error_1.norm() > 0.05 * exact.norm()
        assert not torch.allclose(applied_1, exact, atol=1e-3)
        assert torch.allclose(applied_1 + error_1, exact, atol=1e-5)
        # a zero gradient next step still updates the weights: the kept error goes out, and nothing is lost
        assert case["applied_2"].norm() > 0.1 * error_1.norm()
        assert torch.allclose(case["applied_2"] + case["error_2"], error_1, atol=1e-5)
        assert case["steps"].item() == 2
    assert torch.equal(hook_cases[0]["error_feedback"]["applied_2"], hook_cases[1]["error_feedback"]["applied_2"])


@pytest.mark.distributed
@pytest.mark.parametrize("as_view", [False, True], ids=["grad_copy", "gradient_as_bucket_view"])
def test_powersgd_trains_many_buckets_in_lockstep(powersgd_training, as_view):
    first, second = (ranks[as_view] for ranks in powersgd_training)
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"], strict=True))
    assert first["buckets"] >= 3
    assert first["steps"] == POWERSGD_STEPS
    assert first["compressed"] == 3  # every weight matrix; the biases go uncompressed
    assert first["error_norm"] > 0
    assert first["layouts_ok"] and second["layouts_ok"]
    losses = first["losses"]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter"),
    [
        ({"rank": 0}, ValueError, "rank"),
        ({"rank": 1.5}, TypeError, "rank"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"min_compression_rate": 0.0}, ValueError, "min_compression_rate"),
        ({"min_compression_rate": "2"}, TypeError, "min_compression_rate"),
        ({"seed": -3}, ValueError, "seed"),
    ],
)
def test_powersgd_state_rejects_bad_values(kwargs, error, parameter):
    (value,) = kwargs.values()
    with pytest.raises(error, match=rf"^PowerSGDState: {parameter} must be .*got {value!r}$"):
        PowerSGDState(**kwargs)


def test_powersgd_state_accepts_an_infinite_compression_rate():
    assert PowerSGDState(min_compression_rate=float("inf")).min_compression_rate == float("inf")


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter", "value"),
    [
        ({"name": "int8"}, ValueError, "name", "'int8'"),
        ({"name": 16}, TypeError, "name", "16"),
        ({"name": "powersgd", "powersgd_rank": 0}, ValueError, "powersgd_rank", "0"),
        ({"name": "powersgd", "powersgd_warmup_steps": -1}, ValueError, "powersgd_warmup_steps", "-1"),
        ({"name": "fp16", "powersgd_rank": True}, TypeError, "powersgd_rank", "True"),
    ],
)
def test_register_comm_hook_rejects_bad_values(kwargs, error, parameter, value):
    with pytest.raises(error, match=rf"^register_comm_hook: {parameter} must be .*got {value}$"):
        register_comm_hook(nn.Linear(2, 2), **kwargs)


def test_register_comm_hook_error_lists_the_allowed_names():
    with pytest.raises(ValueError, match=r"one of 'fp16', 'bf16', 'powersgd', got 'fp32'$"):
        register_comm_hook(nn.Linear(2, 2), "fp32")


def test_register_comm_hook_needs_a_ddp_model():
    with pytest.raises(TypeError, match="model must be a DistributedDataParallel, got Linear"):
        register_comm_hook(nn.Linear(2, 2), "fp16")


def _powersgd_after_a_nonfinite_step(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 4, bias=False)))
    register_comm_hook(model, "powersgd", powersgd_rank=1, powersgd_warmup_steps=0)
    finite = []
    for step in range(4):
        x = torch.randn(8, 16)
        if step == 1:
            x[0, 0] = float("inf")  # one overflowing step, as fp16 AMP produces and GradScaler skips
        model.zero_grad()
        model(x).sum().backward()
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
    return {"finite": finite}


@pytest.mark.distributed
def test_powersgd_recovers_after_a_nonfinite_step():
    for result in run_processes(_powersgd_after_a_nonfinite_step, WORLD_SIZE):
        assert result["finite"] == [True, False, True, True]  # the overflow stays in its own step
