"""The bucket tuner's logic with a fake clock, its result type, and the strategy's single-process decisions."""

import math

import pytest

from lightning_mgpu.ddp.bucket_tuning import (
    MAX_TIMED_STEPS,
    MIN_GAIN,
    SETTLE_STEPS,
    WARMUP_STEPS,
    BucketTuner,
    BucketTuningResult,
    Trial,
    bucket_candidates,
    choose_trial,
    noise_margin,
    plan_trials,
)


@pytest.mark.parametrize(
    ("gradient_mb", "expected"),
    [
        (0.5, [None]),  # the default's 1 MiB first bucket holds everything
        (4.0, [None, 1, 5]),
        (8.0, [None, 1, 5, 25]),
        (100.0, [None, 5, 25, 50, 100]),  # 1 MB would make 100 buckets
        (1000.0, [None, 25, 50, 100, 200, 400, 800]),
        (math.inf, [None]),
        (0.0, [None]),
    ],
)
def test_bucket_candidates(gradient_mb, expected):
    assert bucket_candidates(gradient_mb) == expected


def test_plan_gives_each_trial_settle_plus_timed_steps_within_the_budget():
    sizes, hooks, timed = plan_trials([None, 1, 5, 25], ["bf16"], budget=30)
    assert (sizes, hooks, timed) == ([None, 1, 5, 25], ["bf16"], 3)
    assert WARMUP_STEPS + 5 * (SETTLE_STEPS + timed) <= 30
    assert plan_trials([None, 5], [], budget=1000)[2] == MAX_TIMED_STEPS


def test_plan_drops_the_sizes_farthest_from_the_default_then_hooks():
    sizes, hooks, timed = plan_trials([None, 1, 5, 25, 50, 100, 200], [], budget=10)
    assert (sizes, timed) == ([None, 25], 2)
    sizes, hooks, timed = plan_trials([None, 1, 5, 25, 50, 100, 200], ["fp16", "bf16"], budget=10)
    assert (sizes, hooks, timed) == ([None], ["fp16"], 2)


def test_choose_keeps_the_baseline_unless_a_trial_is_clearly_faster():
    default, big = Trial(None), Trial(50)
    assert choose_trial({default: 0.100, big: 0.090}, default) == big
    assert choose_trial({default: 0.100, big: 0.099}, default) == default  # within 2%: noise
    assert choose_trial({default: 0.100, big: 0.150, Trial(5): 0.120}, default) == default  # all slower
    assert choose_trial({big: 0.010}, default) == default  # the baseline was never timed
    assert choose_trial({default: 0.100, big: math.nan}, default) == default


def drive(tuner: BucketTuner, step_seconds, max_steps: int = 200) -> list[Trial]:
    """Run optimizer steps on a fake clock; ``step_seconds(trial, steps_since_switch)``; returns each step's trial."""
    now, ran, since_switch = 0.0, [], 0
    for _ in range(max_steps):
        switch = tuner.step_started(now)
        if tuner.needs_decision:
            switch = tuner.decide(tuner.timings(), now)
        since_switch = 0 if switch is not None or not ran else since_switch + 1
        ran.append(tuner.current)
        now += step_seconds(tuner.current, since_switch)
    return ran


def test_tuner_times_each_size_on_its_own_steps_and_keeps_the_fastest():
    cost = {Trial(None): 0.100, Trial(1): 0.130, Trial(5): 0.070, Trial(25): 0.090}
    tuner = BucketTuner([None, 1, 5, 25], [], fixed_hook=None, budget=24, world_size=2)
    # DDP's first step after a wrap records the gradient order and the second rebuilds the buckets: neither counts
    ran = drive(tuner, lambda trial, since_switch: cost[trial] + {0: 1.0, 1: 5.0}.get(since_switch, 0.0))
    result = tuner.result
    assert result is not None and result.reason == "tuned"
    assert (result.bucket_cap_mb, result.comm_hook) == (5, None)
    assert result.step_ms == pytest.approx({t.label: c * 1000 for t, c in cost.items()})
    assert result.tuning_steps == 22 <= 24
    assert ran[:22] == [Trial(None)] * 7 + [Trial(1)] * 5 + [Trial(5)] * 5 + [Trial(25)] * 5
    assert set(ran[22:]) == {Trial(5)}  # the deciding step already runs with the choice
    assert result.speedup == pytest.approx(0.100 / 0.070)
    assert (result.baseline, result.margin) == ("default", MIN_GAIN)  # equal steps: no noise


