"""Ranks with different numbers of batches fail within seconds, naming the missing rank, instead of hanging."""

import threading
import time

import pytest
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_mgpu.long_runs import preemption
from lightning_mgpu.long_runs.preemption import EndOfFitTimeoutError, SigtermAgreement
from tests.long_runs.test_preemption import run_fit


def ranks_on_one_store(count: int = 2) -> list[SigtermAgreement]:
    store = dist.HashStore()
    return [SigtermAgreement(store, margin=1, interval=4, rank=r, world_size=count) for r in range(count)]


def run_batches(agreement: SigtermAgreement, batches: int) -> None:
    for _ in range(batches):
        agreement.at_batch_boundary()


def leave_in_thread(agreement: SigtermAgreement, delay: float = 0.0) -> tuple[threading.Thread, dict]:
    """Call ``at_train_end`` on another thread after ``delay`` seconds; the outcome lands in the returned dict."""
    outcome: dict = {}

    def leave():
        time.sleep(delay)
        try:
            agreement.at_train_end()
            outcome["exception"] = None
        except BaseException as err:
            outcome["exception"] = err

    thread = threading.Thread(target=leave, daemon=True)
    thread.start()
    return thread, outcome


class TestEndOfFitMeeting:
    """Two agreements on one real store stand for two ranks (one thread each where both wait)."""

    def test_rank_that_never_started_a_final_batch_is_named_after_the_timeout(self, monkeypatch):
        monkeypatch.setattr(preemption, "END_OF_FIT_TIMEOUT", 0.5)
        rank0, rank1 = ranks_on_one_store()
        run_batches(rank0, 10)
        run_batches(rank1, 11)  # rank 1 has more data: it is in batch 11, which rank 0 will never join
        start = time.monotonic()
        with pytest.raises(EndOfFitTimeoutError) as info:
            rank0.at_train_end()
        waited = time.monotonic() - start
        # at least the timeout; the upper bound catches a hang: a wait that does not end at the timeout
        assert preemption.END_OF_FIT_TIMEOUT <= waited < 10 * preemption.END_OF_FIT_TIMEOUT
        message = str(info.value)
        assert "rank(s) 1 did not reach the end of the fit" in message
        assert "rank 0 ended after 10 training batches" in message
        assert "rank(s) 1 had not started a final batch" in message
        assert "DistributedSampler" in message and "END_OF_FIT_TIMEOUT" in message

    def test_rank_that_started_a_later_last_batch_is_named_with_its_batch(self, monkeypatch):
        monkeypatch.setattr(preemption, "END_OF_FIT_TIMEOUT", 0.5)
        rank0, rank1 = ranks_on_one_store()
        run_batches(rank0, 10)
        run_batches(rank1, 11)
        rank1.publish_possibly_last_batch()  # its loader ends after batch 11: one more than rank 0's
        with pytest.raises(EndOfFitTimeoutError, match="rank 1 started batch 11 as possibly its last"):
            rank0.at_train_end()

    def test_rank_finishing_its_last_batch_is_waited_for_past_the_timeout(self, monkeypatch):
        monkeypatch.setattr(preemption, "END_OF_FIT_TIMEOUT", 0.3)
        rank0, rank1 = ranks_on_one_store()
        run_batches(rank0, 10)
        run_batches(rank1, 10)
        rank1.publish_possibly_last_batch()  # same last batch as rank 0: it is only slow (a last validation)
        thread0, outcome0 = leave_in_thread(rank0)
        time.sleep(1.5)  # five timeouts
        assert thread0.is_alive(), outcome0
        thread1, outcome1 = leave_in_thread(rank1)
        for thread in (thread0, thread1):
            thread.join(timeout=10)
        assert outcome0 == {"exception": None} and outcome1 == {"exception": None}

    def test_late_signal_on_the_last_rank_to_arrive_stops_both(self, monkeypatch):
        monkeypatch.setattr(preemption, "END_OF_FIT_TIMEOUT", 5.0)
        rank0, rank1 = ranks_on_one_store()
        run_batches(rank0, 9)
        run_batches(rank1, 9)
        thread0, outcome0 = leave_in_thread(rank0)  # arrives first, with no signal anywhere yet
        time.sleep(0.3)
        rank1.on_sigterm(15, None)  # after its last boundary: no stop batch can be published any more
        thread1, outcome1 = leave_in_thread(rank1)
        for thread in (thread0, thread1):
            thread.join(timeout=10)
        assert isinstance(outcome0["exception"], SIGTERMException)
        assert isinstance(outcome1["exception"], SIGTERMException)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("counts", "arrived", "missing"), [((10, 12), 0, 1), ((12, 10), 1, 0)], ids=["rank1_has_more", "rank0_has_more"]
)
def test_uneven_iterable_dataset_fails_within_seconds_naming_the_missing_rank(tmp_path, counts, arrived, missing):
    # a process-group timeout of 5 minutes: a barrier at the end of the fit would run into the 90 s kill
    result = run_fit(
        tmp_path,
        "mgpu",
        "--steps",
        -1,
        "--epochs",
        1,
        "--batches-per-rank",
        *counts,
        "--end-timeout",
        5,
        "--pg-timeout",
        300,
        timeout=90,
    )
    assert not result["hung"], result["output"][-3000:]
    # a hang, not a speed: without the end-of-fit agreement the rank that arrived would wait in a barrier for the
    # 300 s process-group timeout. The end-of-fit wait is 5 s; process start-up on a loaded machine is the rest
    assert result["seconds"] < 75
    record = result["records"][arrived]
    assert record["exception"] == "EndOfFitTimeoutError", result["output"][-3000:]
    assert record["completed"] == min(counts)
    assert f"rank(s) {missing} did not reach the end of the fit" in record["message"]
    assert f"rank {arrived} ended after {min(counts)} training batches" in record["message"]
    assert "different numbers of training batches" in record["message"]
    # the missing rank was stuck in a gradient all-reduce: it fails too once the other rank has gone
    if missing in result["records"]:
        assert result["records"][missing]["exception"] is not None
    assert result["rc"] != 0


@pytest.mark.distributed
def test_rank_slow_in_its_last_validation_is_waited_for(tmp_path):
    # rank 1 ends its last validation 6 s late, three times the end-of-fit timeout: it has started its last batch
    result = run_fit(
        tmp_path,
        "mgpu",
        "--steps",
        -1,
        "--epochs",
        1,
        "--batches-per-rank",
        10,
        10,
        "--end-timeout",
        2,
        "--slow-validation",
        1,
        6,
        timeout=90,
    )
    assert not result["hung"] and result["rc"] == 0, result["output"][-3000:]
    assert {r: (rec["exception"], rec["completed"]) for r, rec in result["records"].items()} == {
        0: (None, 10),
        1: (None, 10),
    }


@pytest.mark.distributed
def test_fit_stopped_mid_epoch_waits_for_a_rank_slow_in_on_train_end(tmp_path):
    # should_stop at step 5 (a Timer, EarlyStopping); rank 0 then spends 6 s in on_train_end, three times the timeout:
    # it left its training loop after the same batch as rank 1, so it is slow, not stuck in a batch of its own
    result = run_fit(
        tmp_path, "mgpu", "--steps", -1, "--epochs", 1, "--end-timeout", 2, "--stop-then-slow-end", 5, 0, 6, timeout=90
    )
    assert not result["hung"] and result["rc"] == 0, result["output"][-3000:]
    assert {r: rec["exception"] for r, rec in result["records"].items()} == {0: None, 1: None}
