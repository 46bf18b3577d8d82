"""TrainingSnapshot: what an in-process rollback puts back, exactly."""

import pytest
import torch
from torch import nn

from lightning_mgpu.stability.training_snapshot import TrainingSnapshot
from tests.helpers.runif import run_if


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=g).to(next(model.parameters()).device)  # a CPU generator: drawn on the host
        model(x).square().mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def build(device: str = "cpu", optimizer: str = "adam"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    return model, opt, scheduler


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": torch.optim.Optimizer.state_dict(optimizer),
    }


def assert_same(a: dict, b: dict) -> None:
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=0)
    torch.testing.assert_close(b["optimizer"], a["optimizer"], rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_restore_puts_back_exactly_the_state_and_training_continues_identically(optimizer):
    model, opt, scheduler = build(optimizer=optimizer)
    train(model, opt, scheduler, steps=3, seed=1)
    snapshot = TrainingSnapshot(model, [opt], [scheduler])
    snapshot.take(step=3)
    saved = state(model, opt)
    train(model, opt, scheduler, steps=4, seed=2)  # the steps a rollback drops
    assert snapshot.restore() == 3
    assert_same(saved, state(model, opt))
    assert scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(opt.defaults["lr"] * 0.9**3)
    train(model, opt, scheduler, steps=2, seed=3)
    reference, reference_opt, reference_scheduler = build(optimizer=optimizer)
    train(reference, reference_opt, reference_scheduler, steps=3, seed=1)
    train(reference, reference_opt, reference_scheduler, steps=2, seed=3)
    assert_same(state(reference, reference_opt), state(model, opt))


def test_restore_to_before_the_first_step_clears_the_optimizer_state():
    model, opt, scheduler = build()
    snapshot = TrainingSnapshot(model, [opt], [scheduler])
    snapshot.take(step=0)
    train(model, opt, scheduler, steps=2, seed=1)
    assert opt.state
    snapshot.restore()
    assert not opt.state
    train(model, opt, scheduler, steps=1, seed=4)
    reference, reference_opt, reference_scheduler = build()
    train(reference, reference_opt, reference_scheduler, steps=1, seed=4)
    assert_same(state(reference, reference_opt), state(model, opt))


def test_extra_state_is_copied_at_take_and_given_back():
    counter = {"value": torch.tensor(1.0)}
    model, opt, _ = build()
    snapshot = TrainingSnapshot(
        model, [opt], extra=lambda: counter, restore_extra=lambda saved: counter.update(value=saved["value"])
    )
    snapshot.take(step=0)
    counter["value"] = torch.tensor(5.0)
    snapshot.restore()
    assert counter["value"].item() == 1.0


def test_the_snapshot_holds_one_copy_of_parameters_buffers_and_optimizer_state():
    model, opt, scheduler = build()
    train(model, opt, scheduler, steps=1, seed=1)
    snapshot = TrainingSnapshot(model, [opt])
    snapshot.take(step=1)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    optimizer_state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert snapshot.nbytes == params + buffers + optimizer_state


def test_restore_before_any_take_raises():
    model, opt, _ = build()
    with pytest.raises(RuntimeError, match="no snapshot was taken"):
        TrainingSnapshot(model, [opt]).restore()


@run_if(min_cuda_gpus=1)
def test_cuda_snapshot_is_pinned_and_taken_without_a_host_sync():
    model, opt, scheduler = build("cuda")
    train(model, opt, scheduler, steps=2, seed=1)
    snapshot = TrainingSnapshot(model, [opt], [scheduler])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        snapshot.take(step=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    saved = state(model, opt)
    # the buffers of the CUDA tensors are pinned (Adam keeps its step counts on the host: plain buffers for those)
    sources, _, _ = snapshot._tensors()
    assert any(source.is_cuda for source in sources)
    assert all(buffer.is_pinned() == source.is_cuda for buffer, source in zip(snapshot._host, sources, strict=True))
    train(model, opt, scheduler, steps=3, seed=2)
    snapshot.restore()
    torch.cuda.synchronize()
    assert_same(saved, state(model, opt))
