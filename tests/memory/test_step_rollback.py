"""StepRollback puts back the running statistics and metric states that a failed attempt changed."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torchmetrics.aggregation import CatMetric, MeanMetric

from lightning_mgpu.memory.step_rollback import StepRollback

STATISTICS = ("running_mean", "running_var", "num_batches_tracked")

NORMS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "batchnorm1d": (lambda: nn.BatchNorm1d(3), (8, 3)),
    "batchnorm1d_sequence": (lambda: nn.BatchNorm1d(3), (8, 3, 5)),
    "batchnorm1d_cumulative": (lambda: nn.BatchNorm1d(3, momentum=None), (8, 3)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(3, track_running_stats=True), (4, 3, 6)),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (4, 3, 5, 5)),
}


def _inputs(shape: tuple[int, ...], seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(shape, generator=generator) + 1.0


def _statistics(norm: nn.Module) -> dict[str, Tensor]:
    return {name: getattr(norm, name).clone() for name in STATISTICS}


def _assert_statistics(norm: nn.Module, expected: dict[str, Tensor]) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(getattr(norm, name), value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _nested(norm: nn.Module) -> nn.Module:
    """The norm two levels down, as in a real model."""
    return nn.Sequential(nn.Identity(), nn.Sequential(norm))


@pytest.mark.parametrize("kind", list(NORMS))
def test_norm_statistics_are_restored_exactly_after_a_train_forward(kind):
    factory, shape = NORMS[kind]
    norm = factory()
    model = _nested(norm).train()
    for seed in range(2):  # statistics away from their initial values, so a reset would not pass for a restore
        model(_inputs(shape, seed))
    rollback = StepRollback(model)
    rollback.save()
    saved = _statistics(norm)
    buffers = [getattr(norm, name) for name in STATISTICS]

    model(_inputs(shape, seed=10))
    assert not torch.equal(norm.running_mean, saved["running_mean"])
    assert not torch.equal(norm.running_var, saved["running_var"])
    if isinstance(norm, nn.modules.batchnorm._BatchNorm):  # instance norms track no batch count
        assert norm.num_batches_tracked.item() == saved["num_batches_tracked"].item() + 1

    rollback.restore()
    _assert_statistics(norm, saved)
    restored_in_place = all(getattr(norm, name) is buffer for name, buffer in zip(STATISTICS, buffers, strict=True))
    assert restored_in_place, "restore must copy into the existing buffers, not replace them"


def test_every_norm_of_a_model_is_restored():
    norms = [factory() for factory, _ in NORMS.values()]
    model = nn.ModuleList([_nested(norm) for norm in norms]).train()

    def forward(seed: int) -> None:
        for layer, (_, shape) in zip(model, NORMS.values(), strict=True):
            layer(_inputs(shape, seed))

    forward(0)
    rollback = StepRollback(model)
    rollback.save()
    saved = [_statistics(norm) for norm in norms]
    forward(1)
    forward(2)
    rollback.restore()
    for norm, expected in zip(norms, saved, strict=True):
        _assert_statistics(norm, expected)


def test_restore_can_be_repeated_for_norm_statistics():
    norm = nn.BatchNorm1d(3)
    rollback = StepRollback(norm)
    norm(_inputs((8, 3), 0))
    rollback.save()
    saved = _statistics(norm)
    for seed in (1, 2):
        norm(_inputs((8, 3), seed))
        rollback.restore()
        _assert_statistics(norm, saved)


def test_norm_whose_running_statistics_were_removed_keeps_its_batch_count():
    norm = nn.BatchNorm1d(3)
    norm.running_mean = norm.running_var = None  # batch statistics in eval too; the count is still tracked
    rollback = StepRollback(norm)
    norm(_inputs((8, 3), 0))
    rollback.save()
    norm(_inputs((8, 3), 1))
    assert norm.num_batches_tracked.item() == 2
    rollback.restore()
    assert norm.num_batches_tracked.item() == 1
    assert norm.running_mean is None and norm.running_var is None


class _WithMetrics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)
        self.metrics = nn.ModuleDict({"mean": MeanMetric(), "cat": CatMetric()})

    @property
    def mean(self) -> MeanMetric:
        return self.metrics["mean"]

    @property
    def cat(self) -> CatMetric:
        return self.metrics["cat"]

    def update(self, value: float) -> None:
        self.mean.update(torch.tensor([value, 2 * value]))
        self.cat.update(torch.tensor([value]))


def test_metric_states_are_restored_after_failed_updates():
    model = _WithMetrics()
    rollback = StepRollback(model)
    model.update(1.0)
    model.update(3.0)
    mean_before, cat_before = model.mean.compute().clone(), model.cat.compute().clone()
    counts_before = (model.mean._update_count, model.cat._update_count)
    assert counts_before == (2, 2)

    rollback.save()
    model.update(100.0)
    model.update(-50.0)
    # a compute() inside the failed attempt caches a value that must not survive the restore
    assert not torch.equal(model.mean.compute(), mean_before)
    assert model.cat.compute().numel() == 4

    rollback.restore()
    assert (model.mean._update_count, model.cat._update_count) == counts_before
    torch.testing.assert_close(model.mean.compute(), mean_before, rtol=0, atol=0)
    torch.testing.assert_close(model.cat.compute(), cat_before, rtol=0, atol=0)
    assert len(model.cat.value) == 2

    model.update(5.0)  # the metrics go on from the restored state
    assert model.mean._update_count == 3
    torch.testing.assert_close(model.mean.compute(), torch.tensor((1 + 2 + 3 + 6 + 5 + 10) / 6))
    torch.testing.assert_close(model.cat.compute(), torch.tensor([1.0, 3.0, 5.0]))


def test_metric_restored_to_no_updates_at_all():
    model = _WithMetrics()
    rollback = StepRollback(model)
    rollback.save()
    model.update(7.0)
    rollback.restore()
    assert model.mean._update_count == 0
    assert model.cat.value == []
    torch.testing.assert_close(model.mean.mean_value, torch.tensor(0.0))
    torch.testing.assert_close(model.mean.weight, torch.tensor(0.0))


def test_second_save_replaces_the_first():
    model = nn.ModuleDict({"norm": nn.BatchNorm1d(3), "metrics": _WithMetrics()}).train()
    norm, metrics = model["norm"], model["metrics"]
    rollback = StepRollback(model)
    norm(_inputs((8, 3), 0))
    metrics.update(1.0)
    rollback.save()

    norm(_inputs((8, 3), 1))
    metrics.update(2.0)
    rollback.save()
    saved = _statistics(norm)
    mean_saved, cat_saved = metrics.mean.compute().clone(), metrics.cat.compute().clone()

    norm(_inputs((8, 3), 2))
    metrics.update(3.0)
    rollback.restore()

    _assert_statistics(norm, saved)
    assert norm.num_batches_tracked.item() == 2
    assert metrics.mean._update_count == 2
    torch.testing.assert_close(metrics.mean.compute(), mean_saved, rtol=0, atol=0)
    torch.testing.assert_close(metrics.cat.compute(), cat_saved, rtol=0, atol=0)


def test_model_without_tracked_statistics_or_metrics_is_a_no_op():
    model = nn.Sequential(
        nn.Linear(3, 6),
        nn.BatchNorm1d(6, track_running_stats=False),
        nn.Unflatten(1, (3, 2)),
        nn.InstanceNorm1d(3),  # tracks no running statistics by default
    ).train()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    rollback = StepRollback(model)
    rollback.restore()  # before any save: nothing to put back
    for seed in range(2):
        rollback.save()
        model(_inputs((4, 3), seed))
        rollback.restore()
    assert model.state_dict().keys() == state.keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


def test_restore_before_any_save_leaves_the_state_alone():
    model = nn.ModuleDict({"norm": nn.BatchNorm1d(3), "metrics": _WithMetrics()}).train()
    rollback = StepRollback(model)
    model["norm"](_inputs((8, 3), 0))
    model["metrics"].update(4.0)
    saved = _statistics(model["norm"])
    rollback.restore()
    _assert_statistics(model["norm"], saved)
    assert model["metrics"].mean._update_count == 1
    assert [value.tolist() for value in model["metrics"].cat.value] == [[4.0]]


def test_restore_follows_buffers_replaced_by_a_dtype_change_and_can_run_twice():
    from torchmetrics.aggregation import MeanMetric

    model = torch.nn.Module()
    model.norm = torch.nn.BatchNorm1d(3)
    model.mean = MeanMetric()
    rollback = StepRollback(model)
    model.double()  # replaces the running statistics with new tensors
    model.norm(torch.randn(8, 3, dtype=torch.float64))
    before = model.norm.running_mean.clone()
    rollback.save()
    model.norm(torch.randn(8, 3, dtype=torch.float64) + 5)
    model.mean.update(torch.tensor(10.0))
    rollback.restore()
    torch.testing.assert_close(model.norm.running_mean, before, rtol=0, atol=0)
    model.mean.update(torch.tensor(10.0))
    rollback.restore()  # the snapshot was not changed by the update after the first restore
    model.mean.update(torch.tensor(1.0))
    assert model.mean.compute().item() == 1.0
