"""OOMBackoff across 2 real gloo processes (Lightning re-runs a script for rank 1), with out-of-memory errors
injected on rank 1 only: in the forward, in the backward, and in the optimizer step; with BatchNorm synchronised
across the ranks, and without."""

import re
from pathlib import Path

import pytest
import torch

from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script

SCRIPT = Path(__file__).parents[1] / "helpers" / "oom_fit.py"
NUM_SAMPLES = 32


def run_fit(out: Path, *args: object, timeout: float = 150) -> tuple[dict, list[dict]]:
    result = run_script(SCRIPT, "--out", out, *args, timeout=timeout, ranks=2)
    assert not result["hung"], result["output"][-3000:]
    return result, load_rank_dumps(out)


def stock_micro_batches(out: Path, accumulate: int, *extra: object) -> list[dict]:
    """Stock Lightning, no callback: batches of 4 accumulated over ``accumulate``, from the start."""
    args = ("--inject", "none", "--batch-size", 4, "--accumulate", accumulate, "--no-backoff", *extra)
    result, dumps = run_fit(out, *args)
    assert result["rc"] == 0, result["output"][-3000:]
    return dumps


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """What batches of 8 that back off to micro-batches of 4 must train as."""
    return stock_micro_batches(tmp_path_factory.mktemp("reference"), accumulate=2)


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def every_index_once_per_epoch(dumps: list[dict]) -> None:
    for epoch in range(2):
        union = sorted(i for dump in dumps for i in dump["epoch_indices"][epoch])
        assert union == list(range(NUM_SAMPLES)), f"epoch {epoch}"


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("from_batch", [0, 1])  # the first step (before DDP's bucket rebuild) or a later one
def test_an_oom_on_one_rank_is_recovered_on_both(tmp_path, reference, where, from_batch):
    result, dumps = run_fit(tmp_path, "--inject", where, "--rank", 1, "--oom-from-batch", from_batch)
    assert result["rc"] == 0, result["output"][-3000:]
    assert "rank 1 ran out of memory at micro-batch size 8" in result["output"]

    assert [d["exception"] for d in dumps] == [None, None]
    assert [d["micro_batch_size"] for d in dumps] == [4, 4]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    # the batches before the failure ran whole, DDP's reduction carrying the flag; the rest in micro-batches
    assert [d["flag_carried"] for d in dumps] == [True, True]
    assert [d["whole_batches"] for d in dumps] == [from_batch, from_batch]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)  # identical replicas
    assert_params_close(dumps[0]["params"], reference[0]["params"], atol=1e-5)  # the trajectory asked for
    # the metric that records indices (undone after a failed attempt) holds every sample once per epoch
    every_index_once_per_epoch(dumps)
    # the plain Python lists, which nothing undoes: rank 0's whole batch ran before rank 1's failure reached it,
    # and ran again in micro-batches, so it holds that batch's 8 samples twice
    rank0_seen = [i for batch in dumps[0]["seen"] for i in batch]
    assert len(rank0_seen) == NUM_SAMPLES + 8
    rank1_seen = [i for batch in dumps[1]["seen"] for i in batch]
    if where == "forward":
        # the failed attempt stopped before the list was appended to: every sample once on rank 1
        assert sorted(rank1_seen) == sorted(i for epoch in dumps[1]["epoch_indices"] for i in epoch)
    else:
        # the failed attempt's forward finished: the list holds its 8 samples once more
        assert len(rank1_seen) == NUM_SAMPLES + 8


@pytest.mark.distributed
def test_an_oom_on_both_ranks_in_the_same_step_is_recovered(tmp_path, reference):
    result, dumps = run_fit(tmp_path, "--inject", "backward", "--rank", -1, "--oom-from-batch", 1)
    assert result["rc"] == 0, result["output"][-3000:]
    assert "rank 1 ran out of memory at micro-batch size 8" in result["output"]
    assert [d["micro_batch_size"] for d in dumps] == [4, 4]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    assert_params_close(dumps[0]["params"], reference[0]["params"], atol=1e-5)
    every_index_once_per_epoch(dumps)


