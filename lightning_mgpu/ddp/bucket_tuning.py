"""Choosing DDP's gradient bucket size, and where allowed a comm hook, by timing the run's own training steps.

The pieces are plain Python so that they can be tested with a fake clock: :func:`bucket_candidates` lists the
sizes worth trying for a model, :func:`plan_trials` fits them into a step budget, :func:`choose_trial` applies the
guard rails, and :class:`BucketTuner` walks through the trials one optimizer step at a time. The strategy
(:class:`~lightning_mgpu.ddp.ddp.DDPStrategy`) re-wraps DDP when the tuner says so and shares rank 0's
timings so that every rank takes the same decision.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Bucket sizes tried, in MB (torch's "MB" is MiB). Sizes holding every gradient in one bucket behave alike,
# so only the smallest of them is tried.
BUCKET_LADDER_MB: tuple[float, ...] = (1, 5, 25, 50, 100, 200, 400, 800)
# more buckets than this pay one collective's latency each and have never won
MAX_BUCKETS = 64
# torch's default: a first bucket of 1 MiB, then 25 MiB
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0
# a candidate must beat the baseline by this share of its step time to replace it, and by more where the step
# times measured are noisier (see noise_margin): a change within the noise is not worth making
MIN_GAIN = 0.02
# about two standard errors of a difference of two medians, in units of the relative median absolute deviation
# of the timed steps divided by sqrt(timed steps per trial)
NOISE_MARGIN_FACTOR = 5.0
# tuning only runs when the fit has at least this many times the tuning budget in optimizer steps
PAYBACK_FACTOR = 10
# the first optimizer steps of a fit are slow (allocator, lazy initialisation) and are never timed
WARMUP_STEPS = 2
# after a re-wrap, DDP's first step records the order gradients arrive in and the second rebuilds the buckets
# in that order (a broadcast and new allocations): both are left untimed
SETTLE_STEPS = 2
MIN_TIMED_STEPS = 2
MAX_TIMED_STEPS = 8


@dataclass(frozen=True)
class Trial:
    """One setting tried: a bucket size (``None`` for torch's default) and a comm hook name (``None`` for none)."""

    bucket_cap_mb: float | None
    comm_hook: str | None = None

    @property
    def label(self) -> str:
        """A short name for logs and metric keys: ``"default"``, ``"50MB"``, ``"50MB+bf16"``."""
        size = "default" if self.bucket_cap_mb is None else f"{self.bucket_cap_mb:g}MB"
        return size if self.comm_hook is None else f"{size}+{self.comm_hook}"


@dataclass
class BucketTuningResult:
    """What ``bucket_cap_mb="auto"`` settled on, why, and what it measured.

    Args:
        bucket_cap_mb: the bucket size in use; ``None`` is torch's default (a 1 MiB first bucket, then 25 MiB).
        comm_hook: the comm hook in use, ``None`` for plain all-reduce.
        reason: ``"tuned"``, ``"restored"`` (from a checkpoint) or why tuning was skipped.
        step_ms: median milliseconds per optimizer step of each trial, by :attr:`Trial.label`.
        baseline: the label of the setting a change is measured against (torch's default size, or the fixed one,
            with no hook or the fixed hook).
        margin: the share of the baseline's step time a setting had to gain to be chosen.
        tuning_steps: optimizer steps the tuning spanned, warm-up included.
        tuning_seconds: wall time of the steps that compared settings: warm-up left out, so a first step's
            compilation (``torch.compile``) or data-loader start is not counted.
        world_size: the number of processes the timings were taken with.

    Example::

        trainer.fit(model)
        trainer.strategy.bucket_tuning  # BucketTuningResult(bucket_cap_mb=50.0, comm_hook=None, reason='tuned', ...)
    """

    bucket_cap_mb: float | None
    comm_hook: str | None
    reason: str
    step_ms: dict[str, float] = field(default_factory=dict)
    baseline: str = "default"
    margin: float = 0.0
    tuning_steps: int = 0
    tuning_seconds: float = 0.0
    world_size: int = 1

    @property
    def tuned(self) -> bool:
        """Whether the setting comes from timings (taken in this run, or in the run a checkpoint came from)."""
        return self.reason in ("tuned", "restored")

    @property
    def effective_bucket_cap_mb(self) -> float:
        """The bucket size in MB, with torch's default written as its 25."""
        return DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb

    @property
    def speedup(self) -> float | None:
        """Step time of the baseline over step time of the chosen setting, when both were timed."""
        chosen = self.step_ms.get(Trial(self.bucket_cap_mb, self.comm_hook).label)
        baseline = self.step_ms.get(self.baseline)
        if chosen is None or baseline is None or chosen <= 0:
            return None
        return baseline / chosen

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the checkpoint, so a resumed fit uses the same setting without tuning again."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "comm_hook": self.comm_hook,
            "step_ms": dict(self.step_ms),
            "baseline": self.baseline,
            "margin": self.margin,
            "tuning_steps": self.tuning_steps,
            "tuning_seconds": self.tuning_seconds,
            "world_size": self.world_size,
        }

    @classmethod
    def restored(cls, state: dict[str, Any]) -> "BucketTuningResult":
        """The result saved by :meth:`state_dict`; missing keys (older checkpoints) take their defaults."""
        return cls(
            bucket_cap_mb=state.get("bucket_cap_mb"),
            comm_hook=state.get("comm_hook"),
            reason="restored",
            step_ms=dict(state.get("step_ms", {})),
            baseline=str(state.get("baseline", "default")),
            margin=float(state.get("margin", 0.0)),
            tuning_steps=int(state.get("tuning_steps", 0)),
            tuning_seconds=float(state.get("tuning_seconds", 0.0)),
            world_size=int(state.get("world_size", 1)),
        )

    def summary(self) -> str:
        """One line for the log: the choice, its gain over the baseline, and every trial's step time."""
        chosen = Trial(self.bucket_cap_mb, self.comm_hook).label
        if not self.tuned:
            return f"kept {chosen} ({self.reason})"
        trials = ", ".join(f"{label} {ms:.1f}" for label, ms in self.step_ms.items())
        gain = f" = {self.speedup:.2f}x {self.baseline}" if self.speedup is not None else ""
        source = "from the checkpoint" if self.reason == "restored" else f"after {self.tuning_steps} steps"
        return (
            f"chose {chosen}{gain} {source} ({self.tuning_seconds:.1f} s of tuning, a change had to gain "
            f"{self.margin:.0%}); ms per step: {trials}"
        )


