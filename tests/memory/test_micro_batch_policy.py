"""MicroBatchSizePolicy alone: the sizes OOMBackoff trains with, without a Trainer."""

import pickle

import pytest

from lightning_mgpu.memory.micro_batch_policy import MicroBatchSizePolicy


def run_batch(policy: MicroBatchSizePolicy, total: int, fits: int) -> list[int]:
    """One training batch on a device where at most ``fits`` samples fit; returns the sizes tried."""
    size = policy.start_batch(total)
    tried = [size]
    while size > fits:
        smaller = policy.smaller_size(size)
        assert smaller is not None, f"no size below {size}"
        policy.back_off(smaller)
        size = smaller
        tried.append(size)
    policy.batch_succeeded()
    return tried


def test_a_batch_starts_whole_until_an_out_of_memory_error():
    policy = MicroBatchSizePolicy(min_size=1, probe_up_after=2)
    assert policy.start_batch(64) == 64
    assert not policy.probing
    assert policy.batch_succeeded() is None
    assert policy.micro_batch_size is None
    assert policy.good_batches == 0  # good batches only count once there is a smaller size to probe up from
    assert policy.last_batch_size == 64


def test_each_error_halves_the_size_and_the_size_that_worked_is_kept():
    policy = MicroBatchSizePolicy()
    assert run_batch(policy, 64, fits=10) == [64, 32, 16, 8]
    assert policy.micro_batch_size == 8
    assert policy.recoveries == 3
    assert policy.start_batch(64) == 8
    assert policy.start_batch(5) == 5  # a short last batch runs whole


def test_halving_stops_at_the_floor_and_the_floor_itself_gives_up():
    policy = MicroBatchSizePolicy(min_size=3)
    assert policy.smaller_size(12) == 6
    assert policy.smaller_size(6) == 3
    assert policy.smaller_size(5) == 3  # 5 // 2 would go below the floor
    assert policy.smaller_size(4) == 3
    assert policy.smaller_size(3) is None
    assert policy.smaller_size(2) is None
    assert policy.recoveries == 0  # proposing is no backoff


def test_no_probe_when_probe_up_after_is_none():
    policy = MicroBatchSizePolicy()
    run_batch(policy, 16, fits=4)
    for _ in range(50):
        assert policy.start_batch(16) == 4
        assert not policy.probing
        policy.batch_succeeded()
    assert policy.micro_batch_size == 4


def test_a_probe_doubles_the_size_after_n_good_batches_and_climbs_back_to_the_whole_batch():
    policy = MicroBatchSizePolicy(probe_up_after=2)
    assert run_batch(policy, 16, fits=4) == [16, 8, 4]
    assert policy.good_batches == 1  # the batch that backed off finished at 4
    assert run_batch(policy, 16, fits=16) == [4]
    assert policy.good_batches == 2
    assert policy.start_batch(16) == 8 and policy.probing
    assert policy.batch_succeeded() == 8
    assert policy.micro_batch_size == 8 and policy.good_batches == 0
    assert run_batch(policy, 16, fits=16) == [8]
    assert run_batch(policy, 16, fits=16) == [8]
    assert policy.start_batch(16) == 16 and policy.probing
    assert policy.batch_succeeded() == 16
    assert policy.micro_batch_size is None  # the whole batch again
    assert policy.recoveries == 2  # probes are no recoveries
    assert policy.probe_wait == 2


def test_a_probe_is_capped_at_the_batch():
    policy = MicroBatchSizePolicy(probe_up_after=1)
    policy.start_batch(12)
    policy.back_off(7)
    policy.batch_succeeded()
    assert policy.start_batch(12) == 12 and policy.probing
    assert policy.batch_succeeded() == 12
    assert policy.micro_batch_size is None


def test_a_failed_probe_goes_back_to_the_size_that_worked_and_doubles_the_wait():
    policy = MicroBatchSizePolicy(probe_up_after=3)
    assert run_batch(policy, 10, fits=5) == [10, 5]
    assert run_batch(policy, 8, fits=5) == [5]
    assert run_batch(policy, 8, fits=5) == [5]
    assert policy.start_batch(8) == 8 and policy.probing  # twice 5, capped at the batch
    assert policy.smaller_size(8) == 5  # the size that worked, not half of the probe
    policy.back_off(5)
    assert not policy.probing
    assert policy.micro_batch_size == 5
    assert policy.recoveries == 1  # a failed probe is no recovery
    assert policy.probe_wait == 6
    assert policy.batch_succeeded() is None  # the batch finished at 5: no probe succeeded
    assert policy.good_batches == 1


