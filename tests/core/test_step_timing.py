"""Step timing on a clock the test drives: marks, windows, lagged device marks, the overlap arithmetic."""

import math

import pytest

from lightning_mgpu.core.step_timing import (
    STEP_METRICS,
    CommTimer,
    StepTimer,
    WindowTotals,
    exposed_ms,
    union_ms,
    window_figures,
)
from lightning_mgpu.performance.stragglers import StragglerWatch


class ManualClock:
    """Marks are the time the test set (ms); a mark is ready once the test has released it."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.released_up_to = math.inf

    def mark(self) -> float:
        return self.now_ms

    def ready(self, mark: float) -> bool:
        return mark <= self.released_up_to

    def ms(self, start: float, end: float) -> float:
        return end - start


def test_union_and_exposed_spans():
    assert union_ms([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_ms([]) == 0
    # backward's compute ends at 2.5: of the union [0, 3] + [5, 6], 0.5 + 1 is after it
    assert exposed_ms([(0, 2), (1, 3), (5, 6)], 2.5) == pytest.approx(1.5)
    assert exposed_ms([(0, 2)], 2.5) == 0


def run_step(
    timer: StepTimer,
    clock: ManualClock,
    start_s: float,
    wait_ms: float,
    compute_ms: float,
    opt_ms: float,
    samples: int = 8,
    stepped: bool = True,
) -> float:
    """One batch on the manual clock (host times in seconds, device marks in ms); returns its end time (s)."""
    now = start_s + wait_ms / 1e3
    clock.now_ms = now * 1e3
    timer.batch_start(now, samples, tokens=samples * 4)
    clock.now_ms += compute_ms
    if stepped:
        timer.optimizer_start()
        clock.now_ms += opt_ms
    end = now + (compute_ms + (opt_ms if stepped else 0)) / 1e3
    timer.batch_end(end, stepped=stepped)
    return end


def test_a_window_holds_per_step_means_and_leaves_out_the_first_step():
    clock = ManualClock()
    timer = StepTimer(clock)
    timer.start(0.0)
    end = 0.0
    for _ in range(4):
        end = run_step(timer, clock, end, wait_ms=2, compute_ms=5, opt_ms=1)
    totals = timer.take_window()
    assert totals.steps == 3  # the first step warms up
    figures = window_figures(totals, comm_timed=False, multi_process=False, flops_per_sample=100.0, peak_flops=1e6)
    assert figures["step_ms"] == pytest.approx(8)
    assert figures["data_wait_ms"] == pytest.approx(2)
    assert figures["fwd_bwd_ms"] == pytest.approx(5)
    assert figures["optimizer_ms"] == pytest.approx(1)
    assert figures["busy_ms"] == pytest.approx(8)  # one process: nobody to wait for
    assert figures["samples_per_sec"] == pytest.approx(1000)
    assert figures["tokens_per_sec"] == pytest.approx(4000)
    assert figures["tflops"] == pytest.approx(100 * 1000 / 1e12)
    assert figures["mfu_pct"] == pytest.approx(100 * 1e5 / 1e6)
    assert math.isnan(figures["comm_ms"]) and math.isnan(figures["comm_overlap_pct"])
    assert timer.take_window().steps == 0  # a new window


def test_accumulated_micro_batches_make_one_step():
    clock = ManualClock()
    timer = StepTimer(clock, skip_steps=0)
    timer.start(0.0)
    end = run_step(timer, clock, 0.0, wait_ms=1, compute_ms=4, opt_ms=0, stepped=False)
    end = run_step(timer, clock, end, wait_ms=1, compute_ms=4, opt_ms=2)
    end = run_step(timer, clock, end, wait_ms=1, compute_ms=4, opt_ms=0, stepped=False)
    run_step(timer, clock, end, wait_ms=1, compute_ms=4, opt_ms=2)
    totals = timer.take_window()
    assert totals.steps == 2 and totals.samples == 32
    assert totals.wall_ms == pytest.approx(24) and totals.data_wait_ms == pytest.approx(4)
    assert totals.device_steps == 2 and totals.fwd_bwd_ms == pytest.approx(16)


def test_device_marks_not_yet_complete_are_counted_in_a_later_window():
    clock = ManualClock()
    timer = StepTimer(clock, skip_steps=0)
    timer.start(0.0)
    end = run_step(timer, clock, 0.0, wait_ms=1, compute_ms=5, opt_ms=1)
    clock.released_up_to = clock.now_ms  # the device has done everything so far, nothing later
    run_step(timer, clock, end, wait_ms=1, compute_ms=5, opt_ms=1)
    first = timer.take_window()
    assert first.steps == 2  # host figures come at once
    assert first.device_steps == 1  # the second step's events have not completed: nothing waits for them
    clock.released_up_to = math.inf
    second = timer.take_window()
    assert second.steps == 0 and second.device_steps == 1 and second.fwd_bwd_ms == pytest.approx(5)


def test_host_figures_are_summed_once_across_partial_resolves():
    clock = ManualClock()
    timer = StepTimer(clock, skip_steps=0)
    timer.start(0.0)
    end = run_step(timer, clock, 0.0, wait_ms=1, compute_ms=5, opt_ms=1)
    clock.released_up_to = -math.inf  # nothing on the device has completed
    end = run_step(timer, clock, end, wait_ms=1, compute_ms=5, opt_ms=1)
    timer.resolve()  # host sums for both steps, no device figure
    end = run_step(timer, clock, end, wait_ms=1, compute_ms=5, opt_ms=1)
    clock.released_up_to = math.inf
    totals = timer.take_window()
    assert totals.steps == 3 and totals.wall_ms == pytest.approx(21)  # each step's host figures once
    assert totals.device_steps == 3 and totals.fwd_bwd_ms == pytest.approx(15)


def test_a_step_without_reduction_spans_leaves_the_communication_unknown():
    # OOMBackoff averages the gradients itself: the timed hook never runs, which says nothing of communication
    clock = ManualClock()
    timer = StepTimer(clock, CommTimer(clock), skip_steps=0)
    timer.start(0.0)
    run_step(timer, clock, 0.0, wait_ms=1, compute_ms=5, opt_ms=1)
    figures = window_figures(
        timer.take_window(), comm_timed=True, multi_process=True, flops_per_sample=None, peak_flops=None
    )
    assert math.isnan(figures["comm_ms"]) and math.isnan(figures["busy_ms"])


def test_validation_time_belongs_to_no_step():
    clock = ManualClock()
    timer = StepTimer(clock, skip_steps=0)
    timer.start(0.0)
    end = run_step(timer, clock, 0.0, wait_ms=1, compute_ms=5, opt_ms=1)
    timer.pause(end)
    timer.resume(end + 2.0)  # two seconds of validation
    run_step(timer, clock, end + 2.0, wait_ms=1, compute_ms=5, opt_ms=1)
    totals = timer.take_window()
    assert totals.steps == 2
    assert totals.wall_ms == pytest.approx(14) and totals.data_wait_ms == pytest.approx(2)


def test_communication_overlap_and_exposure_per_step():
    clock = ManualClock()
    comm = CommTimer(clock)
    timer = StepTimer(clock, comm, skip_steps=0)
    timer.start(0.0)
    clock.now_ms = 1.0
    timer.batch_start(0.001, 8, None)
    # two buckets: [3, 6] overlaps the backward, [5, 9] ends 4 ms after the last bucket was handed over at 5
    comm.spans += [(3.0, 6.0), (5.0, 9.0)]
    clock.now_ms = 9.0
    timer.optimizer_start()
    clock.now_ms = 10.0
    timer.batch_end(0.010, stepped=True)
    figures = window_figures(
        timer.take_window(), comm_timed=True, multi_process=True, flops_per_sample=None, peak_flops=None
    )
    assert figures["comm_ms"] == pytest.approx(6)
    assert figures["comm_exposed_ms"] == pytest.approx(4)
    assert figures["comm_overlap_pct"] == pytest.approx(100 * 2 / 6)
    assert figures["busy_ms"] == pytest.approx(10 - 4)  # the step took 10 ms from the loop's start
    assert math.isnan(figures["tflops"]) and math.isnan(figures["tokens_per_sec"])


def test_unknown_figures_are_nan_not_zero():
    figures = window_figures(WindowTotals(), comm_timed=True, multi_process=True, flops_per_sample=1.0, peak_flops=1.0)
    assert set(figures) == set(STEP_METRICS) and all(math.isnan(v) for v in figures.values())
    totals = WindowTotals(steps=2, wall_ms=10.0, samples=4)
    # several processes and no timed reduction: how long a rank waited for the others is unknown
    assert math.isnan(
        window_figures(totals, comm_timed=False, multi_process=True, flops_per_sample=None, peak_flops=None)["busy_ms"]
    )


def test_a_straggler_is_named_after_its_windows_in_a_row_and_once():
    watch = StragglerWatch(margin=0.2, windows=3)
    assert watch.update([10.0, 30.0, 10.5, 11.0]) == []
    assert watch.update([10.0, 30.0, 10.5, 11.0]) == []
    flagged = watch.update([10.0, 30.0, 10.5, 11.0])
    assert [(s.rank, s.value, s.others_median) for s in flagged] == [(1, 30.0, 10.5)]
    assert watch.update([10.0, 30.0, 10.5, 11.0]) == []  # named once
    watch.update([10.0, 10.0, 10.5, 11.0])  # recovers...
    for _ in range(2):
        assert watch.update([10.0, 30.0, 10.5, 11.0]) == []
    assert [s.rank for s in watch.update([10.0, 30.0, 10.5, 11.0])] == [1]  # ...and can be named again


def test_a_rank_within_the_margin_or_unknown_is_not_a_straggler():
    watch = StragglerWatch(margin=0.2, windows=2)
    assert watch.update([10.0, 11.9]) == []
    assert watch.update([10.0, 12.1]) == []
    assert watch.update([10.0, math.nan]) == []  # unknown: the run of slow windows neither breaks nor grows
    assert [s.rank for s in watch.update([10.0, 12.1])] == [1]