def bucket_candidates(gradient_mb: float, ladder: tuple[float, ...] = BUCKET_LADDER_MB) -> list[float | None]:
    """Bucket sizes worth timing for a model with ``gradient_mb`` MB of gradients; ``None`` (torch's default) first.

    Sizes giving more than :data:`MAX_BUCKETS` buckets are left out, as are all but the smallest size that holds
    every gradient in one bucket.

    Example::

        bucket_candidates(0.5)    # [None]: one bucket whatever the size
        bucket_candidates(4.0)    # [None, 1, 5]
        bucket_candidates(100.0)  # [None, 5, 25, 50, 100]
    """
    if not math.isfinite(gradient_mb) or gradient_mb <= DEFAULT_FIRST_BUCKET_MB:
        return [None]  # the default's first bucket already holds every gradient: every size behaves alike
    sizes: list[float | None] = [None]
    for size in ladder:
        if gradient_mb / size > MAX_BUCKETS:
            continue
        sizes.append(size)
        if size >= gradient_mb:
            break
    return sizes


def plan_trials(bucket_sizes: list[float | None], hooks: list[str], budget: int) -> tuple[list, list, int]:
    """Fit the trials into ``budget`` optimizer steps; returns the bucket sizes and hooks kept, and timed steps each.

    Each trial takes :data:`SETTLE_STEPS` untimed steps then the timed ones, after :data:`WARMUP_STEPS` for the
    whole tuning. When the budget cannot give every trial :data:`MIN_TIMED_STEPS`, the sizes farthest from torch's
    default are dropped first, then the hooks (last listed first).

    Example::

        plan_trials([None, 1, 5, 25], ["bf16"], budget=30)  # ([None, 1, 5, 25], ['bf16'], 3)
    """
    sizes, hooks = list(bucket_sizes), list(hooks)

    def trial_count() -> int:
        return len(sizes) + len(hooks)

    def per_trial() -> int:
        return (budget - WARMUP_STEPS) // max(trial_count(), 1) - SETTLE_STEPS

    while per_trial() < MIN_TIMED_STEPS and trial_count() > 1:
        explicit = [size for size in sizes if size is not None]
        if len(sizes) > 1 and explicit:
            sizes.remove(max(explicit, key=lambda size: abs(math.log(size / DEFAULT_BUCKET_CAP_MB))))
        elif hooks:
            hooks.pop()
        else:
            break
    return sizes, hooks, min(max(per_trial(), 0), MAX_TIMED_STEPS)