def test_the_wait_doubles_at_every_failed_probe():
    policy = MicroBatchSizePolicy(probe_up_after=1)
    run_batch(policy, 8, fits=2)  # 8 -> 4 -> 2, and the batch finished: one good batch
    plain_batches, waits = [], []
    for _ in range(3):
        batches = 0
        while policy.start_batch(8) == 2:
            policy.batch_succeeded()
            batches += 1
        assert policy.probing and policy.probe_size == 4
        policy.back_off(policy.smaller_size(4))
        policy.batch_succeeded()  # the failed probe's batch finished at 2: it counts as a good batch
        plain_batches.append(batches)
        waits.append(policy.probe_wait)
    assert waits == [2, 4, 8]
    assert plain_batches == [0, 1, 3]  # the wait minus the failed probe's own batch
    assert policy.micro_batch_size == 2 and policy.recoveries == 2


def test_evaluation_has_its_own_size_which_only_goes_down():
    policy = MicroBatchSizePolicy(min_size=2)
    assert policy.start_eval_batch(20) == 20
    assert policy.eval_back_off(20) == 10
    assert policy.eval_back_off(10) == 5
    assert policy.eval_back_off(5) == 2
    assert policy.eval_back_off(2) is None
    assert policy.eval_micro_batch_size == 2
    assert policy.start_eval_batch(20) == 2
    assert policy.start_eval_batch(1) == 1
    assert policy.micro_batch_size is None and policy.recoveries == 0  # training's size is untouched


def test_state_round_trip_resumes_the_same_decisions():
    policy = MicroBatchSizePolicy(probe_up_after=3)
    run_batch(policy, 32, fits=8)
    run_batch(policy, 32, fits=8)
    policy.eval_back_off(32)
    state = policy.state_dict()
    assert state == {
        "micro_batch_size": 8,
        "eval_micro_batch_size": 16,
        "recoveries": 2,
        "good_batches": 2,
        "probe_wait": 3,
    }
    assert all(isinstance(value, int) for value in state.values())  # plain values for the checkpoint

    resumed = MicroBatchSizePolicy(probe_up_after=3)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert resumed.state_dict() == state
    run_batch(policy, 32, fits=8)
    run_batch(resumed, 32, fits=8)
    assert policy.start_batch(32) == resumed.start_batch(32) == 16  # both probe at the same batch
    assert policy.probing and resumed.probing


def test_a_checkpoint_written_before_the_policy_existed_loads():
    # the keys OOMBackoff saved before its policy was a class of its own, loader_batch_size included
    old = {
        "micro_batch_size": 4,
        "eval_micro_batch_size": None,
        "recoveries": 1,
        "good_batches": 5,
        "probe_wait": 8,
        "loader_batch_size": None,
    }
    policy = MicroBatchSizePolicy(probe_up_after=2)
    policy.load_state_dict(old)
    assert policy.state_dict() == {key: value for key, value in old.items() if key != "loader_batch_size"}
    assert policy.start_batch(16) == 4 and not policy.probing  # 5 good batches of the 8 the wait had grown to


def test_a_checkpoint_without_the_keys_starts_fresh():
    policy = MicroBatchSizePolicy(probe_up_after=4)
    run_batch(policy, 16, fits=4)
    policy.load_state_dict({})
    assert policy.state_dict() == {
        "micro_batch_size": None,
        "eval_micro_batch_size": None,
        "recoveries": 0,
        "good_batches": 0,
        "probe_wait": 4,
    }
    assert policy.start_batch(16) == 16


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"min_size": 0}, ValueError), ({"min_size": 1.5}, TypeError), ({"probe_up_after": 0}, ValueError)],
)
def test_bad_sizes_are_refused(kwargs, error):
    with pytest.raises(error, match=r"^MicroBatchSizePolicy: "):
        MicroBatchSizePolicy(**kwargs)