def test_tuning_seconds_leave_out_the_warm_up_steps():
    # a first step of 6 s (torch.compile compiling) is not time spent comparing bucket sizes
    tuner = BucketTuner([None, 5], [], fixed_hook=None, budget=12, world_size=2)
    now, step = 0.0, 0
    tuner.step_started(now)
    while not tuner.needs_decision:
        now += 6.0 if step == 0 else 0.1
        step += 1
        tuner.step_started(now)
    tuner.decide(tuner.timings(), now)
    compared = tuner.result.tuning_steps - WARMUP_STEPS
    assert tuner.result.tuning_seconds == pytest.approx(compared * 0.1)


def test_tuner_tries_hooks_at_the_chosen_size_against_no_hook():
    cost = {Trial(None): 0.1, Trial(5): 0.08, Trial(5, "fp16"): 0.09, Trial(5, "bf16"): 0.06}
    tuner = BucketTuner([None, 5], ["fp16", "bf16"], fixed_hook=None, budget=22, world_size=2)
    ran = drive(tuner, lambda trial, since_switch: cost[trial])
    assert (tuner.result.bucket_cap_mb, tuner.result.comm_hook) == (5, "bf16")
    assert tuner.result.speedup == pytest.approx(0.1 / 0.06)  # against torch's default, where tuning started
    assert tuner.result.step_ms.keys() == {t.label for t in cost}
    assert ran[-1] == Trial(5, "bf16")
    # a hook that is not faster is not kept
    slow_hooks = {**cost, Trial(5, "bf16"): 0.081}
    tuner = BucketTuner([None, 5], ["fp16", "bf16"], fixed_hook=None, budget=22, world_size=2)
    drive(tuner, lambda trial, since_switch: slow_hooks[trial])
    assert (tuner.result.bucket_cap_mb, tuner.result.comm_hook) == (5, None)


def test_tuner_decides_on_the_shared_timings_not_its_own():
    tuner = BucketTuner([None, 5], [], fixed_hook=None, budget=12, world_size=2)
    now = 0.0
    while not tuner.needs_decision:
        tuner.step_started(now)
        now += 0.1 if tuner.current == Trial(None) else 0.05  # locally 5 MB is faster
    # rank 0 measured otherwise: back to the default, which this step already runs with
    assert tuner.decide(({Trial(None): 0.1, Trial(5): 0.2}, MIN_GAIN), now) == Trial(None)
    assert tuner.current == Trial(None)
    assert tuner.result.bucket_cap_mb is None


def test_noisy_steps_need_a_larger_gain():
    quiet = {Trial(None): [0.100, 0.100, 0.100], Trial(5): [0.096, 0.096, 0.096]}
    noisy = {Trial(None): [0.090, 0.100, 0.110], Trial(5): [0.086, 0.096, 0.106]}
    assert noise_margin(quiet, 3) == MIN_GAIN
    assert noise_margin(noisy, 3) == pytest.approx(5.0 * 0.1 / 3**0.5, rel=0.05)
    medians = {trial: sorted(times)[1] for trial, times in noisy.items()}
    assert choose_trial(medians, Trial(None), noise_margin(quiet, 3)) == Trial(5)
    assert choose_trial(medians, Trial(None), noise_margin(noisy, 3)) == Trial(None)


def test_steps_that_ran_something_else_are_not_timed():
    tuner = BucketTuner([None, 5], [], fixed_hook=None, budget=14, world_size=2)
    now, step = 0.0, 0
    while not tuner.needs_decision:
        tuner.step_started(now, discard=step == 10)  # step 9 ran a validation of 100 s
        now += 100.0 if step == 9 else 0.1
        step += 1
    medians, _ = tuner.timings()
    assert medians == pytest.approx({Trial(None): 0.1, Trial(5): 0.1})


def test_result_round_trips_through_a_checkpoint_and_reads_older_ones():
    result = BucketTuningResult(50, "bf16", "tuned", {"default": 10.0, "50MB+bf16": 8.0}, "default", 0.03, 20, 1.5, 4)
    restored = BucketTuningResult.restored(result.state_dict())
    assert restored.reason == "restored" and restored.tuned
    assert restored.state_dict() == result.state_dict()
    assert restored.speedup == pytest.approx(1.25)
    old = BucketTuningResult.restored({"bucket_cap_mb": 5})
    assert (old.bucket_cap_mb, old.comm_hook, old.world_size, old.step_ms) == (5, None, 1, {})
    assert "chose 50MB+bf16 = 1.25x default after 20 steps (1.5 s of tuning, a change had to gain 3%)" in (
        result.summary()
    )
    assert "default 10.0, 50MB+bf16 8.0" in result.summary()
    skipped = BucketTuningResult(None, None, "one process")
    assert not skipped.tuned and skipped.summary() == "kept default (one process)"
    assert skipped.effective_bucket_cap_mb == 25