@pytest.mark.distributed
def test_with_no_oom_a_step_runs_the_collectives_of_ddp_alone(tmp_path):
    # a steady step (after the bucket rebuild), counted by the profiler: DDP's own gradient all-reduces, with the
    # flag riding in the last one, and no agreement, no reduce after the backward, no broadcast of ours
    runs = {}
    for name, extra in (("backoff", ()), ("alone", ("--no-backoff",))):
        out = tmp_path / name
        result, dumps = run_fit(out, "--inject", "none", "--profile-step", 2, *extra)
        assert result["rc"] == 0, result["output"][-3000:]
        runs[name] = dumps
    for rank in range(2):
        alone, backoff = runs["alone"][rank], runs["backoff"][rank]
        assert alone["collectives"].get("gloo:all_reduce", 0) >= 1  # the profiler sees DDP's reduction
        assert backoff["collectives"] == alone["collectives"], rank
        assert backoff["whole_batches"] == 4  # 2 epochs of 2 batches per rank: every batch ran whole
        assert_params_close(backoff["params"], alone["params"], atol=0)  # and trained bit for bit the same


@pytest.mark.distributed
def test_an_oom_in_the_optimizer_step_on_one_rank_stops_both_within_seconds(tmp_path):
    result, dumps = run_fit(tmp_path, "--inject", "step", "--rank", 1, timeout=120)
    assert result["rc"] != 0
    # a hang, not a speed: a rank left waiting for the other until a timeout (the hang watchdog's 10 minutes, the
    # process group's 30) instead of stopping at once; start-up on a loaded machine is most of the bound
    assert result["seconds"] < 60, "the ranks waited for a collective timeout instead of stopping together"
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert "rank 1 ran out of memory inside the optimizer step; every rank stops" in dumps[0]["exception"]["message"]
    assert "inside the optimizer step (step 2)" in dumps[1]["exception"]["message"]
    assert "CUDA out of memory" in dumps[1]["exception"]["message"]


@pytest.mark.distributed
def test_an_oom_in_the_last_optimizer_step_on_one_rank_stops_both(tmp_path):
    # the step that reaches max_steps: without an agreement right after the step, rank 0 would end training while
    # rank 1, one step behind, waited for another batch
    result, dumps = run_fit(tmp_path, "--inject", "step", "--rank", 1, "--step-oom-at", 3, "--max-steps", 3)
    assert result["rc"] != 0
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert dumps[0]["global_step"] == 3  # rank 0 finished the step rank 1 failed


@pytest.fixture(scope="module")
def sync_bn_reference(tmp_path_factory) -> list[dict]:
    """Stock Lightning with synchronised BatchNorm: micro-batches of 4 with gradient accumulation from the start.

    Each BatchNorm forward normalises with the statistics of that micro-batch over both ranks, as OOMBackoff's
    micro-batches do once every rank backs off the same way.
    """
    out = tmp_path_factory.mktemp("sync_bn_reference")
    args = ("--inject", "none", "--batch-size", 4, "--accumulate", 2, "--no-backoff", "--sync-bn")
    result, dumps = run_fit(out, *args)
    assert result["rc"] == 0, result["output"][-3000:]
    return dumps


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_on_one_rank_with_synchronised_batchnorm_is_recovered_on_both(tmp_path, sync_bn_reference, where):
    # the forward fails after the BatchNorm layer gathered its statistics, the backward before the layer reduced its
    # sums: rank 1 replays the rest of the step's collectives on one sample, in the order rank 0 issues them
    result, dumps = run_fit(tmp_path, "--inject", where, "--rank", 1, "--sync-bn")
    assert result["rc"] == 0, result["output"][-3000:]
    assert "rank 1 ran out of memory at micro-batch size 8" in result["output"]
    assert [d["exception"] for d in dumps] == [None, None]
    assert [d["micro_batch_size"] for d in dumps] == [4, 4]
    assert [d["flag_carried"] for d in dumps] == [True, True]
    assert "norm.running_mean" in dumps[0]["params"]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)  # running statistics included
    # every later batch ran as 2 micro-batches on both ranks, normalised over both ranks' micro-batch
    assert_params_close(dumps[0]["params"], sync_bn_reference[0]["params"], atol=1e-5)
    every_index_once_per_epoch(dumps)


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_later_oom_with_synchronised_batchnorm_keeps_the_ranks_identical(tmp_path, where):
    # after DDP's bucket rebuild, following a whole batch: the replay skips the buckets already sent as well
    result, dumps = run_fit(tmp_path, "--inject", where, "--rank", 1, "--sync-bn", "--oom-from-batch", 1)
    assert result["rc"] == 0, result["output"][-3000:]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    assert [d["whole_batches"] for d in dumps] == [1, 1]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    assert all(torch.isfinite(v).all() for v in dumps[0]["params"].values())
    every_index_once_per_epoch(dumps)


