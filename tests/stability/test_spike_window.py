"""SpikeWindow: the rolling window and z-score test NaNSkip's spike detection runs on the device."""

import copy
import random
import statistics

import pytest
import torch

from lightning_mgpu.stability.spike_window import SpikeWindow

ACCEPT = torch.tensor(True)


def test_statistics_are_those_of_the_last_size_accepted_values():
    window = SpikeWindow(rows=2, size=16, zscore=3.0, warmup=4)
    rng = random.Random(0)
    seen: list[list[float]] = [[], []]
    for step in range(100):
        values = [rng.gauss(5, 1), rng.gauss(-2, 0.1)]
        accept = step % 7 != 3  # skipped steps stay out
        window.update(torch.tensor(values, dtype=torch.float64), torch.tensor(accept))
        if accept:
            for row, value in enumerate(values):
                seen[row].append(value)
    mean, std = window.statistics()
    for row in range(2):
        assert float(mean[row]) == pytest.approx(statistics.fmean(seen[row][-16:]), rel=1e-12)
        assert float(std[row]) == pytest.approx(statistics.stdev(seen[row][-16:]), rel=1e-9)
    assert int(window.count) == 16


def test_a_spike_is_flagged_after_warmup_and_only_above_the_mean():
    window = SpikeWindow(rows=1, size=8, zscore=3.0, warmup=5)
    for value in (1.0, 1.2, 0.8, 1.1):
        window.update(torch.tensor([value]), ACCEPT)
    assert not window.is_spike(torch.tensor([100.0])).item()  # 4 values: still warming up
    window.update(torch.tensor([0.9]), ACCEPT)
    assert window.is_spike(torch.tensor([100.0])).item()
    assert not window.is_spike(torch.tensor([-100.0])).item()  # one-sided: a drop is no spike
    assert not window.is_spike(torch.tensor([1.3])).item()
    assert not window.is_spike(torch.tensor([float("inf")])).item()  # NaNSkip's non-finite check owns those


def test_non_finite_and_rejected_values_never_enter():
    window = SpikeWindow(rows=2, size=4, zscore=3.0, warmup=2)
    window.update(torch.tensor([1.0, 2.0]), ACCEPT)
    window.update(torch.tensor([float("nan"), 3.0]), ACCEPT)  # one row non-finite: the whole step stays out
    window.update(torch.tensor([5.0, 6.0]), torch.tensor(False))
    assert int(window.count) == 1
    mean, _ = window.statistics()
    assert mean.tolist() == [1.0, 2.0]


def test_equal_values_do_not_flag_rounding_noise():
    window = SpikeWindow(rows=1, size=8, zscore=6.0, warmup=4)
    for _ in range(8):
        window.update(torch.tensor([2.5]), ACCEPT)
    assert not window.is_spike(torch.tensor([2.5 * (1 + 1e-7)])).item()
    assert window.is_spike(torch.tensor([2.6])).item()


def test_state_dict_round_trip_continues_identically():
    first = SpikeWindow(rows=1, size=6, zscore=2.0, warmup=3)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0):
        first.update(torch.tensor([value]), ACCEPT)
    second = SpikeWindow(rows=1, size=6, zscore=2.0, warmup=3)
    second.load_state_dict(first.state_dict())
    for window in (first, second):
        window.update(torch.tensor([9.0]), ACCEPT)
    assert [t.tolist() for t in first.statistics()] == [t.tolist() for t in second.statistics()]
    other_shape = SpikeWindow(rows=1, size=5, zscore=2.0, warmup=3)
    other_shape.load_state_dict(first.state_dict())
    assert int(other_shape.count) == 0  # a window of another size starts empty


def test_default_warmup_follows_olmo_core():
    assert SpikeWindow(rows=1, size=128, zscore=6.0).warmup == 64
    assert SpikeWindow(rows=1, size=30, zscore=6.0).warmup == 20
    assert SpikeWindow(rows=1, size=10, zscore=6.0).warmup == 10


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"size": 1}, ValueError, r"SpikeWindow: size must be an int >= 2, got 1"),
        ({"zscore": -1.0}, ValueError, r"SpikeWindow: zscore must be a positive number, got -1.0"),
        ({"warmup": 9}, ValueError, r"SpikeWindow: warmup must be an int >= 2 and <= 8, got 9"),
        ({"rows": 0}, ValueError, r"SpikeWindow: rows must be an int >= 1, got 0"),
    ],
)
def test_bad_input_is_named(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        SpikeWindow(**{"rows": 1, "size": 8, "zscore": 3.0, **kwargs})


def test_an_update_never_writes_into_tensors_another_copy_shares():
    # ddp_spawn pickles a callback into each worker with its CPU tensors in memory the processes share: an in-place
    # update would mix the ranks' windows (it did, in a 2-process test, before updates became out of place)
    window = SpikeWindow(rows=1, size=4, zscore=3.0, warmup=2)
    twin = copy.copy(window)  # the same tensors, as two workers would hold
    twin.update(torch.tensor([3.0]), ACCEPT)
    assert int(window.count) == 0 and not window.values.any() and not window._sums.any()
    assert int(twin.count) == 1 and twin.statistics()[0].item() == 3.0