def choose_trial(step_seconds: dict[Trial, float], baseline: Trial, min_gain: float = MIN_GAIN) -> Trial:
    """The fastest trial, unless it beats ``baseline`` by less than ``min_gain`` of the baseline's step time.

    A trial slower than the baseline is therefore never chosen; without a timing for the baseline nothing is
    changed.

    Example::

        choose_trial({Trial(None): 0.100, Trial(50): 0.090}, Trial(None))  # Trial(bucket_cap_mb=50, ...)
        choose_trial({Trial(None): 0.100, Trial(50): 0.099}, Trial(None))  # Trial(bucket_cap_mb=None, ...)
        choose_trial({Trial(None): 0.100, Trial(50): 0.090}, Trial(None), min_gain=0.15)  # noisy: the default
    """
    base = step_seconds.get(baseline)
    if base is None or not math.isfinite(base):
        return baseline
    timed = {trial: seconds for trial, seconds in step_seconds.items() if math.isfinite(seconds)}
    fastest = min(timed, key=lambda trial: (timed[trial], trial != baseline))
    return fastest if timed[fastest] < base * (1 - min_gain) else baseline


def noise_margin(durations: dict[Trial, list[float]], timed_steps: int) -> float:
    """The gain a trial needs to count as faster: :data:`MIN_GAIN`, or more when the timed steps are noisy.

    The noise is the median, over every timed step of every trial, of its distance to its trial's median, relative
    to that median (a robust spread that a validation run or a checkpoint save inside a step barely moves).

    Example::

        noise_margin({Trial(None): [0.100, 0.101, 0.099], Trial(5): [0.08, 0.08, 0.08]}, 3)  # 0.02
    """
    deviations = []
    for times in durations.values():
        if len(times) >= 2:
            middle = statistics.median(times)
            deviations += [abs(t - middle) / middle for t in times if middle > 0]
    if not deviations:
        return MIN_GAIN
    return max(MIN_GAIN, NOISE_MARGIN_FACTOR * statistics.median(deviations) / math.sqrt(max(timed_steps, 1)))


@dataclass
class _Segment:
    trial: Trial
    untimed: int
    timed: int