@pytest.mark.distributed
def test_an_oom_in_the_optimizer_step_with_synchronised_batchnorm_stops_both(tmp_path):
    result, dumps = run_fit(tmp_path, "--inject", "step", "--rank", 1, "--sync-bn", timeout=120)
    assert result["rc"] != 0
    # a hang, not a speed: a rank left waiting for the other until a timeout (hang watchdog 10 min, process group 30)
    assert result["seconds"] < 60, "the ranks waited for a collective timeout instead of stopping together"
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert "rank 1 ran out of memory inside the optimizer step; every rank stops" in dumps[0]["exception"]["message"]


@pytest.mark.distributed
def test_ranks_with_batches_of_different_sizes_take_the_same_path_after_a_backoff(tmp_path):
    # rank 1's second batch holds 4 samples, no more than the micro-batch size: it still runs on the micro-batch path
    # with rank 0, whose batch of 8 is split (a path chosen from the batch size would mismatch the collectives)
    result, dumps = run_fit(tmp_path, "--inject", "forward", "--rank", 1, "--model", "uneven")
    assert result["rc"] == 0, result["output"][-3000:]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)


@pytest.mark.distributed
def test_synchronised_batchnorm_with_batches_of_different_sizes_stops_every_rank_with_a_reason(tmp_path):
    result, dumps = run_fit(tmp_path, "--inject", "forward", "--rank", 1, "--model", "uneven", "--sync-bn")
    assert result["rc"] != 0
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert all("the ranks' batches differ in size" in d["exception"]["message"] for d in dumps)


@pytest.mark.distributed
def test_synchronised_batchnorm_in_an_accumulation_window_averages_every_gradient(tmp_path):
    # a layer the window's first batch uses and its last does not: its gradient, set aside while the last batch
    # runs, is averaged too (no OOM here: the window's last batch runs on the micro-batch path; stock DDP needs
    # find_unused_parameters for this model, which keeps OOMBackoff on that path for every batch)
    args = ("--inject", "none", "--model", "branchy", "--sync-bn", "--accumulate", 2, "--find-unused")
    result, dumps = run_fit(tmp_path / "backoff", *args)
    assert result["rc"] == 0, result["output"][-3000:]
    result, stock = run_fit(tmp_path / "stock", *args, "--no-backoff")
    assert result["rc"] == 0, result["output"][-3000:]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    assert_params_close(dumps[0]["params"], stock[0]["params"], atol=1e-6)


@pytest.mark.distributed
def test_an_oom_after_the_last_bucket_went_stops_both_at_the_next_step(tmp_path):
    # rank 1 fails in on_after_backward: every rank has the step's averaged gradients and steps; the next step's
    # flag stops both, before anything else runs
    result, dumps = run_fit(tmp_path, "--inject", "none", "--model", "after-backward", timeout=120)
    assert result["rc"] != 0
    # a hang, not a speed: rank 0 left waiting for rank 1 in the next step until a timeout (watchdog 10 min, group 30)
    assert result["seconds"] < 60
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert "rank 1 failed in a hook after the backward" in dumps[0]["exception"]["message"]
    assert "CUDA out of memory" in dumps[1]["exception"]["message"]
    assert [d["global_step"] for d in dumps] == [2, 2]
    # rank 1 stepped with the averaged gradients too: the replicas stayed identical
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)


@pytest.mark.distributed
def test_an_oom_after_the_reduction_while_another_rank_failed_before_it_is_recovered_with_it(tmp_path, reference):
    # step 1: rank 0 runs out of memory in its forward (batches above 4 samples, from batch 1 on) and finishes the
    # reduction with the flag; rank 1 fails in on_after_backward, after the reduction. No rank steps on that batch:
    # both redo it in micro-batches of 4, and the fit goes on to the end as stock Lightning at that size
    result, dumps = run_fit(
        tmp_path, "--model", "after-backward", "--inject", "forward", "--rank", 0, "--oom-from-batch", 1, timeout=120
    )
    assert result["rc"] == 0, result["output"][-3000:]
    # the agreement names the highest failing rank: rank 1's failure after the reduction reached it
    assert "rank 1 ran out of memory at micro-batch size 8" in result["output"]
    assert [d["micro_batch_size"] for d in dumps] == [4, 4]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    every_index_once_per_epoch(dumps)
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    assert_params_close(dumps[0]["params"], reference[0]["params"], atol=1e-5)


