"""``bucket_cap_mb="auto"`` on 2 real gloo processes, with step times steered by sleeping in some settings."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script

SCRIPT = Path(__file__).parents[1] / "helpers" / "bucket_fit.py"
BUDGET = 24  # 4 bucket sizes for this model: 7 + 5 + 5 + 5 steps
STEPS = 10 * BUDGET  # the shortest fit that tunes


def run_fit(out: Path, *args: object) -> list[dict]:
    result = run_script(SCRIPT, "--out", out, "--budget", BUDGET, *args, timeout=150, ranks=2)
    assert not result["hung"], result["output"][-3000:]
    assert result["rc"] == 0, result["output"][-3000:]
    return load_rank_dumps(out)


def assert_same_on_both_ranks(dumps: list[dict]) -> None:
    for name, value in dumps[0]["params"].items():
        torch.testing.assert_close(dumps[1]["params"][name], value, rtol=0, atol=0, msg=name)
    assert dumps[0]["settings"] == dumps[1]["settings"]
    first, second = dumps[0]["tuning"], dumps[1]["tuning"]
    assert (first is None) == (second is None)
    if first is not None:
        # rank 1's own clock differs from rank 0's: equal step times show that rank 0's decided for both
        for key in ("bucket_cap_mb", "comm_hook", "step_ms", "reason", "tuning_steps"):
            assert first[key] == second[key], key


@pytest.fixture(scope="module")
def tuned_to_5mb(tmp_path_factory) -> tuple[list[dict], Path]:
    """``auto`` where every setting but 5 MB sleeps 60 ms a step; saves a checkpoint at the end."""
    out = tmp_path_factory.mktemp("tuned")
    checkpoint = out / "tuned.ckpt"
    dumps = run_fit(out, "--bucket", "auto", "--slow-unless", "5MB:60", "--max-steps", STEPS, "--save-ckpt", checkpoint)
    return dumps, checkpoint


def test_auto_takes_the_fastest_size_on_every_rank_and_trains_as_that_size_from_the_start(tuned_to_5mb, tmp_path):
    dumps, _ = tuned_to_5mb
    assert_same_on_both_ranks(dumps)
    for dump in dumps:
        tuning = dump["tuning"]
        assert tuning["reason"] == "tuned"
        assert tuning["bucket_cap_mb"] == 5
        assert set(tuning["step_ms"]) == {"default", "1MB", "5MB", "25MB"}
        assert tuning["tuning_steps"] <= BUDGET
        assert dump["final_setting"] == "5MB"
        # every size was really run: DDP's own bucket cap changed between steps
        assert Counter(dump["settings"][: tuning["tuning_steps"]]) == {"default": 7, "1MB": 5, "5MB": 5, "25MB": 5}
        assert set(dump["settings"][tuning["tuning_steps"] :]) == {"5MB"}
        assert dump["global_step"] == STEPS
        # logged once, with the choice, the cost and every trial's time
        (logged,) = dump["logged"]
        assert logged["ddp/bucket_cap_mb"] == 5
        assert logged["ddp/bucket_tuning_speedup"] > 1.5
        assert logged["ddp/bucket_trial_ms/5MB"] == pytest.approx(tuning["step_ms"]["5MB"])
    fixed = run_fit(tmp_path, "--bucket", "5", "--max-steps", STEPS)
    assert_same_on_both_ranks(fixed)
    assert fixed[0]["tuning"] is None  # a fixed size is never tuned
    assert set(fixed[0]["settings"]) == {"5MB"}
    for name, value in fixed[0]["params"].items():
        # 2 ranks: each element is the same sum whatever the bucket, so the runs are bit-identical
        torch.testing.assert_close(dumps[0]["params"][name], value, rtol=0, atol=0, msg=name)


def test_resume_uses_the_checkpointed_size_without_tuning_again(tuned_to_5mb, tmp_path):
    _, checkpoint = tuned_to_5mb
    # were it to tune again, 1 MB would now win; the STEPS left are enough to tune
    dumps = run_fit(
        tmp_path, "--bucket", "auto", "--slow-unless", "1MB:20", "--max-steps", 2 * STEPS, "--resume", checkpoint
    )
    assert_same_on_both_ranks(dumps)
    for dump in dumps:
        assert dump["tuning"]["reason"] == "restored"
        assert dump["tuning"]["bucket_cap_mb"] == 5
        assert set(dump["settings"]) == {"5MB"}  # wrapped once, with 5 MB, and never re-wrapped
        assert len(dump["settings"]) == STEPS
        assert dump["logged"] == []


def test_every_size_slower_than_the_default_keeps_the_default(tmp_path):
    dumps = run_fit(tmp_path, "--bucket", "auto", "--slow-unless", "default:60", "--max-steps", STEPS)
    assert_same_on_both_ranks(dumps)
    for dump in dumps:
        assert dump["tuning"]["reason"] == "tuned"
        assert dump["tuning"]["bucket_cap_mb"] is None
        step_ms = dump["tuning"]["step_ms"]
        assert all(step_ms[label] > step_ms["default"] for label in ("1MB", "5MB", "25MB"))
        assert dump["final_setting"] == "default"
        assert set(dump["settings"][dump["tuning"]["tuning_steps"] :]) == {"default"}


def test_a_fit_too_short_to_pay_tuning_back_does_not_tune(tmp_path):
    # every step but the 5 MB ones sleeps: stop after 3, the decision is taken before the first
    command = ("--bucket", "auto", "--slow-unless", "5MB:60", "--max-steps", STEPS - 1, "--stop-after", 3)
    dumps = run_fit(tmp_path, *command)
    for dump in dumps:
        assert dump["tuning"]["reason"].startswith(f"the fit has {STEPS - 1} optimizer steps left, fewer than 10 x")
        assert dump["tuning"]["bucket_cap_mb"] is None
        assert set(dump["settings"]) == {"default"}
        assert dump["logged"] == []


def test_comm_hook_auto_keeps_a_hook_only_where_it_is_faster(tmp_path):
    dumps = run_fit(
        tmp_path, "--bucket", "5", "--comm-hook", "auto", "--slow-unless", "5MB+bf16:60", "--max-steps", STEPS
    )
    assert_same_on_both_ranks(dumps)
    for dump in dumps:
        tuning = dump["tuning"]
        assert (tuning["bucket_cap_mb"], tuning["comm_hook"]) == (5, "bf16")
        assert set(tuning["step_ms"]) == {"5MB", "5MB+fp16", "5MB+bf16"}
        assert dump["final_setting"] == "5MB+bf16"


def test_accumulation_and_validation_inside_the_tuning_steps(tmp_path):
    """Re-wraps only between optimizer steps, validation runs mid-tuning, and the run still equals the fixed one."""
    common = ("--accumulate", 2, "--val-every", 6, "--max-steps", STEPS, "--stop-after", BUDGET + 16)
    dumps = run_fit(tmp_path / "auto", "--bucket", "auto", "--slow-unless", "5MB:60", *common)
    assert_same_on_both_ranks(dumps)
    for dump in dumps:
        assert (dump["tuning"]["reason"], dump["tuning"]["bucket_cap_mb"]) == ("tuned", 5)
        settings = dump["settings"]
        assert all(settings[i] == settings[i + 1] for i in range(0, len(settings), 2))  # both batches of a step
    fixed = run_fit(tmp_path / "fixed", "--bucket", "5", *common)
    for name, value in fixed[0]["params"].items():
        torch.testing.assert_close(dumps[0]["params"][name], value, rtol=0, atol=0, msg=name)


def _expected_flag_sums(steps: int) -> list[list[float]]:
    from tests.helpers.bucket_fit import flag_contributions

    sums = []
    for step in range(steps):
        total = [0.0, 0.0]
        for rank in range(2):
            for slot, value in flag_contributions(step, rank).items():
                total[slot] += value
        sums.append(total)
    return sums


@pytest.mark.parametrize(("bucket", "comm_hook", "steps"), [("auto", "none", STEPS), ("5", "fp16", 30)])
def test_a_step_flag_rides_every_wrap_and_leaves_training_unchanged(tmp_path, bucket, comm_hook, steps):
    # asked for by a callback, the flag is carried by every DDP wrap, those of the bucket trials included, through
    # the plain and the compressed reduction, timed by PerformanceMonitor in the second case; the sums arrive at
    # every step on both ranks, and the parameters equal bit for bit a fit without the flag (5 MB buckets: with 2
    # ranks the bucket size does not change a sum)
    extra = ("--slow-unless", "5MB:60") if bucket == "auto" else ("--monitor",)
    flagged = run_fit(
        tmp_path / "flag", "--bucket", bucket, "--comm-hook", comm_hook, "--max-steps", steps, "--step-flag", *extra
    )
    reference = run_fit(tmp_path / "ref", "--bucket", "5", "--comm-hook", comm_hook, "--max-steps", steps)
    if bucket == "auto":  # the trials really wrapped the model anew, 4 times
        assert flagged[0]["tuning"]["reason"] == "tuned"
        assert set(flagged[0]["settings"]) == {"default", "1MB", "5MB", "25MB"}
    for ours, theirs in zip(flagged, reference, strict=True):
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name
    for rank in range(2):
        probe = torch.load(tmp_path / "flag" / f"flag_rank{rank}.pt")
        assert probe["registered"] == [True] * steps
        assert probe["timed"] == [bucket != "auto"] * steps
        assert probe["sums"] == _expected_flag_sums(steps)