class BucketTuner:
    """Walks through bucket-size trials, then comm-hook trials, one optimizer step at a time.

    Call :meth:`step_started` at the start of every optimizer step with the clock's time. It returns the trial to
    switch to before this step runs, or ``None``. When :attr:`needs_decision` turns true, share :meth:`timings`
    from rank 0 and pass them to :meth:`decide`, which returns the trial to switch to next (or the final one) and
    sets :attr:`result` once the last phase is decided.

    Args:
        bucket_sizes: sizes to time, torch's default (``None``) first: it is the baseline and the wrap in use.
        hooks: comm hooks to time against no hook, at the chosen bucket size.
        fixed_hook: the hook used while bucket sizes are timed (the user's fixed one, or ``None``).
        budget: at most this many optimizer steps of tuning.
        world_size: stored in the result.

    Example::

        tuner = BucketTuner([None, 5, 25], hooks=[], fixed_hook=None, budget=20, world_size=2)
        switch = tuner.step_started(time.perf_counter())
    """

    def __init__(
        self, bucket_sizes: list[float | None], hooks: list[str], fixed_hook: str | None, budget: int, world_size: int
    ) -> None:
        sizes, self.hooks, self.timed_steps = plan_trials(bucket_sizes, hooks, budget)
        self.world_size = world_size
        self.baseline = Trial(sizes[0], fixed_hook)
        self.first_baseline = self.baseline  # what the result's speedup is measured against
        self.current = self.baseline
        self.needs_decision = False
        self.result: BucketTuningResult | None = None
        self._durations: dict[Trial, list[float]] = {}
        self._segments: deque[_Segment] = deque(
            _Segment(Trial(size, fixed_hook), SETTLE_STEPS, self.timed_steps) for size in sizes
        )
        self._segments[0].untimed += WARMUP_STEPS
        self._active: _Segment | None = None
        self._timing: Trial | None = None  # the trial whose timed step is running
        self._previous_start: float | None = None
        self._first_start: float | None = None
        self._steps = 0
        self._phase = "buckets"

    @property
    def done(self) -> bool:
        """Whether the last phase is decided and :attr:`result` is set."""
        return self.result is not None

    def step_started(self, now: float, discard: bool = False) -> Trial | None:
        """Record the step that just ended and move on; returns the trial to switch to before this step, if any.

        Args:
            now: the clock's time.
            discard: the step that just ended also ran something else (validation, an epoch's end): not timed.
        """
        if self.done or self.needs_decision:
            return None
        if self._first_start is None and self._steps == WARMUP_STEPS:
            self._first_start = now  # warm-up steps (a first step's compilation, say) are no cost of tuning
        if self._timing is not None and self._previous_start is not None and not discard:
            self._durations.setdefault(self._timing, []).append(now - self._previous_start)
        self._previous_start = now
        return self._advance()

    def _advance(self) -> Trial | None:
        # the step starting now belongs to the active segment, or to the next one, or ends the phase
        self._timing = None
        switch = None
        if self._active is None or self._active.untimed + self._active.timed == 0:
            if not self._segments:
                self.needs_decision = True
                return None
            self._active = self._segments.popleft()
            switch = self._switch_to(self._active.trial)
        self._steps += 1
        if self._active.untimed > 0:
            self._active.untimed -= 1
        else:
            self._active.timed -= 1
            self._timing = self._active.trial
        return switch

    def timings(self) -> tuple[dict[Trial, float], float]:
        """Median seconds per optimizer step of every trial timed so far, and the gain a change needs."""
        medians = {trial: statistics.median(times) for trial, times in self._durations.items() if times}
        return medians, noise_margin(self._durations, self.timed_steps)

    def decide(self, timings: tuple[dict[Trial, float], float], now: float) -> Trial | None:
        """Apply the timings every rank shares (rank 0's); returns the trial to switch to before this step, if any.

        The step that asked for the decision runs with the returned trial: the next phase's first trial, or the
        final choice.
        """
        self.needs_decision = False
        step_seconds, margin = timings
        if self._phase == "buckets":
            hook = self.baseline.comm_hook
            same_hook = {trial: sec for trial, sec in step_seconds.items() if trial.comm_hook == hook}
            chosen = choose_trial(same_hook, self.baseline, margin)
            if self.hooks:
                # no-hook at the chosen size was timed already: it is the baseline the hooks must beat
                self._phase = "hooks"
                self.baseline = chosen
                self._segments.extend(
                    _Segment(Trial(chosen.bucket_cap_mb, hook), SETTLE_STEPS, self.timed_steps) for hook in self.hooks
                )
                return self._advance()
        else:
            same_size = {
                trial: sec for trial, sec in step_seconds.items() if trial.bucket_cap_mb == self.baseline.bucket_cap_mb
            }
            chosen = choose_trial(same_size, self.baseline, margin)
        self.result = BucketTuningResult(
            bucket_cap_mb=chosen.bucket_cap_mb,
            comm_hook=chosen.comm_hook,
            reason="tuned",
            step_ms={trial.label: seconds * 1000 for trial, seconds in step_seconds.items()},
            baseline=self.first_baseline.label,
            margin=margin,
            tuning_steps=self._steps,
            tuning_seconds=now - (self._first_start if self._first_start is not None else now),
            world_size=self.world_size,
        )
        return self._switch_to(chosen)

    def _switch_to(self, trial: Trial) -> Trial | None:
        if trial == self.current:
            return None
        self.current = trial
        return trial