# --------------------------------------------------------------------------------- accumulation windows of 2 batches
@pytest.fixture(scope="module")
def window_reference(tmp_path_factory) -> list[dict]:
    """What windows of 2 batches of 8 that back off to micro-batches of 4 must train as."""
    return stock_micro_batches(tmp_path_factory.mktemp("window_reference"), accumulate=4)


@pytest.mark.distributed
def test_in_an_accumulation_window_with_no_oom_every_batch_runs_whole_as_ddp_alone(tmp_path):
    # the window's first batch under no_sync, its last with DDP's overlapped reduction carrying the flag (the first
    # batch's gradients added into the buckets): the collectives of mgpu alone, and its parameters bit for bit
    runs = {}
    for name, extra in (("backoff", ()), ("alone", ("--no-backoff",))):
        result, dumps = run_fit(tmp_path / name, "--inject", "none", "--accumulate", 2, "--profile-step", 1, *extra)
        assert result["rc"] == 0, result["output"][-3000:]
        runs[name] = dumps
    for rank in range(2):
        alone, backoff = runs["alone"][rank], runs["backoff"][rank]
        assert alone["collectives"].get("gloo:all_reduce", 0) >= 1
        assert backoff["collectives"] == alone["collectives"], rank
        assert backoff["whole_batches"] == 4  # 2 epochs of one window of 2 batches
        assert_params_close(backoff["params"], alone["params"], atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("where", "ranks", "batches", "whole"),
    [
        # the window's first batch fails on rank 1: it recovers alone, and raises the flag at the last batch
        ("forward", 1, ("--oom-batches", 0), [1, 0]),
        ("backward", 1, ("--oom-batches", 0), [1, 0]),  # the head's gradients were added before it failed
        # the last batch fails: every rank goes back to the first batch's gradients and redoes the last
        ("backward", 1, ("--oom-from-batch", 1), [1, 1]),
        # both batches on both ranks
        ("backward", -1, ("--oom-from-batch", 0), [0, 0]),
    ],
)
def test_an_oom_in_an_accumulation_window_is_recovered_on_both(
    tmp_path, window_reference, where, ranks, batches, whole
):
    result, dumps = run_fit(tmp_path, "--inject", where, "--rank", ranks, *batches, "--accumulate", 2)
    assert result["rc"] == 0, result["output"][-3000:]
    assert "rank 1 ran out of memory at micro-batch size 8" in result["output"]
    assert [d["exception"] for d in dumps] == [None, None]
    assert [d["micro_batch_size"] for d in dumps] == [4, 4]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    assert [d["whole_batches"] for d in dumps] == whole
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    assert_params_close(dumps[0]["params"], window_reference[0]["params"], atol=1e-5)
    every_index_once_per_epoch(dumps)


@pytest.mark.distributed
def test_with_ddps_batched_gradient_copy_an_oom_in_a_windows_last_batch_is_recovered(tmp_path, window_reference):
    # batched_grad_copy defers each bucket's gradient copies until the bucket is ready: rank 1's backward fails with
    # some deferred, and every rank goes back to the set-aside gradients (bucket views) and redoes the last batch
    common = ("--accumulate", 2, "--batched-copy", "--bucket-view")
    result, dumps = run_fit(tmp_path, "--inject", "backward", "--rank", 1, "--oom-from-batch", 1, *common)
    assert result["rc"] == 0, result["output"][-3000:]
    assert [(d["recoveries"], d["whole_batches"]) for d in dumps] == [(1, 1), (1, 1)]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    assert_params_close(dumps[0]["params"], window_reference[0]["params"], atol=1e-5)
    every_index_once_per_epoch(dumps)


