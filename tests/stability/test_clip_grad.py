import math

import pytest
import torch

from lightning_mgpu.stability.clip_grad import (
    GradNormStatistics,
    adaptive_clip_grads_,
    clip_grads_by_norm_,
    total_grad_norm,
    unitwise_norm,
    zscore_clip_grads_,
)
from tests.helpers.runif import run_if


def test_total_norm_by_hand():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])]
    assert float(total_grad_norm(grads)) == pytest.approx(5.0)
    assert float(total_grad_norm(grads, norm_type=1.0)) == pytest.approx(7.0)
    assert float(total_grad_norm(grads, norm_type=math.inf)) == pytest.approx(4.0)


def test_clip_by_norm_by_hand_and_like_torch():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])]
    before = clip_grads_by_norm_(grads, max_norm=1.0)
    assert float(before) == pytest.approx(5.0)
    torch.testing.assert_close(grads[0], torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[1], torch.tensor([[0.0, 0.8]]), atol=1e-6, rtol=0)
    small = [torch.tensor([0.3, 0.4])]
    clip_grads_by_norm_(small, max_norm=1.0)  # under the limit: untouched (coefficient clamped to 1)
    assert torch.equal(small[0], torch.tensor([0.3, 0.4]))

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    expected = [p.grad.clone() for p in params]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(reference, expected, strict=True):
        r.grad = g
    torch.nn.utils.clip_grad_norm_(reference, 2.0)
    clip_grads_by_norm_([p.grad for p in params], 2.0)
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_unitwise_norm_by_hand():
    torch.testing.assert_close(unitwise_norm(torch.tensor([[3.0, 4.0], [6.0, 8.0]])), torch.tensor([[5.0], [10.0]]))
    torch.testing.assert_close(unitwise_norm(torch.tensor([3.0, 4.0])), torch.tensor(5.0))
    conv = torch.ones(2, 3, 2, 2)  # per output channel: sqrt(12)
    torch.testing.assert_close(unitwise_norm(conv).flatten(), torch.full((2,), math.sqrt(12)))


def test_adaptive_clipping_by_hand():
    weight = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    # unit 0: |w| = 5, limit 0.5; grad norm 1 -> halved. unit 1: |w| = 0 -> eps 1e-3, limit 1e-4; grad norm 2e-5 kept
    weight.grad = torch.tensor([[0.6, 0.8], [0.0, 2e-5]])
    bias = torch.nn.Parameter(torch.tensor([1.0, 0.0]))
    bias.grad = torch.tensor([0.0, 1.0])  # |b| = 1, limit 0.1, grad norm 1 -> scaled to 0.1
    adaptive_clip_grads_([weight, bias], clip_factor=0.1, eps=1e-3)
    torch.testing.assert_close(weight.grad, torch.tensor([[0.3, 0.4], [0.0, 2e-5]]))
    torch.testing.assert_close(bias.grad, torch.tensor([0.0, 0.1]))


@pytest.fixture(params=["host", "device"])
def arithmetic(request, monkeypatch):
    """Run a test with the CPU's host-number statistics, and again with the device arithmetic accelerators use."""
    if request.param == "device":
        monkeypatch.setattr(GradNormStatistics, "_host_device_types", ())
    return request.param


def test_norm_statistics_are_exact_then_exponential(arithmetic):
    stats = GradNormStatistics(decay=0.5)
    for value in (1.0, 3.0):
        stats.update(torch.tensor(value))
    assert float(stats.mean) == pytest.approx(2.0) and float(stats.var) == pytest.approx(1.0)
    stats.update(torch.tensor(5.0))  # weight max(0.5, 1/3) = 0.5: mean 3.5, var 0.5 * (1 + 0.5 * 9) = 2.75
    assert float(stats.mean) == pytest.approx(3.5) and float(stats.var) == pytest.approx(2.75)
    stats.update(torch.tensor(float("nan")))  # ignored by the statistics, the count included
    assert float(stats.mean) == pytest.approx(3.5) and int(stats.count) == 3
    restored = GradNormStatistics(decay=0.5)
    restored.load_state_dict(stats.state_dict())
    assert int(restored.count) == 3 and float(restored.mean) == pytest.approx(3.5) and float(restored.var) == 2.75
    assert stats.on_host == (arithmetic == "host")  # where the norms were; a restored copy moves on its first norm


def test_zscore_clipping_by_hand(arithmetic):
    stats = GradNormStatistics(decay=0.9)
    for value in (1.0, 3.0):  # warm-up: statistics only, gradients untouched
        grads = [torch.tensor([value])]
        norm, threshold = zscore_clip_grads_(grads, stats, z_threshold=2.0, warmup_steps=2)
        assert float(threshold) == float("inf") and float(grads[0]) == value
    # mean 2, std 1: threshold 4. A norm of 10 is scaled to 4, then recorded as 4 (not 10)
    grads = [torch.tensor([6.0, 8.0])]
    norm, threshold = zscore_clip_grads_(grads, stats, z_threshold=2.0, warmup_steps=2)
    assert float(norm) == pytest.approx(10.0) and float(threshold) == pytest.approx(4.0)
    torch.testing.assert_close(grads[0], torch.tensor([2.4, 3.2]), atol=1e-5, rtol=0)
    assert float(stats.mean) == pytest.approx(2.0 + (1 / 3) * 2.0)  # weight max(0.1, 1/3) on the clipped 4
    # a non-finite norm is not clipped (NaNSkip's business) and leaves the statistics alone
    count = int(stats.count)
    zscore_clip_grads_([torch.tensor([float("inf")])], stats, z_threshold=2.0, warmup_steps=2)
    assert int(stats.count) == count
    # a norm under the threshold is left alone
    grads = [torch.tensor([1.0])]
    zscore_clip_grads_(grads, stats, z_threshold=2.0, warmup_steps=2)
    assert float(grads[0]) == 1.0