@pytest.mark.distributed
def test_a_forward_oom_early_in_a_window_with_buffers_does_not_broadcast_them_again(tmp_path):
    # a BatchNorm per process: DDP broadcasts its statistics in the window's first forward. Rank 1's forward fails
    # after that broadcast; its recovery must not broadcast them again on its own (a collective rank 0 never issues)
    result, dumps = run_fit(
        tmp_path, "--batchnorm", "--inject", "forward", "--rank", 1, "--oom-batches", 0, "--accumulate", 2, timeout=120
    )
    assert result["rc"] == 0, result["output"][-3000:]
    assert [d["exception"] for d in dumps] == [None, None]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    assert [d["whole_batches"] for d in dumps] == [1, 0]
    # the parameters (not the statistics, which each process keeps between broadcasts) are identical
    weights = [k for k in dumps[0]["params"] if not k.startswith("norm.running") and "num_batches" not in k]
    assert_params_close(*({k: dump["params"][k] for k in weights} for dump in dumps), atol=0)
    every_index_once_per_epoch(dumps)


@pytest.mark.distributed
def test_an_oom_at_the_floor_early_in_a_window_is_raised_at_once_and_the_other_rank_stops(tmp_path):
    # rank 1 cannot go below 8 samples in the window's first batch. It raises at once: waiting for the window's last
    # batch would leave rank 0's synchronised self.log (a collective in every batch) unmatched. Rank 0 stops at that
    # collective (gloo: the peer's socket closed, read as a FIN or as a reset, as the timing falls); no step was taken
    args = ("--model", "synced-log", "--inject", "forward", "--oom-batches", 0, "--accumulate", 2)
    result, dumps = run_fit(tmp_path, *args, "--min-micro-batch-size", 8, timeout=120)
    assert result["rc"] != 0
    # a hang, not a speed: rank 0 left waiting in its synchronised self.log until a timeout (watchdog 10 min, group 30)
    assert result["seconds"] < 60
    assert dumps[1]["exception"]["type"] == "OOMRecoveryError"
    assert "min_micro_batch_size=8 allows no smaller one" in dumps[1]["exception"]["message"]
    assert re.search(r"Connection (closed|reset) by peer", dumps[0]["exception"]["message"])
    assert [d["global_step"] for d in dumps] == [0, 0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("model", "inject", "batches", "whole"),
    [
        ("plain", "none", (), [6, 6]),  # the gradients are set to None between windows: fresh tensors, set aside
        ("keeps-grads", "none", (), [6, 6]),  # zero_grad(set_to_none=False): views of DDP's buckets, copied aside
        # in the third window: every rank goes back to the copies, or rank 1 recovers its first batch alone
        ("keeps-grads", "backward", ("--oom-from-step", 2, "--oom-from-batch", 1), [5, 5]),
        ("keeps-grads", "forward", ("--oom-from-step", 2, "--oom-batches", 0), [5, 4]),
    ],
)
def test_with_gradients_as_bucket_views_a_window_runs_whole(tmp_path, model, inject, batches, whole):
    # gradient_as_bucket_view: DDP's reduction writes each gradient into its bucket, which the gradients set aside
    # for the window's last batch may be views of; they must survive that backward, and its failure. One window per
    # epoch: in the second, the gradients set aside are views of the buckets DDP's rebuild (in that window's first
    # forward) let go of, so nothing writes over them; the third's are views of the rebuilt ones, which the last
    # backward writes into
    common = ("--model", model, "--accumulate", 2, "--bucket-view", "--max-epochs", 3)
    result, dumps = run_fit(tmp_path / "run", *common, "--inject", inject, "--rank", 1, *batches)
    assert result["rc"] == 0, result["output"][-3000:]
    assert [d["whole_batches"] for d in dumps] == whole
    assert [d["recoveries"] for d in dumps] == ([0, 0] if inject == "none" else [1, 1])
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
    if inject == "none":  # bit for bit what mgpu alone trains
        _, expected = run_fit(tmp_path / "alone", *common, "--inject", "none", "--no-backoff")
        assert_params_close(dumps[0]["params"], expected[0]["params"], atol=0)
    else:  # what stock Lightning trains with micro-batches of 4 from the start
        expected = stock_micro_batches(tmp_path / "stock", 4, "--model", model, "--bucket-view", "--max-epochs", 3)
        assert_params_close(dumps[0]["params"], expected[0]["params"], atol=1e-5)
        every_index_once_per_epoch(dumps)


# --------------------------------------------------------------------------------- parameters outside DDP's buckets
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("model", "inject", "batches", "accumulate"),
    [
        # a backoff: the callback averages the gradients itself
        ("ignored", "backward", ("--oom-from-batch", 1), 1),
        # an OOM in a window's first batch: its last batch runs again in micro-batches
        ("ignored", "backward", ("--oom-batches", 0), 2),
        # a window on the whole-batch path: the set-aside gradient of the bias is in no bucket
        ("ignored", "none", (), 2),
        # the whole-batch path, whose loss gradient is scaled for DDP's buckets only
        ("unfreezes", "none", (), 1),
        # the step that unfreezes it backs off
        ("unfreezes", "backward", ("--oom-from-batch", 1), 1),
    ],
)
def test_a_parameter_outside_ddps_buckets_is_trained_by_each_rank_alone(tmp_path, model, inject, batches, accumulate):
    # a parameter DDP ignores, or one unfrozen after DDP wrapped the model: each rank trains its own from its own
    # gradients, never averaged, as with stock DDP, on every path OOMBackoff takes
    common = ("--model", model, "--accumulate", accumulate)
    result, dumps = run_fit(tmp_path / "run", *common, "--inject", inject, "--rank", 1, *batches)
    assert result["rc"] == 0, result["output"][-3000:]
    assert [d["recoveries"] for d in dumps] == ([0, 0] if inject == "none" else [1, 1])
    if inject == "none":  # bit for bit what mgpu alone trains
        _, expected = run_fit(tmp_path / "alone", *common, "--inject", "none", "--no-backoff")
        atol = 0.0
    else:  # what stock Lightning trains with micro-batches of 4 from the start
        expected = stock_micro_batches(tmp_path / "stock", 2 * accumulate, "--model", model)
        atol = 1e-5
    local = ("head.bias",) if model == "ignored" else ("head.weight", "head.bias")
    assert not torch.equal(expected[0]["params"][local[0]], expected[1]["params"][local[0]])
    for rank in range(2):
        assert_params_close(dumps[rank]["params"], expected[rank]["params"], atol=atol)
    averaged = [name for name in dumps[0]["params"] if name not in local]
    assert_params_close(*({name: dump["params"][name] for name in averaged} for dump in dumps), atol=0)


@pytest.mark.distributed
def test_a_model_whose_parameters_ddp_reduces_itself_is_refused_on_every_rank(tmp_path):
    # delay_all_reduce_named_params: DDP all-reduces the head's bias by a hook of its own on every backward, which a
    # rank that fails or backs off alone would leave unmatched. Both ranks refuse before the first step, without a hang
    result, dumps = run_fit(tmp_path / "backoff", "--inject", "none", "--delay-head", timeout=120)
    assert result["rc"] != 0
    assert [d["exception"]["type"] for d in dumps] == ["MisconfigurationException"] * 2
    for dump in dumps:
        assert "delay_all_reduce_named_params: DDP issues an all-reduce" in dump["exception"]["message"]
        assert dump["global_step"] == 0
    # without the callback the model trains; bucket tuning (MultiGPUStrategy's default) is skipped: torch would add
    # its delayed all-reduce again at each trial's re-wrap
    result, dumps = run_fit(tmp_path / "alone", "--inject", "none", "--delay-head", "--no-backoff", timeout=120)
    assert result["rc"] == 0, result["output"][-3000:]
    for dump in dumps:
        assert dump["tuning"].reason.startswith("delay_all_reduce_named_params adds DDP's own all-reduce again")


@pytest.mark.distributed
def test_a_dropped_attempts_loss_spike_leaves_no_verdict_behind(tmp_path):
    # rank 0's whole-batch loss spikes at step 8 while rank 1 runs out of memory in its forward: every rank drops the
    # attempt and redoes the batch in micro-batches, whose loss does not spike. NaNSkip must judge the redo alone, or
    # rank 0 would skip the step rank 1 takes and the replicas part
    args = ("--model", "whole-batch-spikes", "--nan-skip", "--max-epochs", 5)
    result, dumps = run_fit(tmp_path, *args, "--inject", "forward", "--rank", 1, "--oom-from-step", 8)
    assert result["rc"] == 0, result["output"][-3000:]
    assert [(d["recoveries"], d["skipped_steps"], d["global_step"]) for d in dumps] == [(1, 0, 10), (1, 0, 10)]
    assert [d["spiked_attempts"] for d in dumps] == [1, 0]  # rank 0's dropped attempt spiked, once
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)