def test_host_and_device_statistics_agree_step_by_step(monkeypatch):
    # the same 300 norms, NaN, Inf and skipped steps among them, through both arithmetics: the same gradients (to
    # float32 rounding), the same decisions to clip, the same statistics; the host path scales only clipped steps
    generator = torch.Generator().manual_seed(0)
    sequence = []
    for step in range(300):
        values = torch.randn(3, 4, generator=generator) * (1.0 + 4.0 * float(torch.rand((), generator=generator)))
        if step % 37 == 5:
            values[0, 0] = float("nan")
        elif step % 41 == 7:
            values[1, 2] = float("inf")
        sequence.append((values, torch.tensor(step % 29 == 3)))

    def run() -> tuple[GradNormStatistics, list[torch.Tensor], list[float]]:
        stats, grads, thresholds = GradNormStatistics(decay=0.9), [], []
        for values, skipped in sequence:
            grad = values.clone()
            _, threshold = zscore_clip_grads_([grad], stats, z_threshold=1.5, warmup_steps=5, skipped=skipped)
            grads.append(grad)
            thresholds.append(float(threshold))
        return stats, grads, thresholds

    host, host_grads, host_thresholds = run()
    assert host.on_host
    monkeypatch.setattr(GradNormStatistics, "_host_device_types", ())
    device, device_grads, device_thresholds = run()
    assert not device.on_host and isinstance(device.mean, torch.Tensor)
    taken = sum(bool(values.isfinite().all()) and not bool(skipped) for values, skipped in sequence)
    assert host.state_dict()["count"] == device.state_dict()["count"] == taken > 250
    assert host.state_dict() == pytest.approx(device.state_dict(), rel=1e-5)
    assert host_thresholds == pytest.approx(device_thresholds, rel=1e-5)
    clipped = 0
    for (values, _), ours, theirs in zip(sequence, host_grads, device_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0, equal_nan=True)
        clipped += not torch.equal(ours.nan_to_num(), values.nan_to_num())
    assert 20 < clipped < 150  # the threshold bites on some steps, not on all


def test_clip_to_max_norm_on_the_cpu_is_torch_bit_for_bit():
    # the CPU reads the coefficient and skips the multiplication by 1.0: the gradients are still exactly torch's
    for scale, max_norm in ((10.0, 2.0), (0.1, 2.0), (float("nan"), 2.0), (float("inf"), 2.0)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(5))]
        for p in params:
            p.grad = torch.randn_like(p) * 3.0
        params[1].grad[0] *= scale
        reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for r, p in zip(reference, params, strict=True):
            r.grad = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(reference, max_norm)
        clip_grads_by_norm_([p.grad for p in params], max_norm)
        for p, r in zip(params, reference, strict=True):
            assert torch.equal(p.grad.nan_to_num(), r.grad.nan_to_num()), scale
            assert torch.equal(p.grad.isnan(), r.grad.isnan()), scale


@run_if(min_cuda_gpus=1)
def test_statistics_on_a_gpu_are_device_tensors_equal_to_the_host_numbers():
    norms = [1.0, 3.0, float("nan"), 2.0, 40.0, 2.5]
    host, device = GradNormStatistics(decay=0.9), GradNormStatistics(decay=0.9)
    for norm in norms:
        for stats, where in ((host, "cpu"), (device, "cuda")):
            zscore_clip_grads_([torch.tensor([norm], device=where)], stats, z_threshold=2.0, warmup_steps=2)
    assert device.mean.device.type == "cuda" and host.on_host
    assert host.state_dict() == pytest.approx(device.state_dict(), rel=1e-5)


def test_an_overflowing_variance_turns_clipping_off_and_never_gives_nan(arithmetic):
    # a max-norm of 1e25 in float32: its square overflows the variance to inf. Clipping is then off (threshold inf),
    # the gradients untouched, never NaN, and the statistics recover no NaN; the host, in double precision, stays
    # finite and clips
    stats = GradNormStatistics(decay=0.97)
    for step, size in enumerate([1.0, 1.0, 1.0, 1e25, 1.0, 1.0, 1.0, 1e3]):
        grad = torch.tensor([size, -size])
        zscore_clip_grads_([grad], stats, z_threshold=2.0, warmup_steps=5, norm_type=math.inf)
        assert not grad.isnan().any(), step
        assert not math.isnan(float(stats.mean)) and not math.isnan(float(stats.var)), step
    if arithmetic == "device":
        assert float(stats.var) == math.inf and float(grad[0]) == 1e3  # off: the last norm passes unclipped
